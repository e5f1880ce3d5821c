"""What a quantized KV cache does to attention: vLLM 0.28.0's int4 per-token-head cache in plain torch, the
KVarN round trip (kvarn.py), and the attention-output error of either against 16-bit K and V.

vLLM's ``int4_per_token_head`` (v1/attention/ops/int4_per_token_head.py), as facts: K and V are rotated per
head by a randomized Hadamard transform (a fixed +-1 sign vector, CPU generator seeded 0x9E3779B9, then the
unnormalized Walsh-Hadamard transform) and cast back to the model dtype; each (token, head) row is rounded
asymmetric to 4 bits (step = max((max - min) / 15, 1e-6), zero point round(-min / step) clipped to 0..15,
codes round(x / step + zero) clipped to 0..15, rounding half away from zero); the 4-bit zero point replaces
the low 4 mantissa bits of the fp32 step, which is stored inline after the row's packed codes (two codes a
byte, even index in the low nibble). Attention rotates q the same way, divides the softmax scale by head_dim,
and rotates the output back (dividing by head_dim again). Per token and KV head: head_dim / 2 bytes each for
K and V plus two fp32 steps, 264 bytes at head_dim 256.

``attention`` is plain softmax attention in fp32 with grouped KV heads, the decode case: every query row
attends to the whole context. ``fidelity`` compares two outputs row by row (one row = one query token of
one query head).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import kvarn

INT4PTH_SEED = 0x9E3779B9


def rht_signs(d: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(INT4PTH_SEED)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform along the last dim (H @ H = d * I)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    h = 1
    while h < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack([pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]], -2)
        x = x.reshape(*x.shape[:-3], d)
        h *= 2
    return x


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


class Int4Rows(NamedTuple):
    codes: torch.Tensor  # [..., D / 2] uint8, even index in the low nibble
    step_bits: torch.Tensor  # [...] int32: the fp32 step's bits with the zero point in the low 4


def int4pth_quantize(x: torch.Tensor) -> Int4Rows:
    """What vLLM's int4 per-token-head write path stores for x [..., D] (the model dtype's K or V)."""
    signs = rht_signs(x.shape[-1]).to(x.device)
    rot = walsh_hadamard(x.float() * signs).to(x.dtype).float()
    lo, hi = rot.amin(-1), rot.amax(-1)
    step = ((hi - lo) / 15.0).clamp_min(1e-6)
    zero = _round_half_away(-lo / step).clamp(0, 15)
    q = _round_half_away(rot * (1.0 / step)[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8)
    bits = (step.view(torch.int32) & -16) | zero.to(torch.int32)
    return Int4Rows(q[..., 0::2] | (q[..., 1::2] << 4), bits)


def int4pth_dequantize(rows: Int4Rows) -> torch.Tensor:
    """Back to the original basis, fp32."""
    q = torch.stack([rows.codes & 0xF, rows.codes >> 4], -1).reshape(*rows.codes.shape[:-1], -1).float()
    zero = (rows.step_bits & 0xF).float()
    step = (rows.step_bits & -16).view(torch.float32)
    rot = (q - zero[..., None]) * step[..., None]
    d = rot.shape[-1]
    return walsh_hadamard(rot) * rht_signs(d).to(rot.device) / d


def int4pth_roundtrip(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return int4pth_dequantize(int4pth_quantize(k)), int4pth_dequantize(int4pth_quantize(v))


def roundtrip(mode: str, k: torch.Tensor, v: torch.Tensor, impl: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the named cache hands them to attention: "bf16" (as given), "int4pth" or "kvarn"."""
    if mode == "bf16":
        return k.float(), v.float()
    if mode == "int4pth":
        return int4pth_roundtrip(k, v)
    if mode == "kvarn":
        return kvarn.kvarn_roundtrip(k, v, impl=impl)
    raise ValueError(f"unknown KV mode {mode!r} (bf16, int4pth, kvarn)")


MODES = ("bf16", "int4pth", "kvarn")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = 32768) -> torch.Tensor:
    """q [rows, q_heads, D] over k, v [tokens, kv_heads, D]: softmax(q.k / sqrt(D)) v in fp32, every row over
    every token, q heads grouped onto KV heads (q head h reads KV head h // (q_heads / kv_heads)). Streams the
    context in chunks with a running max, so 200k tokens need no [rows, heads, 200k] score tensor."""
    rows, q_heads, d = q.shape
    kv_heads = k.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads do not group onto {kv_heads} KV heads")
    qg = q.float().reshape(rows, kv_heads, q_heads // kv_heads, d) / math.sqrt(d)
    run_max = torch.full((rows, kv_heads, q_heads // kv_heads), -math.inf, device=q.device)
    denom = torch.zeros_like(run_max)
    acc = torch.zeros(rows, kv_heads, q_heads // kv_heads, d, device=q.device)
    for start in range(0, k.shape[0], chunk):
        kc, vc = k[start:start + chunk].float(), v[start:start + chunk].float()
        s = torch.einsum("rkgd,tkd->rkgt", qg, kc)
        new_max = torch.maximum(run_max, s.amax(-1))
        p = torch.exp(s - new_max[..., None])
        fix = torch.exp(run_max - new_max)
        denom = denom * fix + p.sum(-1)
        acc = acc * fix[..., None] + torch.einsum("rkgt,tkd->rkgd", p, vc)
        run_max = new_max
    return (acc / denom[..., None]).reshape(rows, q_heads, d)


def fidelity(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Row-wise cosine (mean and worst) and error of out against ref, both [rows, heads, D]."""
    a, b = out.float().reshape(-1, out.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    err = (a - b).abs()
    return {"cos_mean": cos.mean().item(), "cos_min": cos.min().item(), "max_abs_err": err.max().item(),
            "rel_rms_err": ((a - b).norm() / b.norm().clamp_min(1e-30)).item(), "ref_max_abs": b.abs().max().item()}


def compare_modes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: tuple[str, ...] = MODES[1:],
                  impl: str = "triton") -> dict[str, dict[str, float]]:
    """Attention through each quantized cache against attention over the 16-bit K and V."""
    ref = attention(q, k, v)
    out = {}
    for mode in modes:
        kq, vq = roundtrip(mode, k, v, impl=impl)
        out[mode] = fidelity(attention(q, kq, vq), ref)
        out[mode]["k_rel_rms_err"] = ((kq - k.float()).norm() / k.float().norm()).item()
        out[mode]["v_rel_rms_err"] = ((vq - v.float()).norm() / v.float().norm()).item()
    return out
