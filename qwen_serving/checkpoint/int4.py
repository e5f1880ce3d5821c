"""Symmetric int4 group quantization in compressed-tensors `pack-quantized` layout.

On disk a W4A16 linear is three tensors (what vLLM's CompressedTensorsWNA16 loads):
  weight_packed int32 [out, in/8]   eight 4-bit codes per int32, code + 8 stored unsigned,
                                    code k of a word in bits 4k..4k+3 (lowest nibble = lowest column)
  weight_scale  fp16  [out, in/G]   one scale per group of G input columns (G = 128 here)
  weight_shape  int64 [2]           (out, in)
The dequantized weight is scale * code, codes in [-8, 7]. AutoRound's symmetric exports carry
about half of their group scales negative; `negate_groups` produces that form without changing
the dequantized weight. Everything here works on CPU and CUDA tensors alike.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 128
CODES_PER_WORD = 8
CODE_MIN, CODE_MAX = -8, 7
_OFFSET = 8


def _check_codes(codes: torch.Tensor) -> None:
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"int4 codes must be a 2-D int8 tensor, got {codes.dtype} {tuple(codes.shape)}")
    if codes.shape[1] % CODES_PER_WORD:
        raise ValueError(f"in_features {codes.shape[1]} is not a multiple of {CODES_PER_WORD}")


def _check_groups(in_features: int, group_size: int) -> None:
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group_size {group_size}")


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, in] in [-8, 7] -> int32 [out, in/8] (compressed-tensors packing)."""
    _check_codes(codes)
    if codes.numel() and (int(codes.min()) < CODE_MIN or int(codes.max()) > CODE_MAX):
        raise ValueError("int4 codes must lie in [-8, 7]")
    rows, cols = codes.shape
    nibbles = (codes.to(torch.int32) + _OFFSET).view(rows, cols // CODES_PER_WORD, CODES_PER_WORD)
    packed = torch.zeros(rows, cols // CODES_PER_WORD, dtype=torch.int32, device=codes.device)
    for k in range(CODES_PER_WORD):
        # int32 arithmetic wraps, so the top nibble lands in the sign bit as in the library
        packed |= nibbles[:, :, k] << (4 * k)
    return packed


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [out, in/8] -> int8 codes [out, in_features] in [-8, 7]."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed int4 must be a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.shape[1] * CODES_PER_WORD != in_features:
        raise ValueError(f"packed width {packed.shape[1]} does not hold {in_features} int4 codes")
    shifts = torch.arange(CODES_PER_WORD, device=packed.device, dtype=torch.int32) * 4
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - _OFFSET).to(torch.int8).reshape(packed.shape[0], in_features)


def dequantize_int4_groups(codes: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """codes [out, in] int8, scales [out, in/G] -> float32 weight [out, in] = scale * code."""
    out_features, in_features = codes.shape
    _check_groups(in_features, group_size)
    if tuple(scales.shape) != (out_features, in_features // group_size):
        raise ValueError(f"scales {tuple(scales.shape)} do not match codes {tuple(codes.shape)} / group {group_size}")
    grouped = codes.to(torch.float32).view(out_features, -1, group_size)
    return (grouped * scales.to(torch.float32).unsqueeze(-1)).view(out_features, in_features)


def quantize_int4_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int4 per group: (codes int8 [out, in], scales fp16 [out, in/G]).

    scale = max|w| / 7 per group (positive), so a weight that already is fp16-scale * code with the
    group's extreme at code +-7 round-trips exactly. Zero groups get scale 1 and zero codes.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    _check_groups(in_features, group_size)
    grouped = weight.to(torch.float32).view(out_features, -1, group_size)
    max_abs = grouped.abs().amax(dim=-1)
    scales = torch.where(max_abs > 0, max_abs / CODE_MAX, torch.ones_like(max_abs)).to(torch.float16)
    codes = torch.round(grouped / scales.to(torch.float32).unsqueeze(-1)).clamp(CODE_MIN, CODE_MAX)
    return codes.to(torch.int8).view(out_features, in_features), scales


def negate_groups(
    codes: torch.Tensor, scales: torch.Tensor, flip: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Negate scale and codes of the groups where `flip` [out, in/G] is true (dequant unchanged).

    A flipped group must not hold code -8 (its negation, +8, is not an int4 code).
    """
    out_features, in_features = codes.shape
    _check_groups(in_features, group_size)
    if flip.dtype != torch.bool or tuple(flip.shape) != tuple(scales.shape):
        raise ValueError("flip must be a bool tensor shaped like scales")
    grouped = codes.view(out_features, -1, group_size)
    if bool(((grouped == CODE_MIN) & flip.unsqueeze(-1)).any()):
        raise ValueError("a group to negate holds code -8, which has no int4 negation")
    sign = 1 - 2 * flip.to(torch.int8)
    new_codes = (grouped * sign.unsqueeze(-1)).view(out_features, in_features)
    new_scales = torch.where(flip, -scales, scales)
    return new_codes, new_scales


def negative_scale_share(scales: torch.Tensor) -> float:
    """Fraction of group scales that are negative."""
    return float((scales < 0).sum()) / max(scales.numel(), 1)
