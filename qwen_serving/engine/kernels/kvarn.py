"""KVarN 4/2-bit KV cache: quantize keys to 4 bits and values to 2 bits per tile of 128 tokens, and back.

The format (facts from huawei-csl/KVarN, "variance-normalized KV cache"; the code here is this project's):

- A tile is one block of ``TILE`` tokens of one KV head. K and V are first rotated along head_dim by the
  orthonormal Sylvester Hadamard matrix (H = H^T = H^-1, so q.k and the weighted sum of V are unchanged
  when q is rotated too and the output rotated back).
- The rotated tile is balanced by a log-domain Sinkhorn loop: 16 rounds, each dividing the tile by the
  standard deviation of its columns, then of its rows (stds clipped to [1e-3, 1e3], the accumulated log
  scales to [-0.3, 10]); the round whose spread (max/min column std + max/min row std) is smallest is kept.
- The balanced tile is rounded per row, asymmetric (min..max over the row, 2^bits - 1 steps), and the
  row's step and minimum are folded into the row's Sinkhorn scale. K is tiled channels x tokens, so its
  rows are channels (per-channel quantization, as KIVI found keys want); V is tiled tokens x channels
  (per-token). Either way ``x[r, c] = (code[r, c] * row_scale[r] + row_zero[r]) * col_scale[c]``, with
  the three scale vectors kept in fp16.
- A tile is quantized only once its 128 tokens exist; until then its tokens stay 16-bit (the reference
  keeps them, and the first tile of every request, the attention sink, in an fp16 side pool).

One cache record per (tile, KV head), in bytes, at head_dim D and tile G (``KvarnLayout`` has the offsets):
K codes D x G/2 (4-bit, tokens packed along a channel's row, lowest bits first), K row scale and row zero
(D fp16 each), K column scale (G fp16), V codes G x D/4 (2-bit, channels packed along a token's row),
V row scale and row zero (G fp16 each), V column scale (D fp16). At D=256, G=128: 26,880 bytes, i.e.
210 bytes per token per KV head (bf16: 1,024; vLLM's int4 per-token-head: 264).

``quantize_tiles`` / ``dequantize_tiles`` are the Triton kernels (one program per tile), beside their
plain-torch definitions ``*_reference``. ``kvarn_quantize`` / ``kvarn_dequantize`` turn [tokens, heads, D]
K and V into records and back; ``kvarn_roundtrip`` is the whole cache as attention would read it (sink
and partial tail tiles unquantized), for the fidelity helpers in ``kv_fidelity``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

TILE = 128  # tokens per tile = the KVarN block (the reference's kvarn_k4v2_g128)
KEY_BITS = 4
VALUE_BITS = 2
SINKHORN_ROUNDS = 16
SINK_TILES = 1  # the first tile of a request stays 16-bit (the reference's 128 sink tokens)
STD_CLIP = (1e-3, 1e3)
LOG_SCALE_CLIP = (-0.3, 10.0)
MIN_STEP = 1e-10  # a constant row rounds to code 0 with a step this small


@dataclass(frozen=True)
class KvarnLayout:
    """Byte layout of one (tile, KV head) record."""

    head_dim: int = 256
    tile: int = TILE
    key_bits: int = KEY_BITS
    value_bits: int = VALUE_BITS

    def __post_init__(self) -> None:
        for bits in (self.key_bits, self.value_bits):
            if bits not in (1, 2, 4, 8):
                raise ValueError(f"bits must divide a byte (1, 2, 4 or 8), got {bits}")
        for name, n in (("head_dim", self.head_dim), ("tile", self.tile)):
            if n < 16 or n & (n - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (a Triton range and a Hadamard size), got {n}")

    @property
    def k_codes(self) -> int:
        return 0

    @property
    def k_row_scale(self) -> int:
        return self.k_codes + self.head_dim * self.tile * self.key_bits // 8

    @property
    def k_row_zero(self) -> int:
        return self.k_row_scale + 2 * self.head_dim

    @property
    def k_col_scale(self) -> int:
        return self.k_row_zero + 2 * self.head_dim

    @property
    def v_codes(self) -> int:
        return self.k_col_scale + 2 * self.tile

    @property
    def v_row_scale(self) -> int:
        return self.v_codes + self.tile * self.head_dim * self.value_bits // 8

    @property
    def v_row_zero(self) -> int:
        return self.v_row_scale + 2 * self.tile

    @property
    def v_col_scale(self) -> int:
        return self.v_row_zero + 2 * self.tile

    @property
    def record_bytes(self) -> int:
        """Rounded up to 8 bytes (a no-op at the shipped sizes) so records stay aligned for wide loads."""
        return -(-(self.v_col_scale + 2 * self.head_dim) // 8) * 8

    def bytes_per_token(self, kv_heads: int) -> float:
        """Bytes per token of one layer's paged cache (K and V, all KV heads)."""
        return self.record_bytes * kv_heads / self.tile

    def k_slots(self) -> tuple[int, int, int, int]:
        return self.k_codes, self.k_row_scale, self.k_row_zero, self.k_col_scale

    def v_slots(self) -> tuple[int, int, int, int]:
        return self.v_codes, self.v_row_scale, self.v_row_zero, self.v_col_scale


