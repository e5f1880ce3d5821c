"""patches/spec-decode-attn.patch: verify batches on the FlashAttention backend go to kernels.spec_attn.

The routing rules on their own, then the patched FlashAttentionImpl itself on CPU (kernel interpreted by Triton):
its verify batches must equal the kernel's torch reference over the same paged cache, and everything else must
reach flash_attn_varlen_func (absent on CPU: a recording stand-in computes the same reference).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qwen_serving.engine import attn_routing
from qwen_serving.engine.kernels.spec_attn import SpecAttention, spec_attention_reference
from tests.helpers.flash_attn_fakes import HKV, HQ, PAGE, D, impl_like, metadata_for, recording_flash_attn
from tests.helpers.paged_kv import make_paged


def test_layer_refusals():
    assert attn_routing.layer_refusal(impl_like()) is None
    refused = {
        "encoder_only": dict(attn_type="encoder_only"),
        "ALiBi": dict(alibi_slopes=torch.ones(24)),
        "window": dict(sliding_window=(511, 0)),
        "soft cap": dict(logits_soft_cap=30.0),
        "sinks": dict(sinks=torch.zeros(24)),
        "context parallel": dict(dcp_world_size=2),
        "head size 80": dict(head_size=80),
        "head size 8": dict(head_size=8),
        "int8_per_token_head": dict(kv_cache_dtype="int8_per_token_head"),
        "fp8_e5m2": dict(kv_cache_dtype="fp8_e5m2"),
        # FlashAttention takes fp8 only on sm90/sm100, quantizing the query too: unreachable for the kernel
        "fp8": dict(kv_cache_dtype="fp8"),
        "fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"),
        # sm90 runs FA3, faster than the kernels at every geometry measured; sm100's FA4 is unmeasured
        "FA3": dict(vllm_flash_attn_version=3),
        "FA4": dict(vllm_flash_attn_version=4),
    }
    for why, fields in refused.items():
        assert attn_routing.layer_refusal(impl_like(**fields)) is not None, why
        assert attn_routing.prefill_layer_refusal(impl_like(**fields)) is not None, why
    assert attn_routing.layer_refusal(impl_like(vllm_flash_attn_version=None)) is None  # CPU: nothing to ask


def test_scratch_geometry():
    # 27B single-user MTP-4: 8 requests x 5 query tokens x 6 heads per KV head; one wave of 82 SMs = 21 splits
    mtp = attn_routing.verify_geometry(impl_like(), max_num_seqs=8, num_speculative_tokens=4, num_sms=82)
    assert (mtp.max_batch, mtp.max_query_len, mtp.max_splits) == (8, 5, 21)
    assert mtp.scratch_bytes() == 8 * 4 * 21 * 30 * 257 * 4
    # 16-token verify blocks for 16 requests would need 130 MB at 21 splits: the splits shrink to the budget
    long = attn_routing.verify_geometry(impl_like(), max_num_seqs=16, num_speculative_tokens=15, num_sms=82)
    assert long.max_query_len == 16 and long.max_splits == 10
    assert long.scratch_bytes() <= attn_routing.SCRATCH_BUDGET_BYTES
    assert attn_routing.verify_geometry(impl_like(), 8, None, 132).max_query_len == attn_routing.MAX_VERIFY_QUERY
    huge = attn_routing.verify_geometry(impl_like(), max_num_seqs=1024, num_speculative_tokens=15, num_sms=132)
    assert huge.max_splits == 1  # never below one split, whatever the budget says


def test_verify_batches_only():
    attn = SpecAttention(HQ, HKV, D, max_batch=4, max_query_len=8, max_splits=4, device="cpu")
    md, q, kc, vc = metadata_for([5, 5, 5], [40, 70, 5])
    assert attn_routing.takes_verify_path(attn, md, q, kc)
    refused = {
        "plain decode": metadata_for([1, 1], [40, 70]),
        "drafts for some requests only": metadata_for([5, 1, 5], [40, 70, 9]),
        "a prefill chunk": metadata_for([5, 40], [40, 70]),
        "longer than the scratch": metadata_for([9, 9], [40, 70]),
        "more requests than the scratch": metadata_for([2] * 5, [40] * 5),
        "cascade": metadata_for([5, 5], [40, 70], use_cascade=True),
        "per-request causality": metadata_for([5, 5], [40, 70], causal=torch.ones(2, dtype=torch.int32)),
        "non-causal": metadata_for([5, 5], [40, 70], causal=False),
        "multimodal prefix": metadata_for([5, 5], [40, 70], mm_prefix_query_range_tensor=torch.zeros(10, 2)),
    }
    for why, (md_, q_, kc_, _) in refused.items():
        assert not attn_routing.takes_verify_path(attn, md_, q_, kc_), why
    assert not attn_routing.takes_verify_path(attn, md, q.to(torch.float8_e4m3fn), kc.to(torch.float8_e4m3fn))
    assert not attn_routing.takes_verify_path(attn, md, q, kc.to(torch.float8_e4m3fn))
    assert not attn_routing.takes_verify_path(attn, md, q, kc.half())


@pytest.fixture
def flash_attn(monkeypatch):
    recorded = recording_flash_attn(monkeypatch)
    attn_routing.release_verify_kernels()
    yield recorded
    attn_routing.release_verify_kernels()


def build_impl(fa, monkeypatch, enabled: bool, hq: int = HQ, hkv: int = HKV, d: int = D):
    from vllm.config import VllmConfig, set_current_vllm_config

    monkeypatch.setenv("VLLM_SPEC_DECODE_ATTN", "1" if enabled else "0")
    config = VllmConfig()
    config.scheduler_config.max_num_seqs = 4
    with set_current_vllm_config(config):
        impl = fa.FlashAttentionImpl(num_heads=hq, head_size=d, scale=d**-0.5, num_kv_heads=hkv, alibi_slopes=None,
                                     sliding_window=None, kv_cache_dtype="auto")
    impl.vllm_flash_attn_version = 2  # not detected on CPU; the verify branch never reads it
    return impl


def forward(fa, impl, q_lens, seq_lens):
    q, kc, vc, bt, sl, qsl = make_paged(seq_lens, q_lens, HQ, HKV, D, PAGE)
    kv_cache = kc.as_strided(kc.shape[:3] + (2 * D,), kc.stride())  # physical (blocks, page, Hkv, 2D): K | V
    kv_cache = kv_cache.transpose(1, 2)  # the logical (blocks, Hkv, page, 2D) vLLM passes in
    md = fa.FlashAttentionMetadata(num_actual_tokens=int(qsl[-1]), max_query_len=max(q_lens), query_start_loc=qsl,
                                   max_seq_len=max(seq_lens), seq_lens=sl, block_table=bt, slot_mapping=None,
                                   use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None,
                                   prefix_kv_lens=None, suffix_kv_lens=None)
    layer = SimpleNamespace(_q_scale=torch.ones(1), _k_scale=torch.ones(1), _v_scale=torch.ones(1))
    output = torch.empty_like(q)
    impl.forward(layer, q, None, None, kv_cache, md, output)
    want = spec_attention_reference(q, kc, vc, bt, sl, qsl, D**-0.5)
    return (output.float() - want).abs().max().item()


def test_flash_attention_impl_routes_verify_batches(flash_attn, monkeypatch):
    fa, varlen_calls = flash_attn
    impl = build_impl(fa, monkeypatch, enabled=True)
    assert impl.verify_attention is not None
    assert impl.verify_attention.max_batch == 4  # sized from the scheduler's max_num_seqs
    assert build_impl(fa, monkeypatch, enabled=True).verify_attention is impl.verify_attention  # one scratch
    assert forward(fa, impl, [5, 5, 5], [37, 100, 5]) <= 2e-2
    assert varlen_calls == []
    assert forward(fa, impl, [5, 1, 5], [37, 100, 9]) <= 2e-2  # not uniform: FlashAttention
    assert varlen_calls == [5]


def test_flash_attention_impl_switched_off(flash_attn, monkeypatch):
    fa, varlen_calls = flash_attn
    impl = build_impl(fa, monkeypatch, enabled=False)
    assert impl.verify_attention is None
    assert forward(fa, impl, [3, 3], [20, 40]) <= 2e-2
    assert varlen_calls == [3]


def test_flash_attention_3_keeps_its_verify_batches(flash_attn, monkeypatch):
    """On sm90 vLLM picks FA3, faster than the kernel at every verify context measured: no kernel for the layer."""
    fa, varlen_calls = flash_attn
    monkeypatch.setattr(fa, "get_flash_attn_version", lambda *args, **kwargs: 3)
    impl = build_impl(fa, monkeypatch, enabled=True)
    assert impl.verify_attention is None


def test_flash_attention_impl_at_the_tiny_engine_geometry(flash_attn, monkeypatch):
    # The H200 MTP engine's verify steps (engine-hooks-h200.json): 6 query heads on one KV head of 256, a hybrid
    # model's attention pages (208 tokens, each block's bytes padded to the shared mamba page), queries a view
    # of the fused qkv rows, 4 requests x 5 tokens, 32 splits (one wave of 132 SMs) over at most 4 tiles each.
    fa, varlen_calls = flash_attn
    hq, hkv, d, page, q_len, seq_lens = 6, 1, 256, 208, 5, [241, 194, 235, 98]
    impl = build_impl(fa, monkeypatch, enabled=True, hq=hq, hkv=hkv, d=d)
    impl.verify_attention = SpecAttention(hq, hkv, d, max_batch=4, max_query_len=q_len, max_splits=32, device="cpu")
    impl.verify_attention._num_sms = 132
    gen = torch.Generator().manual_seed(5)
    pages = [-(-s // page) for s in seq_lens]
    blocks = sum(pages) + 2
    padded = torch.randn(blocks, hkv * page * 2 * d + 256, generator=gen).bfloat16()
    kv_cache = padded[:, : hkv * page * 2 * d].view(blocks, hkv, page, 2 * d)  # logical (blocks, Hkv, page, 2D)
    perm = torch.randperm(blocks, generator=gen).int()
    block_table = torch.zeros(4, max(pages) + 3, dtype=torch.int32)
    for b, start in enumerate(torch.tensor([0, *pages]).cumsum(0)[:-1].tolist()):
        block_table[b, : pages[b]] = perm[start : start + pages[b]]
    qsl = torch.arange(0, 4 * q_len + 1, q_len, dtype=torch.int32)
    qkv = torch.randn(4 * q_len + 2, (hq + 2 * hkv) * d, generator=gen).bfloat16()  # 2 padding rows
    query = qkv[:, : hq * d].view(-1, hq, d)
    md = fa.FlashAttentionMetadata(num_actual_tokens=4 * q_len, max_query_len=q_len, query_start_loc=qsl,
                                   max_seq_len=max(seq_lens), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                   block_table=block_table, slot_mapping=None, use_cascade=False,
                                   common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
                                   suffix_kv_lens=None)
    layer = SimpleNamespace(_q_scale=torch.ones(1), _k_scale=torch.ones(1), _v_scale=torch.ones(1))
    output = torch.full((query.shape[0], hq, d), 7.0, dtype=torch.bfloat16)
    impl.forward(layer, query, None, None, kv_cache, md, output)
    assert varlen_calls == []
    key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
    want = spec_attention_reference(query[: 4 * q_len], key_cache, value_cache, block_table, md.seq_lens, qsl,
                                    d**-0.5)
    assert (output[: 4 * q_len].float() - want).abs().max() <= 2e-2
    assert (output[4 * q_len :] == 7.0).all()
