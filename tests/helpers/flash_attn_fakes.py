"""Stand-ins for the FlashAttention backend's objects, for the attention hook tests: a layer (impl), a
batch's metadata over a random paged cache, and the patched backend with a recording varlen function."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from qwen_serving.engine.kernels.spec_attn import spec_attention_reference
from tests.helpers.paged_kv import make_paged

HQ, HKV, D, PAGE = 12, 2, 32, 16


def impl_like(**overrides):
    fields = dict(attn_type="decoder", alibi_slopes=None, sliding_window=(-1, -1), logits_soft_cap=0, sinks=None,
                  dcp_world_size=1, head_size=256, kv_cache_dtype="auto", num_heads=24, num_kv_heads=4,
                  vllm_flash_attn_version=2)
    return SimpleNamespace(**{**fields, **overrides})


def metadata_for(q_lens, seq_lens, **overrides):
    q, kc, vc, bt, sl, qsl = make_paged(seq_lens, q_lens, HQ, HKV, D, PAGE)
    fields = dict(num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), query_start_loc=qsl,
                  max_seq_len=max(seq_lens), seq_lens=sl, block_table=bt, use_cascade=False, causal=True,
                  mm_prefix_query_range_tensor=None, rswa_prefix_lens=None)
    return SimpleNamespace(**{**fields, **overrides}), q, kc, vc


def recording_flash_attn(monkeypatch):
    """The patched backend module, with a recording flash_attn_varlen_func (no FlashAttention on CPU): it keeps
    each call's max_seqlen_q and computes the reference attention. Returns (module, calls)."""
    fa = pytest.importorskip("vllm.v1.attention.backends.flash_attn")
    calls = []

    def varlen(q, k, v, out, cu_seqlens_q, seqused_k, softmax_scale, block_table, **kwargs):
        calls.append(kwargs["max_seqlen_q"])
        out.copy_(spec_attention_reference(q, k, v, block_table, seqused_k, cu_seqlens_q, softmax_scale))

    monkeypatch.setattr(fa, "flash_attn_varlen_func", varlen, raising=False)
    return fa, calls