class TileCodes(NamedTuple):
    """Quantized [N, R, C] tiles: x[n, r, c] = (code * row_scale[n, r] + row_zero[n, r]) * col_scale[n, c]."""

    codes: torch.Tensor  # [N, R, C * bits / 8] uint8, column c in byte c // (8 / bits) at bit (c % (8 / bits)) * bits
    row_scale: torch.Tensor  # [N, R] fp16
    row_zero: torch.Tensor  # [N, R] fp16
    col_scale: torch.Tensor  # [N, C] fp16


# ---- Hadamard rotation ----
@functools.lru_cache(maxsize=8)
def _hadamard_cpu(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).float()


def hadamard(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size d (a power of two), fp32; symmetric, its own inverse."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {d}")
    return _hadamard_cpu(d).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H along the last dim, in fp32. Applying it twice gives x back."""
    return x.float() @ hadamard(x.shape[-1], x.device)


# ---- plain-torch definitions ----
def _std(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.std(dim=dim, unbiased=True)


def spread(x: torch.Tensor) -> torch.Tensor:
    """max/min column std + max/min row std per tile (2 when perfectly balanced)."""
    col, row = _std(x, 1), _std(x, 2)
    return col.amax(-1) / col.amin(-1).clamp_min(1e-8) + row.amax(-1) / row.amin(-1).clamp_min(1e-8)


def balance_reference(tiles: torch.Tensor, rounds: int = SINKHORN_ROUNDS) -> tuple[torch.Tensor, ...]:
    """Log-domain Sinkhorn on [N, R, C] tiles: (balanced, row_scale [N, R], col_scale [N, C]), fp32,
    with tiles == balanced * row_scale[..., None] * col_scale[:, None, :]."""
    x = tiles.float()
    log_row = x.new_zeros(x.shape[:2])
    log_col = x.new_zeros(x.shape[0], x.shape[2])
    best_row, best_col, best = log_row.exp(), log_col.exp(), spread(x)
    for _ in range(rounds):
        cur = x / log_row.exp()[..., None] / log_col.exp()[:, None, :]
        log_col = (log_col + _std(cur, 1).clamp(*STD_CLIP).log()).clamp(*LOG_SCALE_CLIP)
        cur = x / log_row.exp()[..., None] / log_col.exp()[:, None, :]
        log_row = (log_row + _std(cur, 2).clamp(*STD_CLIP).log()).clamp(*LOG_SCALE_CLIP)
        row, col = log_row.exp(), log_col.exp()
        now = spread(x / row[..., None] / col[:, None, :])
        better = now <= best
        best_row = torch.where(better[:, None], row, best_row)
        best_col = torch.where(better[:, None], col, best_col)
        best = torch.where(better, now, best)
    return x / best_row[..., None] / best_col[:, None, :], best_row, best_col


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., C] integer codes < 2^bits -> [..., C * bits / 8] uint8, lowest column in the lowest bits."""
    per = 8 // bits
    q = q.to(torch.int32).reshape(*q.shape[:-1], q.shape[-1] // per, per)
    shifts = torch.arange(per, device=q.device, dtype=torch.int32) * bits
    return (q << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    q = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def quantize_tiles_reference(tiles: torch.Tensor, bits: int, rounds: int = SINKHORN_ROUNDS) -> TileCodes:
    balanced, row, col = balance_reference(tiles, rounds)
    lo, hi = balanced.amin(2), balanced.amax(2)
    step = ((hi - lo) / ((1 << bits) - 1)).clamp_min(MIN_STEP)
    q = torch.round((balanced - lo[..., None]) / step[..., None]).clamp(0, (1 << bits) - 1)
    return TileCodes(pack_codes(q, bits), (row * step).half(), (row * lo).half(), col.half())


def dequantize_tiles_reference(t: TileCodes, bits: int) -> torch.Tensor:
    q = unpack_codes(t.codes, bits).float()
    return (q * t.row_scale.float()[..., None] + t.row_zero.float()[..., None]) * t.col_scale.float()[:, None, :]


# ---- Triton kernels: one program per [R, C] tile ----
@triton.jit
def _store_fp16(ptr, values):
    """Write fp16 values as little-endian byte pairs into a uint8 buffer (the record is untyped bytes)."""
    bits = values.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    idx = tl.arange(0, values.shape[0])
    tl.store(ptr + 2 * idx, (bits & 0xFF).to(tl.uint8))
    tl.store(ptr + 2 * idx + 1, (bits >> 8).to(tl.uint8))


@triton.jit
def _load_fp16(ptr, N: tl.constexpr):
    idx = tl.arange(0, N)
    lo = tl.load(ptr + 2 * idx).to(tl.int32)
    hi = tl.load(ptr + 2 * idx + 1).to(tl.int32)
    return ((hi << 8) | lo).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _round_half_even(y):
    """torch.round's rounding (ties to even) without libdevice, so the interpreter runs it too."""
    f = tl.floor(y)
    frac = y - f
    odd = f - 2.0 * tl.floor(f * 0.5)
    return tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, f + odd))


