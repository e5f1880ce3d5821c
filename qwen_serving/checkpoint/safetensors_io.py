"""Read and write safetensors files with numpy alone (no torch: the prepare scripts start fast).

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to {dtype, shape, data_offsets} (offsets relative to the data section) plus an optional
"__metadata__" dict of strings, then the tensor bytes, contiguous. bf16 has no numpy dtype: it is
read and written as uint16 bit patterns (`bf16_to_f32` / `f32_to_bf16` convert).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# safetensors dtype name -> numpy dtype used to hold its bytes
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F64": np.dtype("<f8"),
}
FLOAT_DTYPES = ("BF16", "F16", "F32")
HEADER_LIMIT = 100 * 1024 * 1024  # the reference library refuses larger headers too
COPY_CHUNK = 64 * 1024 * 1024


class SafetensorsError(ValueError):
    """A file that is not a complete, well-formed safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class SafetensorsFile:
    """Header of one file; tensor data is read lazily through a read-only memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise SafetensorsError(f"{self.path.name}: {size} bytes, too short for a safetensors header")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > HEADER_LIMIT or 8 + header_len > size:
                    raise SafetensorsError(f"{self.path.name}: header length {header_len} does not fit a {size}-byte file")
                raw = f.read(header_len)
        except OSError as e:
            raise SafetensorsError(f"{self.path}: cannot read ({e.strerror})") from e
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{self.path.name}: header is not valid JSON ({e})") from e
        self.file_size = size
        self.data_start = 8 + header_len
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            dtype = entry.get("dtype")
            if dtype not in NUMPY_DTYPES:
                raise SafetensorsError(f"{self.path.name}: tensor {name} has unsupported dtype {dtype!r}")
            begin, end = entry["data_offsets"]
            shape = tuple(int(d) for d in entry["shape"])
            info = TensorInfo(name, dtype, shape, self.data_start + begin, self.data_start + end)
            if info.nbytes != info.numel * NUMPY_DTYPES[dtype].itemsize:
                raise SafetensorsError(f"{self.path.name}: tensor {name} byte range does not match {dtype}{list(shape)}")
            self.tensors[name] = info
        self._mmap: np.memmap | None = None

    def check_complete(self) -> None:
        """Raise unless the data section is exactly the tensors, back to back, and fully present."""
        pos = self.data_start
        for info in sorted(self.tensors.values(), key=lambda t: t.start):
            if info.start != pos:
                raise SafetensorsError(f"{self.path.name}: gap or overlap before tensor {info.name}")
            pos = info.end
        if self.file_size != pos:
            what = "truncated" if self.file_size < pos else "has trailing bytes"
            raise SafetensorsError(f"{self.path.name}: {what} ({self.file_size} bytes, header says {pos})")

    def _map(self) -> np.memmap:
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mmap

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy view (bf16 as uint16 bits)."""
        info = self.tensors[name]
        raw = self._map()[info.start : info.end]
        return raw.view(NUMPY_DTYPES[info.dtype]).reshape(info.shape)

    def iter_bytes(self, name: str, chunk: int = COPY_CHUNK) -> Iterator[bytes]:
        info = self.tensors[name]
        with open(self.path, "rb") as f:
            f.seek(info.start)
            left = info.nbytes
            while left:
                block = f.read(min(chunk, left))
                if not block:
                    raise SafetensorsError(f"{self.path.name}: truncated inside tensor {name}")
                left -= len(block)
                yield block

    def close(self) -> None:
        self._mmap = None


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does (finite inputs)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = u + (((u >> 16) & 1) + 0x7FFF)
    return (rounded >> 16).astype(np.uint16)


def to_f32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16_to_f32(array)
    if dtype in ("F16", "F32", "F64"):
        return array.astype(np.float32)
    raise ValueError(f"not a float dtype: {dtype}")


def from_f32(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the storage array for dtype (rounding as the engine would)."""
    if dtype == "BF16":
        return f32_to_bf16(values)
    if dtype == "F16":
        return values.astype(np.float16)
    if dtype == "F32":
        return values.astype(np.float32)
    raise ValueError(f"not a float dtype: {dtype}")


# A tensor to write: its bytes come from `chunks()`, which must yield exactly numel*itemsize bytes.
@dataclass
class OutTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[bytes | np.ndarray]]

    @property
    def nbytes(self) -> int:
        n = NUMPY_DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


def array_tensor(name: str, dtype: str, array: np.ndarray) -> OutTensor:
    array = np.ascontiguousarray(array, dtype=NUMPY_DTYPES[dtype])
    return OutTensor(name, dtype, tuple(array.shape), lambda: [array])


def copied_tensor(source: SafetensorsFile, name: str) -> OutTensor:
    info = source.tensors[name]
    return OutTensor(name, info.dtype, info.shape, lambda: source.iter_bytes(name))


def encode_header(tensors: list[OutTensor], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def planned_size(tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> int:
    return len(encode_header(tensors, metadata)) + sum(t.nbytes for t in tensors)


def write_file(path: Path, tensors: list[OutTensor], metadata: dict[str, str] | None = None) -> str:
    """Write a safetensors file (fsynced); returns its sha256. The caller owns atomicity."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in one file")
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        head = encode_header(tensors, metadata)
        f.write(head)
        digest.update(head)
        for t in tensors:
            written = 0
            for block in t.chunks():
                data = block.tobytes() if isinstance(block, np.ndarray) else block
                f.write(data)
                digest.update(data)
                written += len(data)
            if written != t.nbytes:
                raise RuntimeError(f"tensor {t.name}: produced {written} bytes, expected {t.nbytes}")
        f.flush()
        os.fsync(f.fileno())
    return "sha256:" + digest.hexdigest()


def file_sha256(path: Path, chunk: int = COPY_CHUNK) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return "sha256:" + digest.hexdigest()
