"""int8-QK prefill attention (Triton, interpreted on CPU) against an fp32 causal reference.

Tolerance: cosine similarity >= 0.9999 per query head against fp32, max |error| <= 0.05, with bf16 inputs
(the issue's bar is cos >= 0.9999 at 4k-51k tokens; tests/gpu checks those lengths on the H200).
"""

from __future__ import annotations

import pytest
import torch

from qwen_serving.engine.kernels.prefill_int8_attn import prefill_attention_reference, prefill_int8_attention


def _qkv(n_q, n_k, hq, hkv, d, seed=0, key_bias=0.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, hq, d, generator=gen)
    k = torch.randn(n_k, hkv, d, generator=gen) + key_bias * torch.randn(1, hkv, d, generator=gen)
    v = torch.randn(n_k, hkv, d, generator=gen)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _check(q, k, v, **kw):
    got = prefill_int8_attention(q, k, v, **kw).float()
    want = prefill_attention_reference(q, k, v)
    cos = torch.nn.functional.cosine_similarity(got.transpose(0, 1).flatten(1), want.transpose(0, 1).flatten(1), dim=1)
    assert cos.min() >= 0.9999, cos.min()
    assert (got - want).abs().max() <= 0.05
    return got


@pytest.mark.parametrize(
    "n_q,n_k,hq,hkv,d",
    [
        (77, 77, 6, 1, 64),  # non-power-of-two length, partial last blocks
        (64, 64, 12, 2, 32),  # exactly on block boundaries
        (19, 100, 6, 1, 64),  # a chunk after 81 tokens of context
        (40, 40, 6, 1, 256),  # the real head_dim
    ],
)
def test_matches_fp32_reference(n_q, n_k, hq, hkv, d):
    _check(*_qkv(n_q, n_k, hq, hkv, d), block_m=16, block_n=16)


def test_key_channel_offset_is_smoothed_away():
    # a large shared offset on the keys would swamp int8 without the mean subtraction
    _check(*_qkv(48, 48, 6, 1, 64, seed=1, key_bias=30.0), block_m=16, block_n=32)


def test_causal():
    q, k, v = _qkv(32, 32, 6, 1, 32, seed=2)
    before = prefill_int8_attention(q, k, v, block_m=16, block_n=16)
    v2 = v.clone()
    v2[20:] += 5.0
    after = prefill_int8_attention(q, k, v2, block_m=16, block_n=16)
    assert torch.equal(before[:20], after[:20])
    assert not torch.equal(before[20:], after[20:])


def test_bad_arguments_raise():
    q, k, v = _qkv(8, 8, 6, 1, 32)
    with pytest.raises(ValueError, match="multiple"):
        prefill_int8_attention(q[:, :4], k.repeat(1, 3, 1), v.repeat(1, 3, 1))
    with pytest.raises(ValueError, match="more queries"):
        prefill_int8_attention(torch.cat([q, q]), k, v)
    with pytest.raises(ValueError, match="dtype"):
        prefill_int8_attention(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="head_dim"):
        prefill_int8_attention(q[..., :24], k[..., :24], v[..., :24])