@triton.jit
def _std_cols(x, R: tl.constexpr):
    mean = tl.sum(x, axis=0) / R
    d = x - mean[None, :]
    return tl.sqrt(tl.sum(d * d, axis=0) / (R - 1))


@triton.jit
def _std_rows(x, C: tl.constexpr):
    mean = tl.sum(x, axis=1) / C
    d = x - mean[:, None]
    return tl.sqrt(tl.sum(d * d, axis=1) / (C - 1))


@triton.jit
def _spread_tl(x, R: tl.constexpr, C: tl.constexpr):
    col = _std_cols(x, R)
    row = _std_rows(x, C)
    return tl.max(col) / tl.maximum(tl.min(col), 1e-8) + tl.max(row) / tl.maximum(tl.min(row), 1e-8)


@triton.jit
def _quantize_tile_kernel(src_ptr, rec_ptr, src_stride, rec_stride, codes_off, rscale_off, rzero_off, cscale_off,
                          R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, ROUNDS: tl.constexpr,
                          STD_MIN: tl.constexpr, STD_MAX: tl.constexpr, LOG_MIN: tl.constexpr,
                          LOG_MAX: tl.constexpr, MIN_STEP: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    x = tl.load(src_ptr + n * src_stride + r[:, None] * C + c[None, :]).to(tl.float32)
    log_row = tl.zeros([R], dtype=tl.float32)
    log_col = tl.zeros([C], dtype=tl.float32)
    best_row = tl.exp(log_row)
    best_col = tl.exp(log_col)
    best = _spread_tl(x, R, C)
    for _ in range(ROUNDS):  # a loop, not unrolled: 16 unrolled rounds of a 256x128 tile never finished lowering
        cur = x / tl.exp(log_row)[:, None] / tl.exp(log_col)[None, :]
        log_col = log_col + tl.log(tl.minimum(tl.maximum(_std_cols(cur, R), STD_MIN), STD_MAX))
        log_col = tl.minimum(tl.maximum(log_col, LOG_MIN), LOG_MAX)
        cur = x / tl.exp(log_row)[:, None] / tl.exp(log_col)[None, :]
        log_row = log_row + tl.log(tl.minimum(tl.maximum(_std_rows(cur, C), STD_MIN), STD_MAX))
        log_row = tl.minimum(tl.maximum(log_row, LOG_MIN), LOG_MAX)
        row = tl.exp(log_row)
        col = tl.exp(log_col)
        now = _spread_tl(x / row[:, None] / col[None, :], R, C)
        better = now <= best
        best_row = tl.where(better, row, best_row)
        best_col = tl.where(better, col, best_col)
        best = tl.where(better, now, best)
    bal = x / best_row[:, None] / best_col[None, :]
    lo = tl.min(bal, axis=1)
    step = tl.maximum((tl.max(bal, axis=1) - lo) / ((1 << BITS) - 1), MIN_STEP)
    q = tl.minimum(tl.maximum(_round_half_even((bal - lo[:, None]) / step[:, None]), 0.0), (1 << BITS) - 1)
    PER: tl.constexpr = 8 // BITS
    shifts = (tl.arange(0, PER) * BITS)[None, None, :]
    packed = tl.sum(tl.reshape(q.to(tl.int32), (R, C // PER, PER)) << shifts, axis=2)
    rec = rec_ptr + n * rec_stride
    b = tl.arange(0, C // PER)
    tl.store(rec + codes_off + r[:, None] * (C // PER) + b[None, :], packed.to(tl.uint8))
    _store_fp16(rec + rscale_off, best_row * step)
    _store_fp16(rec + rzero_off, best_row * lo)
    _store_fp16(rec + cscale_off, best_col)


@triton.jit
def _dequantize_tile_kernel(rec_ptr, out_ptr, rec_stride, out_stride, codes_off, rscale_off, rzero_off, cscale_off,
                            R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    PER: tl.constexpr = 8 // BITS
    rec = rec_ptr + n * rec_stride
    byte = tl.load(rec + codes_off + r[:, None] * (C // PER) + (c // PER)[None, :]).to(tl.int32)
    q = ((byte >> ((c % PER) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    row_scale = _load_fp16(rec + rscale_off, R)
    row_zero = _load_fp16(rec + rzero_off, R)
    col_scale = _load_fp16(rec + cscale_off, C)
    x = (q * row_scale[:, None] + row_zero[:, None]) * col_scale[None, :]
    tl.store(out_ptr + n * out_stride + r[:, None] * C + c[None, :], x)


def _check_tiles(tiles: torch.Tensor, bits: int) -> None:
    if tiles.dim() != 3:
        raise ValueError(f"tiles must be [N, R, C], got shape {tuple(tiles.shape)}")
    _, rows, cols = tiles.shape
    KvarnLayout(head_dim=rows, tile=cols, key_bits=bits)  # the same power-of-two and bit-width rules


def quantize_tiles(tiles: torch.Tensor, bits: int, rounds: int = SINKHORN_ROUNDS) -> TileCodes:
    """Triton: [N, R, C] tiles (any float dtype) -> TileCodes, as quantize_tiles_reference."""
    _check_tiles(tiles, bits)
    n, rows, cols = tiles.shape
    src = tiles.float().contiguous()
    layout_bytes = rows * cols * bits // 8 + 4 * rows + 2 * cols
    rec = torch.empty(n, layout_bytes, dtype=torch.uint8, device=tiles.device)
    codes, rscale, rzero = 0, rows * cols * bits // 8, rows * cols * bits // 8 + 2 * rows
    cscale = rzero + 2 * rows
    _launch_quantize(src, rec, (codes, rscale, rzero, cscale), bits, rounds)
    return TileCodes(rec[:, :rscale].reshape(n, rows, cols * bits // 8),
                     rec[:, rscale:rzero].contiguous().view(torch.float16),
                     rec[:, rzero:cscale].contiguous().view(torch.float16),
                     rec[:, cscale:].contiguous().view(torch.float16))


def _launch_quantize(src: torch.Tensor, rec: torch.Tensor, slots: tuple[int, int, int, int], bits: int,
                     rounds: int) -> None:
    n, rows, cols = src.shape
    if n == 0:
        return
    _quantize_tile_kernel[(n,)](src, rec, rows * cols, rec.stride(0), *slots, R=rows, C=cols, BITS=bits,
                                ROUNDS=rounds, STD_MIN=STD_CLIP[0], STD_MAX=STD_CLIP[1], LOG_MIN=LOG_SCALE_CLIP[0],
                                LOG_MAX=LOG_SCALE_CLIP[1], MIN_STEP=MIN_STEP)


def _launch_dequantize(rec: torch.Tensor, n: int, rows: int, cols: int, slots: tuple[int, int, int, int],
                       bits: int) -> torch.Tensor:
    out = torch.empty(n, rows, cols, dtype=torch.float32, device=rec.device)
    if n:
        _dequantize_tile_kernel[(n,)](rec, out, rec.stride(0), rows * cols, *slots, R=rows, C=cols, BITS=bits)
    return out


def dequantize_tiles(t: TileCodes, bits: int) -> torch.Tensor:
    """Triton: TileCodes -> [N, R, C] fp32, as dequantize_tiles_reference."""
    n, rows, _ = t.codes.shape
    cols = t.col_scale.shape[1]
    parts = [t.codes.reshape(n, -1), t.row_scale.view(torch.uint8), t.row_zero.view(torch.uint8),
             t.col_scale.view(torch.uint8)]
    rec = torch.cat(parts, 1).contiguous()
    rscale = parts[0].shape[1]
    slots = (0, rscale, rscale + 2 * rows, rscale + 4 * rows)
    return _launch_dequantize(rec, n, rows, cols, slots, bits)


# ---- the cache: [tokens, heads, D] K and V <-> one record per (tile, head) ----
def _tiles(x: torch.Tensor, layout: KvarnLayout) -> torch.Tensor:
    """[tokens, heads, D] (tokens a multiple of the tile) -> rotated [tiles * heads, tile, D] fp32."""
    tokens, heads, d = x.shape
    if d != layout.head_dim or tokens % layout.tile:
        raise ValueError(f"need [k * {layout.tile}, heads, {layout.head_dim}], got {tuple(x.shape)}")
    return rotate(x).reshape(tokens // layout.tile, layout.tile, heads, d).transpose(1, 2).reshape(-1, layout.tile, d)


def _untile(x: torch.Tensor, heads: int, layout: KvarnLayout) -> torch.Tensor:
    """Rotated [tiles * heads, tile, D] -> [tokens, heads, D] in the original basis."""
    d = layout.head_dim
    return rotate(x.reshape(-1, heads, layout.tile, d).transpose(1, 2).reshape(-1, heads, d))


def kvarn_quantize(k: torch.Tensor, v: torch.Tensor, layout: KvarnLayout | None = None,
                   impl: str = "triton") -> torch.Tensor:
    """Whole tiles of K and V [tokens, heads, D] -> records [tokens / tile, heads, record_bytes] uint8."""
    layout = layout or KvarnLayout(head_dim=k.shape[-1])
    if k.shape != v.shape:
        raise ValueError(f"K and V must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    tokens, heads, _ = k.shape
    k_tiles = _tiles(k, layout).transpose(1, 2).contiguous()  # channels x tokens: rows are channels
    v_tiles = _tiles(v, layout).contiguous()  # tokens x channels: rows are tokens
    rec = torch.zeros(k_tiles.shape[0], layout.record_bytes, dtype=torch.uint8, device=k.device)
    if impl == "triton":
        _launch_quantize(k_tiles, rec, layout.k_slots(), layout.key_bits, SINKHORN_ROUNDS)
        _launch_quantize(v_tiles, rec, layout.v_slots(), layout.value_bits, SINKHORN_ROUNDS)
    elif impl == "reference":
        for tiles, slots, bits in ((k_tiles, layout.k_slots(), layout.key_bits),
                                   (v_tiles, layout.v_slots(), layout.value_bits)):
            t = quantize_tiles_reference(tiles, bits)
            for start, part in zip(slots, (t.codes, t.row_scale, t.row_zero, t.col_scale), strict=True):
                flat = part.reshape(part.shape[0], -1)
                rec[:, start:start + flat.shape[1] * flat.element_size()] = flat.contiguous().view(torch.uint8)
    else:
        raise ValueError(f"impl must be 'triton' or 'reference', got {impl!r}")
    return rec.reshape(tokens // layout.tile, heads, layout.record_bytes)


def kvarn_dequantize(records: torch.Tensor, layout: KvarnLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Records [tiles, heads, record_bytes] -> K and V [tiles * tile, heads, D] fp32 (Triton)."""
    tiles, heads, nbytes = records.shape
    if nbytes != layout.record_bytes:
        raise ValueError(f"records of {nbytes} bytes, the layout's are {layout.record_bytes}")
    rec = records.reshape(tiles * heads, nbytes).contiguous()
    d, g = layout.head_dim, layout.tile
    k = _launch_dequantize(rec, tiles * heads, d, g, layout.k_slots(), layout.key_bits).transpose(1, 2)
    v = _launch_dequantize(rec, tiles * heads, g, d, layout.v_slots(), layout.value_bits)
    return _untile(k, heads, layout), _untile(v, heads, layout)


def kvarn_roundtrip(k: torch.Tensor, v: torch.Tensor, impl: str = "triton",
                    sink_tiles: int = SINK_TILES) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [tokens, heads, D] as a KVarN cache gives them back: the sink tiles and the partial last tile
    unchanged (16-bit), every whole tile in between through the 4/2-bit records. fp32."""
    layout = KvarnLayout(head_dim=k.shape[-1])
    tokens = k.shape[0]
    start = min(tokens, sink_tiles * layout.tile)
    stop = start + (tokens - start) // layout.tile * layout.tile
    k_out, v_out = k.float().clone(), v.float().clone()
    if stop > start:
        rec = kvarn_quantize(k[start:stop], v[start:stop], layout, impl=impl)
        k_out[start:stop], v_out[start:stop] = kvarn_dequantize(rec, layout)
    return k_out, v_out
