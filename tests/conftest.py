"""Shared test setup: CPU shims before any vLLM import, the `gpu` marker, and the fixtures several test
modules use (helper code they share lives in tests/helpers/; no test module imports another)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device machine: tests/gpu/README.md)")


def pytest_sessionstart(session: pytest.Session) -> None:
    # Before collection imports any test module. Not in an xdist controller: it imports no test and would pay
    # vLLM's import (seconds of CPU) before the workers start.
    if session.config.pluginmanager.has_plugin("dsession"):
        return
    from qwen_serving.engine import cpu_compat

    cpu_compat.install()
    cpu_compat.inspect_models_in_process()


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


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory):
    """Single-process gloo world + the CPU-only gap of model construction (see comments), for tests that
    build a model through vLLM's own initialize_model."""
    import torch
    import vllm

    patched = os.environ.get("QS_PATCHED_VLLM")
    if patched:
        assert Path(vllm.__file__).resolve().parent == Path(patched).resolve(), (
            f"vllm imported from {vllm.__file__}, expected the patched copy {patched}"
        )
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with torch.library._scoped_library("_C", "FRAGMENT") as c_ops:
        # SiluAndMul binds torch.ops._C.silu_and_mul at construction; CPU wheels-without-_C lack the
        # schema. Construction only needs it to exist: nothing here runs an MLP.
        if not hasattr(torch.ops._C, "silu_and_mul"):
            c_ops.define("silu_and_mul(Tensor! out, Tensor input) -> ()")
        owns_world = not ps.model_parallel_is_initialized()
        if owns_world:
            dist_file = tmp_path_factory.mktemp("dist") / "rendezvous"
            with set_current_vllm_config(VllmConfig()):
                ps.init_distributed_environment(
                    world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{dist_file}", backend="gloo"
                )
                ps.initialize_model_parallel(1, 1)
        yield
        if owns_world:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


@pytest.fixture(scope="session")
def vllm_cli():
    """vLLM 0.28.0's own `vllm serve` and `vllm bench serve` parsers (tests/helpers/vllm_cli.py)."""
    from tests.helpers.vllm_cli import VllmCli

    return VllmCli()
