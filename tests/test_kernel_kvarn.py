"""KVarN 4/2-bit tiles (Triton, interpreted on CPU) against their plain-torch definition; the int4 per-token-head
reference against vLLM 0.28.0's own write kernel; round-trip and attention-output bounds at small context.

Bounds, from the format's arithmetic: a row rounded to b bits over its own min..max has an error of at most
half a step, (max - min) / (2 (2^b - 1)) of the balanced row, times its scales; the fp16 scales add ~1e-3
relative. The relative-RMS bounds on Gaussian data are the measured values with ~20% room (4-bit keys 0.07,
2-bit values 0.51 of the signal at head_dim 256: a 2-bit row over 256 Gaussian channels has a step of ~1.9
sigma), so a coarser grid, a lost scale or a wrong rotation fails them.
"""

from __future__ import annotations

import pytest
import torch

from qwen_serving.engine.kernels import kv_fidelity as fid
from qwen_serving.engine.kernels import kvarn
from qwen_serving.engine.kernels.kvarn import KvarnLayout


def _tiles(n, rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    # uneven row and column scales and offsets: what the Sinkhorn loop is there to even out
    scale = torch.rand(n, rows, 1, generator=g) * 4 + 0.05
    shift = torch.randn(n, 1, cols, generator=g)
    return torch.randn(n, rows, cols, generator=g) * scale * torch.rand(n, 1, cols, generator=g) + shift


@pytest.mark.parametrize(("rows", "cols", "bits"), [(32, 16, 4), (16, 32, 2), (256, 128, 4), (128, 256, 2),
                                                    (64, 64, 8), (16, 16, 1)])
def test_triton_tiles_equal_the_reference(rows, cols, bits):
    x = _tiles(3, rows, cols, seed=rows + bits)
    got, want = kvarn.quantize_tiles(x, bits), kvarn.quantize_tiles_reference(x, bits)
    # the same fp32 arithmetic in another reduction order: codes equal, scales within one fp16 step
    assert (got.codes == want.codes).float().mean() >= 0.999
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-3, atol=1e-6)
    torch.testing.assert_close(kvarn.dequantize_tiles(want, bits), kvarn.dequantize_tiles_reference(want, bits))


@pytest.mark.parametrize("bits", [4, 2])
def test_round_trip_within_half_a_step(bits):
    x = _tiles(4, 64, 32, seed=bits)
    t = kvarn.quantize_tiles_reference(x, bits)
    balanced, row, col = kvarn.balance_reference(x)
    torch.testing.assert_close(balanced * row[..., None] * col[:, None, :], x.float(), rtol=1e-5, atol=1e-5)
    half_step = (balanced.amax(2) - balanced.amin(2)) / (2 * ((1 << bits) - 1))
    bound = half_step[..., None] * row[..., None] * col[:, None, :] * 1.01 + 2e-3 * x.abs()
    assert ((kvarn.dequantize_tiles_reference(t, bits) - x).abs() <= bound).all()


def test_balance_evens_out_row_and_column_spread():
    x = _tiles(8, 64, 32, seed=5)
    before = kvarn.spread(x)
    after = kvarn.spread(kvarn.balance_reference(x)[0])
    assert (after <= before).all() and after.mean() < 0.5 * before.mean()
    assert (after >= 2.0 - 1e-4).all()  # 2 is a perfectly balanced tile


def test_pack_round_trip_and_bit_order():
    for bits in (1, 2, 4, 8):
        q = torch.randint(0, 1 << bits, (5, 64))
        assert torch.equal(kvarn.unpack_codes(kvarn.pack_codes(q, bits), bits), q.int())
    # the lowest column sits in the lowest bits
    assert kvarn.pack_codes(torch.tensor([[1, 2, 3, 0]]), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]


def test_layout_bytes():
    layout = KvarnLayout()
    assert layout.record_bytes == 16384 + 4 * 256 + 2 * 128 + 8192 + 4 * 128 + 2 * 256 == 26880
    assert layout.bytes_per_token(kv_heads=4) == 840  # bf16: 4096, int4 per-token-head: 1056
    assert KvarnLayout(head_dim=128).bytes_per_token(kv_heads=8) == 864  # the DFlash2 drafter's 8 x 128 heads
    with pytest.raises(ValueError):
        KvarnLayout(value_bits=3)
    with pytest.raises(ValueError):
        KvarnLayout(tile=96)


