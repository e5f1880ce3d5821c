"""vLLM 0.28.0's own Qwen3_VisionTransformer (model_executor/models/qwen3_vl.py, Qwen3.5's `visual`), built in this
process with seeded weights, and one image's patches encoded by it.

Build it inside conftest's `vllm_world` (its parallel linears ask for the tensor-parallel group). On the CPU two
pieces are replaced, as in tests/helpers/vision_encode.py: the bf16 linears' GEMM (`cpu_linear`, which the CPU
platform's process_weights_after_loading would set up from vllm._C) is F.linear, and the position-embedding
interpolation takes vLLM's torch path instead of the Triton kernel (NaN under TRITON_INTERPRET). On a GPU the
tower runs as vLLM runs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# A small tower: 4 blocks, a merger 2.7x a block's size, every other dimension shrunk.
SMALL = {"depth": 4, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 96,
         "patch_size": 4, "num_position_embeddings": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
         "in_channels": 3, "hidden_act": "gelu_pytorch_tanh"}
WEIGHT_STD = 0.05


def build(vision_config: dict, device: str = "cpu", seed: int | None = 0) -> torch.nn.Module:
    """The tower in BF16 on `device`, its parameters drawn from a seeded normal (none drawn when seed is None,
    e.g. on the meta device)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models import qwen3_vl
    from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5VisionConfig
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = Qwen3_5VisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
    with set_current_vllm_config(VllmConfig()), set_default_torch_dtype(torch.bfloat16), torch.device(device):
        tower = qwen3_vl.Qwen3_VisionTransformer(config, norm_eps=1e-6, prefix="visual")
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        for param in tower.parameters():
            param.data.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_STD)
    if device == "cpu":
        for module in tower.modules():
            if type(getattr(module, "quant_method", None)).__name__.startswith("Unquantized"):
                module.cpu_linear = F.linear
    return tower


def patches(tower: torch.nn.Module, grid: tuple[int, int, int], seed: int = 1) -> torch.Tensor:
    """Random pixel patches of one image of `grid` (frames, rows, columns of patches), as the processor emits them."""
    t, h, w = grid
    values = 3 * tower.temporal_patch_size * tower.patch_size ** 2
    return torch.randn(t * h * w, values, generator=torch.Generator().manual_seed(seed))


def encode(tower: torch.nn.Module, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """The tower's forward on one image (what embed_multimodal calls), in vLLM's forward context and in inference
    mode, as vLLM's model runner calls it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models import qwen3_vl

    config = VllmConfig()
    triton = qwen3_vl.HAS_TRITON
    qwen3_vl.HAS_TRITON = triton and tower.patch_embed.proj.weight.is_cuda  # the Triton kernel on a GPU only
    try:
        with torch.inference_mode(), set_current_vllm_config(config), set_forward_context(None, config):
            return tower(pixels, [list(grid)])
    finally:
        qwen3_vl.HAS_TRITON = triton
