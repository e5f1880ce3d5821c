"""The two vLLM trees tests/run.sh provides: the venv's pristine package and the patched copy."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

ENV = {"pristine": "QS_PRISTINE_VLLM", "patched": "QS_PATCHED_VLLM"}


def tree(name: str) -> Path:
    path = os.environ.get(ENV[name])
    if not path:
        pytest.skip(f"{ENV[name]} is unset: run through tests/run.sh")
    return Path(path)


def load(name: str, relpath: str) -> ModuleType:
    """One module file of the ``name`` tree under a private module name; its own imports resolve to
    whatever `vllm` is importable (the patched copy under tests/run.sh)."""
    package, _, stem = relpath.removesuffix(".py").rpartition("/")
    # a sibling of the real module, so relative imports resolve inside the importable vllm
    module_name = ".".join(["vllm", *package.split("/"), f"qs_{name}_{stem}"]) if package else f"vllm.qs_{name}_{stem}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, tree(name) / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the body runs
    spec.loader.exec_module(module)
    return module
