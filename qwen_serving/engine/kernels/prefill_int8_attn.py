"""int8-QK causal prefill attention (SageAttention-style) for long prompts, head_dim 256, GQA.

Q·K^T runs on int8 tensor cores (twice the bf16 rate); P·V stays bf16; the softmax is online in fp32.
- K is smoothed by subtracting its per-head channel mean over the keys: that shifts every score of a query
  row by the same q·mean, which the softmax ignores, and removes the shared offset that would otherwise eat
  the int8 range. Then one scale per block of keys (per head).
- Q carries one scale per row (token, head), with the softmax scale and log2(e) folded in before rounding.
The queries are the last ``n_q`` positions of ``n_k`` keys (a prefill chunk after ``n_k - n_q`` tokens of
context): query i sees keys j <= n_k - n_q + i. Keys/values are contiguous [n_k, Hkv, D] tensors; for a
chunked prefill the caller gathers the context from the paged cache first (quantized once per chunk here).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qwen_serving.engine.kernels.spec_attn import interpreting

LOG2E = 1.4426950408889634


@triton.jit
def _quantize_kernel(
    x_ptr,
    x_s0,
    x_s1,
    n_rows,
    mean_ptr,
    mult,
    out_ptr,
    scale_ptr,
    SUB_MEAN: tl.constexpr,
    PER_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
):
    # x [n_rows, H, D] -> int8 [H, padded rows, D] with a scale per row or per block of rows
    blk = tl.program_id(0)
    h = tl.program_id(1)
    padded_rows = tl.num_programs(0) * BLOCK
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n_rows
    d = tl.arange(0, D)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_s0 + h * x_s1 + d[None, :], mask=ok[:, None], other=0.0)
    x = x.to(tl.float32)
    if SUB_MEAN:
        x = tl.where(ok[:, None], x - tl.load(mean_ptr + h * D + d)[None, :], 0.0)
    x = x * mult
    if PER_ROW:
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, amax / 127.0, 1.0)
        y = x / scale[:, None]
        tl.store(scale_ptr + h * padded_rows + rows, scale)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl.where(amax > 0, amax / 127.0, 1.0)
        y = x / scale
        tl.store(scale_ptr + h * tl.num_programs(0) + blk, scale)
    y = (y + tl.where(y >= 0, 0.5, -0.5)).to(tl.int8)  # round half away from zero
    tl.store(out_ptr + (h * padded_rows + rows).to(tl.int64)[:, None] * D + d[None, :], y)


@triton.jit
def _int8_qk_attn_kernel(
    q8_ptr,
    q_scale_ptr,
    k8_ptr,
    k_scale_ptr,
    v_ptr,
    v_s0,
    v_s1,
    out_ptr,
    o_s0,
    o_s1,
    n_q,
    n_k,
    q_rows_padded,
    k_rows_padded,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    offset = n_k - n_q  # keys before the first query
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q = tl.load(q8_ptr + (h * q_rows_padded + rows).to(tl.int64)[:, None] * D + d[None, :])
    q_scale = tl.load(q_scale_ptr + h * q_rows_padded + rows)
    q_pos = offset + rows

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    k_blocks = k_rows_padded // BLOCK_N
    n_full = (offset + mb * BLOCK_M + 1) // BLOCK_N  # key blocks every row of this block sees entirely
    n_end = tl.cdiv(tl.minimum(n_k, offset + mb * BLOCK_M + BLOCK_M), BLOCK_N)
    for kb in range(0, n_end):
        cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.load(k8_ptr + (kvh * k_rows_padded + cols).to(tl.int64)[:, None] * D + d[None, :])
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * q_scale[:, None] * tl.load(k_scale_ptr + kvh * k_blocks + kb)
        if kb >= n_full:
            s = tl.where((cols[None, :] <= q_pos[:, None]) & (cols < n_k)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + cols.to(tl.int64)[:, None] * v_s0 + kvh * v_s1 + d[None, :], mask=(cols < n_k)[:, None],
                    other=0.0)
        if UPCAST_DOT:  # the CPU interpreter mis-multiplies bf16 dots; fp32 operands hold the same values
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * o_s0 + h * o_s1 + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows < n_q)[:, None])


def quantize_qk(
    q: torch.Tensor, k: torch.Tensor, softmax_scale: float, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [Hq, n_q padded, D], q row scales, smoothed k int8 [Hkv, n_k padded, D], k block scales)."""
    (n_q, hq, d), (n_k, hkv, _) = q.shape, k.shape
    q_blocks, k_blocks = triton.cdiv(n_q, block_m), triton.cdiv(n_k, block_n)
    q8 = torch.empty(hq, q_blocks * block_m, d, dtype=torch.int8, device=q.device)
    q_scale = torch.empty(hq, q_blocks * block_m, dtype=torch.float32, device=q.device)
    k8 = torch.empty(hkv, k_blocks * block_n, d, dtype=torch.int8, device=q.device)
    k_scale = torch.empty(hkv, k_blocks, dtype=torch.float32, device=q.device)
    k_mean = k.float().mean(dim=0).contiguous()  # [Hkv, D]; softmax-invariant shift
    _quantize_kernel[(q_blocks, hq)](q, q.stride(0), q.stride(1), n_q, q_scale, softmax_scale * LOG2E, q8, q_scale,
                                     SUB_MEAN=False, PER_ROW=True, BLOCK=block_m, D=d)
    _quantize_kernel[(k_blocks, hkv)](k, k.stride(0), k.stride(1), n_k, k_mean, 1.0, k8, k_scale,
                                      SUB_MEAN=True, PER_ROW=False, BLOCK=block_n, D=d)
    return q8, q_scale, k8, k_scale


def prefill_int8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal attention of q [n_q, Hq, D] (the last n_q positions) over k, v [n_k, Hkv, D]; bf16/fp16 in/out."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"need q [n_q, Hq, D] and k, v [n_k, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    (n_q, hq, d), (n_k, hkv, dk) = q.shape, k.shape
    if d != dk or d & (d - 1) or d < 16:
        raise ValueError(f"head_dim must match and be a power of two >= 16, got {d} and {dk}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if n_q > n_k:
        raise ValueError(f"more queries ({n_q}) than keys ({n_k})")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError("q, k, v must share a bf16/fp16 dtype")
    if min(q.stride(2), k.stride(2), v.stride(2)) != 1:
        raise ValueError("head_dim must be the unit-stride dimension")
    if out is None:
        out = torch.empty_like(q)
    if n_q == 0:
        return out
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q8, q_scale, k8, k_scale = quantize_qk(q, k, scale, block_m, block_n)
    _int8_qk_attn_kernel[(triton.cdiv(n_q, block_m), hq)](
        q8, q_scale, k8, k_scale, v, v.stride(0), v.stride(1), out, out.stride(0), out.stride(1),
        n_q, n_k, q8.shape[1], k8.shape[1],
        GROUP=hq // hkv, BLOCK_M=block_m, BLOCK_N=block_n, D=d, UPCAST_DOT=interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def prefill_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None
) -> torch.Tensor:
    """fp32 causal attention; queries are the last n_q of n_k positions, GQA by repeating KV heads."""
    (n_q, hq, d), (n_k, hkv, _) = q.shape, k.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kf = k.float().repeat_interleave(hq // hkv, dim=1)
    vf = v.float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    visible = torch.arange(n_k, device=q.device)[None, :] <= (n_k - n_q + torch.arange(n_q, device=q.device))[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vf)
