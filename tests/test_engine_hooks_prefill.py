"""patches/prefill-int8-attn.patch: one request's prefill chunk on the FlashAttention backend goes to
kernels.prefill_int8_attn, its context gathered from the paged cache.

The reference is exact causal attention over the same paged cache (spec_attention_reference), so the
gather (pages, block table, the chunk's position after its context) is checked along with the kernel;
tolerance as tests/test_kernel_prefill_int8_attn.py: cosine >= 0.9999 per head, max |error| <= 0.05.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qwen_serving.engine import attn_routing
from qwen_serving.engine.kernels.spec_attn import spec_attention_reference
from tests.helpers.flash_attn_fakes import impl_like, metadata_for, recording_flash_attn
from tests.helpers.paged_kv import make_paged

PAGE = 16


def close_enough(got: torch.Tensor, want: torch.Tensor) -> None:
    cos = torch.nn.functional.cosine_similarity(got.float().transpose(0, 1).flatten(1),
                                                want.transpose(0, 1).flatten(1), dim=1)
    assert cos.min() >= 0.9999, cos.min()
    assert (got.float() - want).abs().max() <= 0.05


def test_layer_refusals():
    assert attn_routing.prefill_layer_refusal(impl_like()) is None
    assert "head size" in attn_routing.prefill_layer_refusal(impl_like(head_size=128))
    assert "fp8" in attn_routing.prefill_layer_refusal(impl_like(kv_cache_dtype="fp8"))
    assert "window" in attn_routing.prefill_layer_refusal(impl_like(sliding_window=(1023, 0)))


def test_single_request_prefill_chunks_only():
    md, q, kc, _ = metadata_for([40], [100])
    assert attn_routing.takes_prefill_path(md, q, kc)
    assert attn_routing.takes_prefill_path(*metadata_for([100], [100])[:3])  # a first chunk: no context yet
    refused = {
        "two requests": metadata_for([40, 40], [100, 60])[:3],
        "a verify step": metadata_for([5], [100])[:3],
        "cascade": metadata_for([40], [100], use_cascade=True)[:3],
        "non-causal": metadata_for([40], [100], causal=False)[:3],
        "context shorter than the chunk": metadata_for([40], [100], max_seq_len=30)[:3],
        "fp16 cache, bf16 queries": (md, q, kc.half()),
        "fp8 cache": (md, q, kc.to(torch.float8_e4m3fn)),
    }
    for why, args in refused.items():
        assert not attn_routing.takes_prefill_path(*args), why


def test_run_prefill_gathers_the_context():
    # a 37-token chunk after 80 tokens of context, over shuffled pages; the block table's tail is junk
    q, kc, vc, bt, sl, qsl = make_paged([117], [37], 6, 1, 64, PAGE, seed=4)
    md = SimpleNamespace(max_query_len=37, max_seq_len=117, block_table=bt)
    output = torch.full((40, 6, 64), 7.0, dtype=q.dtype)  # 3 padding rows past the chunk
    attn_routing.run_prefill(torch.cat([q, torch.zeros(3, 6, 64, dtype=q.dtype)]), kc, vc, md, output, 0.125)
    close_enough(output[:37], spec_attention_reference(q, kc, vc, bt, sl, qsl, 0.125))
    assert (output[37:] == 7.0).all()


@pytest.fixture
def flash_attn(monkeypatch):
    return recording_flash_attn(monkeypatch)


@pytest.mark.parametrize("enabled", [True, False])
def test_flash_attention_impl_routes_prefill_chunks(flash_attn, monkeypatch, enabled):
    from vllm.config import VllmConfig, set_current_vllm_config

    fa, varlen_calls = flash_attn
    monkeypatch.setenv("VLLM_PREFILL_INT8_ATTN", "1" if enabled else "0")
    hq, hkv, d = 2, 1, 256
    with set_current_vllm_config(VllmConfig()):
        impl = fa.FlashAttentionImpl(num_heads=hq, head_size=d, scale=d**-0.5, num_kv_heads=hkv, alibi_slopes=None,
                                     sliding_window=None, kv_cache_dtype="auto")
    impl.vllm_flash_attn_version = 2  # not detected on CPU
    assert impl.prefill_int8 is enabled
    layer = SimpleNamespace(_q_scale=torch.ones(1), _k_scale=torch.ones(1), _v_scale=torch.ones(1))
    for q_lens, seq_lens in (([24], [56]), ([24, 3], [56, 20])):
        q, kc, vc, bt, sl, qsl = make_paged(seq_lens, q_lens, hq, hkv, d, PAGE, seed=5)
        kv_cache = kc.as_strided(kc.shape[:3] + (2 * d,), kc.stride()).transpose(1, 2)  # packed K|V, logical
        md = fa.FlashAttentionMetadata(
            num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), query_start_loc=qsl, max_seq_len=max(seq_lens),
            seq_lens=sl, block_table=bt, slot_mapping=None, use_cascade=False, common_prefix_len=0,
            cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None)
        output = torch.empty_like(q)
        impl.forward(layer, q, None, None, kv_cache, md, output)
        close_enough(output, spec_attention_reference(q, kc, vc, bt, sl, qsl, d**-0.5))
    # the single-request chunk went to the int8 kernel only when enabled; the two-request batch never did
    assert varlen_calls == ([24] if enabled else [24, 24])
