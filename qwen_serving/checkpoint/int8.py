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

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from qwen_serving.checkpoint.console import Progress
from qwen_serving.checkpoint.model_dir import CheckpointError
from qwen_serving.checkpoint.safetensors_io import OutTensor, SafetensorsFile, array_tensor, from_f32, to_f32

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
    # one float32 buffer through divide, round and clip: the lm_head's 1.3 G weights stream through this
    work = np.divide(groups, safe[..., None], dtype=np.float32)
    np.rint(work, out=work)
    np.clip(work, CODE_MIN, CODE_MAX, out=work)
    work[scale == 0] = 0
    return work.astype(np.int8).reshape(rows, cols), scale_store


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


def _sum_sq(x: np.ndarray) -> float:
    """The sum of squares: float32 along the last axis, float64 across (a third of a float64 pass's time), in
    float64 throughout where a float32 square overflows (|x| > 1.8e19)."""
    total = float(np.einsum("...i,...i->...", x, x).sum(dtype=np.float64))
    if math.isinf(total):
        wide = x.astype(np.float64)
        total = float(np.einsum("...i,...i->...", wide, wide).sum())
    return total


@dataclass
class ErrorMeter:
    """Relative round-trip error ||W - Q(W)|| / ||W|| (Frobenius), accumulated over row chunks."""

    err_sq: float = 0.0
    ref_sq: float = 0.0
    max_abs: float = 0.0

    def add(self, reference: np.ndarray, restored: np.ndarray) -> None:
        reference = np.asarray(reference, np.float32)
        diff = reference - restored
        self.err_sq += _sum_sq(diff)
        self.ref_sq += _sum_sq(reference)
        if diff.size:
            self.max_abs = max(self.max_abs, float(np.abs(diff).max()))

    @property
    def relative(self) -> float:
        return (self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq else 0.0


# float32 bytes of the rows quantized at a time while a matrix streams. Under glibc's 32 MiB ceiling on its mmap
# threshold, so the chunk's temporaries come back from the heap instead of fresh zeroed pages each chunk: the
# lm_head of a shape checkpoint took 31.9 s at 64 MiB and 18.0 s at 8 MiB here, most of the difference in the kernel
ROW_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass
class Int8Matrix:
    """Streams weight_packed, weight_scale, weight_shape for one float matrix of a shard."""

    source: SafetensorsFile
    tensor: str
    module: str
    scale_dtype: str
    meter: ErrorMeter = field(default_factory=ErrorMeter)

    def __post_init__(self) -> None:
        info = self.source.tensors[self.tensor]
        if len(info.shape) != 2:
            raise CheckpointError(f"{self.tensor} is {list(info.shape)}, expected a matrix")
        if info.dtype not in ("BF16", "F16", "F32"):
            raise CheckpointError(f"{self.tensor} is {info.dtype}; expected a bf16/fp16/fp32 matrix (already quantized?)")
        self.rows, self.cols = info.shape
        if self.cols % GROUP_SIZE:
            raise CheckpointError(f"{self.tensor}: {self.cols} columns are not a multiple of {GROUP_SIZE}")
        self.dtype = info.dtype
        self.scales = np.zeros((self.rows, self.cols // GROUP_SIZE), dtype=_storage(self.scale_dtype))

    def _packed_chunks(self) -> Iterator[np.ndarray]:
        weights = self.source.array(self.tensor)
        step = max(1, ROW_CHUNK_BYTES // (4 * self.cols))
        progress = Progress(self.module, self.rows)
        for r0 in range(0, self.rows, step):
            block = to_f32(np.asarray(weights[r0 : r0 + step]), self.dtype)
            if not np.isfinite(block).all():
                raise CheckpointError(f"{self.tensor} has non-finite values in rows {r0}..{r0 + len(block)}")
            codes, scales = quantize_rows(block, self.scale_dtype)
            self.meter.add(block, dequantize_rows(codes, scales, self.scale_dtype))
            self.scales[r0 : r0 + len(block)] = scales
            yield pack(codes)
            progress.update(r0 + len(block))

    def tensors(self) -> list[OutTensor]:
        m = self.module
        return [
            OutTensor(f"{m}.weight_packed", "I32", (self.rows, self.cols // CODES_PER_WORD), self._packed_chunks),
            # filled while weight_packed streams, which is written first
            OutTensor(f"{m}.weight_scale", self.scale_dtype, self.scales.shape, lambda: [self.scales]),
            array_tensor(f"{m}.weight_shape", "I64", np.array([self.rows, self.cols], dtype=np.int64)),
        ]


def _storage(dtype: str) -> np.dtype:
    return {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}[dtype]
