"""The KV-cache specs of Qwen3.8-27B's layers. qwen38_kv_specs: with and without the DFlash2 drafter's five
sliding-window layers, as the design probe ../shared/design/cpu-venv/kvgroups.py gives them (bf16; attention blocks
of 2,176 tokens, the size vLLM derives to match the GDN state page; the drafter's window layers at half that, padded
to the same page). served_kv_specs: as vLLM 0.28.0 builds them for a served cache dtype and draft length."""

from __future__ import annotations

import torch

ATTENTION_BLOCK = 2176


def qwen38_kv_specs(with_drafter: bool) -> dict:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    block = ATTENTION_BLOCK
    full = FullAttentionSpec(block_size=block, num_kv_heads=4, head_size=256, dtype=torch.bfloat16)
    page = full.page_size_bytes
    gdn = MambaSpec(block_size=block, shapes=((3, 8192), (48, 128, 128)), dtypes=(torch.bfloat16, torch.float16),
                    page_size_padded=page)
    window = SlidingWindowSpec(block_size=block // 2, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                               sliding_window=2048, page_size_padded=page)
    specs = {f"model.layers.{i}.self_attn": full for i in range(16)}
    specs |= {f"model.layers.{16 + i}.linear_attn": gdn for i in range(48)}
    if with_drafter:
        specs |= {f"draft.layers.{i}.self_attn": window for i in range(5)}
    return specs


def served_kv_specs(kv_dtype: str, spec_tokens: int, prefix_cache: bool = True, max_model_len: int = 65536) -> dict:
    """The specs vLLM 0.28.0 builds for the target's 16 attention and 48 GDN layers and the DFlash2 drafter's 5
    window layers on Triton (bf16 pages are the same bytes on FlashAttention), before unify_kv_cache_spec_page_size:
    - the attention block: the platform's hybrid alignment (platforms/interface.py _align_hybrid_block_size, its
      branch for mamba_cache_mode other than "all"): the smallest multiple of the kernel block (16) whose page holds
      one GDN state, and the GDN page padded to it;
    - the window layers: Attention.get_kv_cache_spec's sliding-window branch, no shared-page hint, so the
      smallest kernel block (_largest_kernel_block_within), and the cache dtype of the target (one cache_config);
    - every attention spec through the backend's block-stride flag and customize_spec, as the runner does
      (v1/worker/gpu/attn_utils.py get_kv_cache_spec).
    Without prefix caching the GDN block is max_model_len (model_executor/models/config.py)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.utils.math_utils import cdiv
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend as backend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec, get_kv_quant_mode

    from qwen_serving import model

    dtype = torch.bfloat16 if kv_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[kv_dtype]
    quant = get_kv_quant_mode(kv_dtype)
    with set_current_vllm_config(VllmConfig()):
        by_stride = backend.indexes_kv_by_block_stride()
    kernel_block = min(s.base if isinstance(s, MultipleOf) else s for s in backend.get_supported_kernel_block_sizes())

    def attention(cls, block: int, heads: int, head_dim: int, **more):
        return backend.customize_spec(cls(block_size=block, num_kv_heads=heads, head_size=head_dim, dtype=dtype,
                                          kv_quant_mode=quant, indexes_kv_by_block_stride=by_stride, **more))

    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, model.GDN_K_HEADS, model.GDN_V_HEADS, model.GDN_HEAD_DIM, model.GDN_HEAD_DIM, model.CONV_KERNEL,
        spec_tokens)
    state_dtypes = (torch.bfloat16, torch.float16)  # conv tail in the model dtype, --mamba-ssm-cache-dtype float16
    state_page = MambaSpec(block_size=-1, shapes=shapes, dtypes=state_dtypes).page_size_bytes
    per_token = attention(FullAttentionSpec, 1, model.KV_HEADS, model.HEAD_DIM).page_size_bytes
    block = kernel_block * cdiv(state_page, kernel_block * per_token)
    full = attention(FullAttentionSpec, block, model.KV_HEADS, model.HEAD_DIM)
    gdn = MambaSpec(block_size=block if prefix_cache else max_model_len, shapes=shapes, dtypes=state_dtypes,
                    page_size_padded=full.page_size_bytes, mamba_cache_mode="align" if prefix_cache else "none",
                    num_speculative_blocks=spec_tokens)
    window_per_token = attention(SlidingWindowSpec, 1, model.DRAFTER_KV_HEADS, model.DRAFTER_HEAD_DIM,
                                 sliding_window=model.DRAFTER_WINDOW).real_page_size_bytes
    window = attention(SlidingWindowSpec, _largest_kernel_block_within(backend, window_per_token, None, block),
                       model.DRAFTER_KV_HEADS, model.DRAFTER_HEAD_DIM, sliding_window=model.DRAFTER_WINDOW)
    specs = {f"model.layers.{i}.self_attn": full for i in range(model.ATTN_LAYERS)}
    specs |= {f"model.layers.{model.ATTN_LAYERS + i}.linear_attn": gdn for i in range(model.GDN_LAYERS)}
    specs |= {f"draft.layers.{i}.self_attn": window for i in range(model.DRAFTER_LAYERS)}
    return specs
