"""A vLLM-style paged KV cache with random contents, and the split-KV verify kernel checked against its
fp32 reference on one (tests/test_kernel_spec_attn.py, the attention hook tests)."""

from __future__ import annotations

import torch

from qwen_serving.engine.kernels.spec_attn import SpecAttention, spec_attention_reference


def make_paged(seq_lens, q_lens, hq, hkv, d, page, dtype=torch.bfloat16, packed=True, seed=0, spare_blocks=3):
    """Random q and a vLLM-style paged cache with shuffled block ids; packed = FlashAttention 0.28.0 layout."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-s // page) for s in seq_lens]
    num_blocks = sum(pages_per_req) + spare_blocks
    if packed:  # physical (num_blocks, block_size, Hkv, 2*D): K and V interleaved per head
        kv = torch.randn(num_blocks, page, hkv, 2 * d, generator=gen).to(dtype)
        key_cache, value_cache = kv[..., :d], kv[..., d:]
    else:
        kv = torch.randn(2, num_blocks, page, hkv, d, generator=gen).to(dtype)
        key_cache, value_cache = kv[0], kv[1]
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(pages_per_req) + 2
    block_table = torch.full((len(seq_lens), width), 10**6, dtype=torch.int32)  # junk past each request's pages
    used = 0
    for b, n in enumerate(pages_per_req):
        block_table[b, :n] = perm[used : used + n].int()
        used += n
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, d, generator=gen).to(torch.bfloat16)
    return q, key_cache, value_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), qsl


def run_and_compare(seq_lens, q_lens, hq, hkv, d, page, splits, atol=2e-2, **kw):
    q, kc, vc, bt, sl, qsl = make_paged(seq_lens, q_lens, hq, hkv, d, page, **kw)
    attn = SpecAttention(hq, hkv, d, max_batch=len(seq_lens), max_query_len=16, max_splits=8, device="cpu",
                         block_n=16)
    scale = d**-0.5
    got = attn(q, kc, vc, bt, sl, qsl, max(q_lens), scale, num_splits=splits)
    want = spec_attention_reference(q, kc, vc, bt, sl, qsl, scale)
    err = (got.float() - want).abs().max().item()
    assert err <= atol, err
    return got
