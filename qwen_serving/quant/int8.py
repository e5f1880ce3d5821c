"""Symmetric int8 group quantization in compressed-tensors `pack-quantized` layout (numpy).

On disk an int8 weight [rows, cols] becomes three tensors, the form vLLM 0.28.0 loads both for a
linear layer (CompressedTensorsWNA16, Marlin uint8b128) and for an embedding table
(CompressedTensorsEmbeddingWNA16Int, a dequant-on-gather Triton kernel):
  weight_packed int32 [rows, cols/4]   four codes per int32, code + 128 stored as an unsigned
                                       byte, code k of a word in bits 8k..8k+7 (little-endian)
  weight_scale  float [rows, cols/G]   one scale per group of G columns, in the model dtype
  weight_shape  int64 [2]              (rows, cols)
The dequantized weight is scale * code. The scale is rounded to the model dtype *before* the codes
are chosen, because the engine multiplies by that rounded scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qwen_serving.quant.safetensors_io import from_f32, to_f32

GROUP_SIZE = 128
NUM_BITS = 8
CODES_PER_WORD = 4
CODE_MIN, CODE_MAX = -128, 127
_OFFSET = 128
# the weights args of a compressed-tensors config group describing this format
WEIGHTS_ARGS = {
    "num_bits": NUM_BITS,
    "type": "int",
    "symmetric": True,
    "strategy": "group",
    "group_size": GROUP_SIZE,
    "dynamic": False,
    "actorder": None,
    "observer": "minmax",
    "observer_kwargs": {},
    "block_structure": None,
}


def quantize_rows(weight: np.ndarray, scale_dtype: str, group_size: int = GROUP_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, cols] -> (codes int8 [rows, cols], scale storage [rows, cols/G] in scale_dtype)."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"{cols} columns are not a multiple of the group size {group_size}")
    groups = weight.reshape(rows, cols // group_size, group_size)
    scale_store = from_f32(np.abs(groups).max(axis=-1) / CODE_MAX, scale_dtype)
    scale = to_f32(scale_store, scale_dtype)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    codes = np.rint(groups / safe[..., None])
    codes = np.clip(codes, CODE_MIN, CODE_MAX).astype(np.int8)
    codes[scale == 0] = 0
    return codes.reshape(rows, cols), scale_store


def dequantize_rows(codes: np.ndarray, scale_store: np.ndarray, scale_dtype: str, group_size: int = GROUP_SIZE) -> np.ndarray:
    rows, cols = codes.shape
    scale = to_f32(scale_store, scale_dtype)
    grouped = codes.astype(np.float32).reshape(rows, cols // group_size, group_size)
    return (grouped * scale[..., None]).reshape(rows, cols)


def pack(codes: np.ndarray) -> np.ndarray:
    """int8 codes [rows, cols] -> int32 [rows, cols/4] (offset-binary bytes, little-endian words)."""
    if codes.dtype != np.int8 or codes.ndim != 2 or codes.shape[1] % CODES_PER_WORD:
        raise ValueError(f"expected int8 [rows, 4k] codes, got {codes.dtype} {codes.shape}")
    unsigned = (codes.astype(np.int16) + _OFFSET).astype(np.uint8)
    return np.ascontiguousarray(unsigned).view("<i4")


def unpack(packed: np.ndarray) -> np.ndarray:
    if packed.dtype != np.dtype("<i4") or packed.ndim != 2:
        raise ValueError(f"expected int32 [rows, cols/4], got {packed.dtype} {packed.shape}")
    unsigned = np.ascontiguousarray(packed).view(np.uint8)
    return (unsigned.astype(np.int16) - _OFFSET).astype(np.int8)


@dataclass
class ErrorMeter:
    """Relative round-trip error ||W - Q(W)|| / ||W|| (Frobenius), accumulated over row chunks."""

    err_sq: float = 0.0
    ref_sq: float = 0.0
    max_abs: float = 0.0

    def add(self, reference: np.ndarray, restored: np.ndarray) -> None:
        diff = (reference - restored).astype(np.float64)
        self.err_sq += float(np.sum(diff * diff))
        self.ref_sq += float(np.sum(reference.astype(np.float64) ** 2))
        if diff.size:
            self.max_abs = max(self.max_abs, float(np.abs(diff).max()))

    @property
    def relative(self) -> float:
        return (self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq else 0.0
