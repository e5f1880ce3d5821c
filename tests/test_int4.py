"""int4 group quantization and pack-quantized packing, checked against compressed-tensors' own code."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from qwen_serving.checkpoint.int4 import (
    dequantize_int4_groups,
    negate_groups,
    negative_scale_share,
    pack_int4,
    quantize_int4_groups,
    unpack_int4,
)


def _codes(rows: int, cols: int, seed: int = 0, low: int = -8, high: int = 8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (rows, cols), generator=gen, dtype=torch.int8)


def test_pack_equals_compressed_tensors_packer():
    codes = _codes(192, 512)
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (192, 64)
    assert torch.equal(packed, pack_to_int32(codes, num_bits=4))
    assert bool((packed < 0).any()), "top nibbles >= 8 must land in the sign bit, as in the library"


def test_unpack_equals_compressed_tensors_unpacker_and_round_trips():
    codes = _codes(64, 256, seed=1)
    packed = pack_to_int32(codes, num_bits=4)
    ours = unpack_int4(packed, 256)
    assert torch.equal(ours, unpack_from_int32(packed, 4, torch.Size([64, 256])))
    assert torch.equal(ours, codes)


def test_pack_known_words():
    rows = torch.tensor([[-8] * 8, [7] * 8, list(range(8)), [-1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int8)
    words = pack_int4(rows)[:, 0].tolist()
    # nibble k holds code + 8 in bits 4k..4k+3
    assert words == [0, -1, 0xFEDCBA98 - 2**32, 0x88888887 - 2**32]


def test_dequantize_matches_compressed_tensors_decompress():
    codes = _codes(128, 384, seed=2)
    gen = torch.Generator().manual_seed(3)
    scales = ((torch.rand(128, 3, generator=gen) - 0.5) * 0.02).half()  # about half negative
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
    )
    state = {"weight_packed": pack_int4(codes), "weight_scale": scales, "weight_shape": torch.tensor([128, 384])}
    library = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    ours = dequantize_int4_groups(codes, scales)
    assert library.dtype == torch.float16
    # the library multiplies in fp16; ours is exact in fp32 and rounds to the same fp16 values
    assert torch.equal(library, ours.half())


def test_quantize_round_trips_representable_weights_exactly():
    codes = _codes(64, 256, seed=4, low=-7, high=8)
    codes[:, ::128] = 7  # every group reaches |code| 7, so max|w| / 7 recovers its scale
    gen = torch.Generator().manual_seed(5)
    scales = (torch.rand(64, 2, generator=gen) * 0.01 + 0.001).half()
    weight = dequantize_int4_groups(codes, scales)
    got_codes, got_scales = quantize_int4_groups(weight)
    assert torch.equal(got_scales, scales)
    assert torch.equal(got_codes, codes)
    assert torch.equal(dequantize_int4_groups(got_codes, got_scales), weight)


def test_quantize_error_is_at_most_half_a_step():
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(32, 512, generator=gen)
    weight[0, :128] = 0.0  # an all-zero group
    codes, scales = quantize_int4_groups(weight)
    assert scales.dtype == torch.float16 and scales.shape == (32, 4)
    assert int(codes.min()) >= -8 and int(codes.max()) <= 7
    assert not bool(codes[0, :128].any())
    step = scales.float().repeat_interleave(128, dim=1)
    error = (dequantize_int4_groups(codes, scales) - weight).abs()
    assert bool((error <= step / 2 + 1e-6).all())


def test_negate_groups_keeps_the_dequantized_weight():
    codes = _codes(64, 256, seed=7, low=-7, high=8)
    gen = torch.Generator().manual_seed(8)
    scales = (torch.rand(64, 2, generator=gen) * 0.01 + 0.001).half()
    flip = torch.rand(64, 2, generator=gen) < 0.5
    new_codes, new_scales = negate_groups(codes, scales, flip)
    assert torch.equal(dequantize_int4_groups(new_codes, new_scales), dequantize_int4_groups(codes, scales))
    assert negative_scale_share(new_scales) == pytest.approx(float(flip.float().mean()))
    assert torch.equal(new_codes[:, :128][flip[:, 0]], -codes[:, :128][flip[:, 0]])


def test_negate_groups_refuses_code_minus_8():
    codes = torch.zeros(64, 128, dtype=torch.int8)
    codes[5, 17] = -8
    scales = torch.ones(64, 1, dtype=torch.float16)
    flip = torch.zeros(64, 1, dtype=torch.bool)
    negate_groups(codes, scales, flip)  # -8 in an unflipped group is fine
    flip[5, 0] = True
    with pytest.raises(ValueError, match="-8"):
        negate_groups(codes, scales, flip)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pack_int4(torch.full((2, 8), 8, dtype=torch.int8)), r"\[-8, 7\]"),
        (lambda: pack_int4(torch.zeros(2, 8, dtype=torch.int32)), "int8"),
        (lambda: pack_int4(torch.zeros(2, 12, dtype=torch.int8)), "multiple of 8"),
        (lambda: unpack_int4(torch.zeros(2, 3, dtype=torch.int32), 16), "does not hold"),
        (lambda: quantize_int4_groups(torch.zeros(4, 100)), "multiple of group_size"),
        (lambda: dequantize_int4_groups(torch.zeros(4, 256, dtype=torch.int8), torch.ones(4, 1)), "do not match"),
    ],
)
def test_bad_input_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()
