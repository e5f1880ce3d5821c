"""Shared test setup: CPU shims before any vLLM import, and the `gpu` marker."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from qwen_serving.engine import cpu_compat  # noqa: E402

cpu_compat.install()
cpu_compat.inspect_models_in_process()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device machine: tests/gpu/README.md)")


@pytest.fixture(scope="session")
def pristine_vllm() -> Path:
    """The venv's untouched vllm package (read it, never write it)."""
    path = os.environ.get("QS_PRISTINE_VLLM")
    if not path:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        assert spec and spec.origin, "vllm is not importable"
        path = str(Path(spec.origin).parent)
    return Path(path)
