"""The KV-cache specs of Qwen3.8-27B's layers, with and without the DFlash2 drafter's five sliding-window layers,
as the design probe ../shared/design/cpu-venv/kvgroups.py gives them (bf16; attention blocks of 2,176 tokens, the
size vLLM derives to match the GDN state page; the drafter's window layers at half that, padded to the same page)."""

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
