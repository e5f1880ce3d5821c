"""Make vLLM 0.28.0 importable, and its Triton kernels runnable, on a machine with no GPU.

Only for CPU hosts (tests, ``plan --dry-run``); on a CUDA machine ``install()`` does nothing.
"""

from __future__ import annotations

import os

_installed = False


def install() -> None:
    """Idempotent. Must run before the first ``import vllm`` (and before Triton kernels are defined)."""
    global _installed
    if _installed:
        return
    _installed = True
    import torch

    if torch.cuda.is_available():
        return
    # vLLM cannot infer a device type without a GPU; the CPU platform is enough to parse and build configs.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # Triton kernels run in the interpreter; must be set before any @triton.jit is evaluated.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # PyPI's torchvision is a CUDA build whose _C cannot load against CPU torch, yet it registers fake
    # kernels for nms/qnms at import: the schemas must exist or `import transformers` image code fails.
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    globals()["_torchvision_lib"] = lib  # keep the registration alive
    # The vllm wheel is a CUDA build: its CPU kernels are not in it, yet on a CPU with AMX tiles vLLM's CPU
    # linear/conv dispatch calls one (torch.ops._C.causal_conv1d_weight_pack); report no AMX so it keeps torch's.
    torch.cpu._is_amx_tile_supported = lambda: False
    # vLLM swaps Triton for placeholders unless a GPU driver is active; the interpreter needs the real one.
    try:
        from triton.backends import backends
    except ImportError:
        return
    for backend in backends.values():
        if backend.driver is not None:
            backend.driver.is_active = staticmethod(lambda: True)
            break


def inspect_models_in_process() -> None:
    """vLLM inspects model classes in a fresh interpreter, which lacks these shims on a CPU host.

    Inspecting in-process is safe here (no CUDA state to protect). Imports vLLM, so call it only where
    vLLM is needed anyway (tests), after ``install()``.
    """
    import torch

    if torch.cuda.is_available():
        return
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()