def _kv(tokens, heads=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    channel = torch.rand(1, 1, d, generator=g) * 3 + 0.1  # outlier channels, as real keys have
    k = (torch.randn(tokens, heads, d, generator=g) * channel + torch.randn(1, 1, d, generator=g)).bfloat16()
    return k, torch.randn(tokens, heads, d, generator=g).bfloat16()


@pytest.mark.parametrize(("tokens", "heads", "d"), [(256, 1, 32), (512, 2, 64)])
def test_cache_records_triton_equal_reference(tokens, heads, d):
    k, v = _kv(tokens, heads, d)
    layout = KvarnLayout(head_dim=d)
    got = kvarn.kvarn_quantize(k, v, layout, impl="triton")
    want = kvarn.kvarn_quantize(k, v, layout, impl="reference")
    assert got.shape == (tokens // 128, heads, layout.record_bytes)
    codes = [(start, start + n) for start, n in ((layout.k_codes, d * 128 // 2), (layout.v_codes, d * 128 // 4))]
    assert all((got[..., a:b] == want[..., a:b]).float().mean() > 0.999 for a, b in codes)
    kd, vd = kvarn.kvarn_dequantize(want, layout)
    # scales one fp16 step apart, a rare code one step off: the two caches read back the same to 0.1%
    for a, b in zip(kvarn.kvarn_dequantize(got, layout), (kd, vd), strict=True):
        assert (a - b).norm() / b.norm() < 1e-3
    assert ((kd - k.float()).norm() / k.float().norm()) < 0.09
    assert ((vd - v.float()).norm() / v.float().norm()) < 0.62


def test_rotation_is_its_own_inverse_and_keeps_dot_products():
    x, y = torch.randn(7, 256), torch.randn(7, 256)
    torch.testing.assert_close(kvarn.rotate(kvarn.rotate(x)), x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((kvarn.rotate(x) * kvarn.rotate(y)).sum(-1), (x * y).sum(-1), rtol=1e-4, atol=1e-4)


def test_roundtrip_keeps_sink_and_tail_tiles_exact():
    k, v = _kv(128 * 3 + 50, heads=1, d=32)
    kq, vq = kvarn.kvarn_roundtrip(k, v)
    for got, want in ((kq, k), (vq, v)):
        assert torch.equal(got[:128], want[:128].float())  # the sink tile
        assert torch.equal(got[384:], want[384:].float())  # the partial last tile
        assert not torch.equal(got[128:384], want[128:384].float())  # the whole tiles between are quantized
    short_k, short_v = _kv(100, heads=1, d=32)
    assert torch.equal(kvarn.kvarn_roundtrip(short_k, short_v)[0], short_k.float())


def test_int4pth_reference_equals_vllm_write_kernel():
    from vllm.v1.attention.ops.int4_per_token_head import reshape_and_cache_int4

    tokens, heads, d, block = 40, 2, 256, 16
    k, v = _kv(tokens, heads, d, seed=3)
    blocks = -(-tokens // block)
    caches = [torch.zeros(blocks, block, heads, d // 2, dtype=torch.uint8) for _ in range(2)]
    steps = [torch.zeros(blocks, block, heads) for _ in range(2)]
    reshape_and_cache_int4(k, v, *caches, torch.arange(tokens), k_scale_cache=steps[0], v_scale_cache=steps[1])
    for x, cache, step in ((k, caches[0], steps[0]), (v, caches[1], steps[1])):
        rows = fid.int4pth_quantize(x)
        assert torch.equal(cache.reshape(-1, heads, d // 2)[:tokens], rows.codes)
        assert torch.equal(step.reshape(-1, heads)[:tokens].view(torch.int32), rows.step_bits)
        assert ((fid.int4pth_dequantize(rows) - x.float()).norm() / x.float().norm()) < 0.14


def test_attention_streams_chunks_like_one_softmax():
    q, (k, v) = torch.randn(3, 6, 32), _kv(300, heads=2, d=32)
    s = torch.einsum("rhd,thd->rht", q, k.float().repeat_interleave(3, 1)) / 32 ** 0.5
    want = torch.einsum("rht,thd->rhd", s.softmax(-1), v.float().repeat_interleave(3, 1))
    torch.testing.assert_close(fid.attention(q, k, v, chunk=64), want, rtol=1e-4, atol=1e-5)


def test_fidelity_table_at_small_context():
    """The CPU table: 1,000 tokens of 2 KV heads x 64, 12 query heads. Peaked queries (each a scaled copy of one
    key) read mostly one token, so the output error is that token's V error: 4-bit values (int4pth) beat 2-bit
    (KVarN) there, while 4-bit per-channel keys beat per-token ones. bf16 against itself is exact."""
    k, v = _kv(1000, heads=2, d=64, seed=9)
    g = torch.Generator().manual_seed(1)
    pick = torch.randint(0, 1000, (4,), generator=g)
    q = (k[pick].float().repeat_interleave(6, 1) * 0.6 + 0.1 * torch.randn(4, 12, 64, generator=g))
    table = fid.compare_modes(q, k, v, modes=fid.MODES, impl="reference")
    assert table["bf16"]["max_abs_err"] == 0 and table["bf16"]["cos_min"] == pytest.approx(1.0)
    assert table["kvarn"]["k_rel_rms_err"] < table["int4pth"]["k_rel_rms_err"]
    assert table["kvarn"]["v_rel_rms_err"] > table["int4pth"]["v_rel_rms_err"]
    for mode, floor in (("int4pth", 0.97), ("kvarn", 0.8)):
        assert floor <= table[mode]["cos_mean"] < 1.0
        assert 0 < table[mode]["max_abs_err"] < table[mode]["ref_max_abs"]


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        kvarn.kvarn_quantize(*_kv(100, d=64))  # not whole tiles
    with pytest.raises(ValueError):
        kvarn.kvarn_quantize(torch.zeros(128, 1, 64), torch.zeros(128, 1, 32))
    with pytest.raises(ValueError):
        kvarn.quantize_tiles(torch.zeros(2, 24, 16), 4)
    with pytest.raises(ValueError):
        fid.roundtrip("fp8", *_kv(10, d=32))
