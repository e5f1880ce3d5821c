"""Split-KV attention for multi-query decode (the speculative verify step) over vLLM's paged KV cache.

FlashAttention-2 splits the KV sequence across thread blocks only for single-token decode, so a 5-token
verify runs one block per (request, head) and leaves most SMs idle. Here every (request, KV head, split)
is a program: it reads its slice of the KV once for the whole GQA group and all query tokens of the
request (causal inside the verify block: query i of a request with context L sees positions < L - q + i + 1),
writes a normalized partial and its log-sum-exp, and a second pass merges the splits.

KV cache: key/value views shaped [num_blocks, block_size, num_kv_heads, head_dim] with any strides (vLLM
0.28.0's FlashAttention backend packs K and V in one tensor: ``kv_cache.transpose(1, 2).split(D, -1)``), in the
query's dtype (bf16/fp16). No fp8 cache: vLLM's FlashAttention backend takes one only with FA3 on sm90 or FA4 on
sm100 (not on the sm80/86/89 cards this kernel is for), and then its attention layer quantizes the query to fp8.

Tiles: BLOCK_M query rows (query tokens x GQA group, padded) by BLOCK_N keys, chosen by ``tiles`` so that every
block length up to 16 queries fits the smallest per-block shared memory of those cards (sm86/sm89: 101,376 B;
tests/test_spec_attn_smem.py compiles the kernel for them). The scratch buffers for the partials are allocated once by ``SpecAttention`` so CUDA graphs see fixed
addresses; the split count adapts to each request's length on the device, so a captured grid stays valid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

REDUCE_ROWS = 8  # rows of partials merged per program in the second pass


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 2


def tiles(max_query_len: int, group: int, block_n: int | None = None) -> Tiles:
    """Launch tiles for a verify block of max_query_len tokens. At head_dim 256 and 128 rows (11-16 queries of a
    6:1 GQA group) a 64-key tile needs 114,688 B of shared memory on sm86/sm89, over their 101,376; 32 keys need
    90,112. block_n: a smaller key tile (CPU tests), never a larger one."""
    block_m = max(16, triton.next_power_of_2(max_query_len * group))
    widest = 64 if block_m <= 64 else 32
    return Tiles(block_m, min(block_n or widest, widest), num_warps=4 if block_m <= 64 else 8)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests), whose tl.dot gets bf16 operands wrong."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def split_kv_kernel(
    q_ptr,
    q_s0,
    q_s1,
    k_ptr,
    k_s0,
    k_s1,
    k_s2,
    v_ptr,
    v_s0,
    v_s1,
    v_s2,
    block_table_ptr,
    bt_s0,
    seq_lens_ptr,
    qsl_ptr,
    page_size,
    sm_scale,
    part_o_ptr,
    part_lse_ptr,
    num_splits,
    max_rows,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)

    rows = tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    row_ok = qi < q_len
    d = tl.arange(0, D)
    q_rows = (q_start + qi).to(tl.int64) * q_s0 + (kvh * GROUP + rows % GROUP) * q_s1
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    limit = seq_len - q_len + qi + 1  # causal inside the verify block

    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    t_begin = split * per_split
    t_end = tl.minimum(t_begin + per_split, tiles)
    qk_scale = sm_scale * 1.4426950408889634  # exp2

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * bt_s0
    for t in range(t_begin, t_end):
        pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        in_seq = pos < seq_len
        blk = tl.load(bt_row + pos // page_size, mask=in_seq, other=0).to(tl.int64)
        slot = (pos % page_size).to(tl.int64)
        k = tl.load(k_ptr + (blk * k_s0 + slot * k_s1 + kvh * k_s2)[:, None] + d[None, :], mask=in_seq[:, None],
                    other=0.0)
        v = tl.load(v_ptr + (blk * v_s0 + slot * v_s1 + kvh * v_s2)[:, None] + d[None, :], mask=in_seq[:, None],
                    other=0.0)
        if UPCAST_DOT:  # the CPU interpreter mis-multiplies bf16 dots; fp32 operands hold the same values
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * qk_scale
        else:
            s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(pos[None, :] < limit[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    base = (b * num_kv_heads + kvh) * num_splits + split
    tl.store(part_lse_ptr + base.to(tl.int64) * max_rows + rows, lse, mask=rows < max_rows)
    o_rows = (base.to(tl.int64) * max_rows + rows) * D
    tl.store(part_o_ptr + o_rows[:, None] + d[None, :], out, mask=(rows < max_rows)[:, None])


@triton.jit
def _merge_splits_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    out_s0,
    out_s1,
    qsl_ptr,
    num_splits,
    max_rows,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    num_kv_heads = tl.num_programs(1)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    qi = rows // GROUP
    row_ok = (qi < q_len) & (rows < max_rows)
    d = tl.arange(0, D)
    m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    for split in range(num_splits):
        base = ((b * num_kv_heads + kvh) * num_splits + split).to(tl.int64) * max_rows + rows
        lse = tl.load(part_lse_ptr + base, mask=row_ok, other=float("-inf"))
        o = tl.load(part_o_ptr + base[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        total = total * alpha + w
        acc = acc * alpha[:, None] + o * w[:, None]
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    dst = (q_start + qi).to(tl.int64) * out_s0 + (kvh * GROUP + rows % GROUP) * out_s1
    tl.store(out_ptr + dst[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


class SpecAttention:
    """Owns the split-KV scratch (fixed addresses for CUDA graphs) and launches the two passes.

    Sized once for max_batch requests of up to max_query_len query tokens and max_splits splits:
    partials take max_batch * num_kv_heads * max_splits * max_query_len * group * (head_dim + 1) * 4 bytes.
    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_batch: int,
        max_query_len: int = 16,
        max_splits: int = 32,
        device: torch.device | str = "cuda",
        block_n: int | None = None,
    ):
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
        if min(max_batch, max_query_len, max_splits) < 1:
            raise ValueError("max_batch, max_query_len and max_splits must be >= 1")
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_q_heads // num_kv_heads
        self.head_dim = head_dim
        self.max_batch = max_batch
        self.max_query_len = max_query_len
        self.max_splits = max_splits
        self.block_n = block_n
        self.max_rows = max_query_len * self.group
        device = torch.device(device)
        self.part_o = torch.empty(max_batch * num_kv_heads * max_splits * self.max_rows * head_dim,
                                  dtype=torch.float32, device=device)
        self.part_lse = torch.empty(max_batch * num_kv_heads * max_splits * self.max_rows, dtype=torch.float32,
                                    device=device)
        self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8

    def default_splits(self, batch: int) -> int:
        """One wave: about one program per SM across the batch (a program's K/V tiles fill most of an SM's
        shared memory); each split then adapts to its request's length on the device."""
        return max(1, min(self.max_splits, triton.cdiv(self._num_sms, batch * self.num_kv_heads)))

    def forward(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        softmax_scale: float,
        out: torch.Tensor | None = None,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        """q: [tokens, Hq, D]; caches: [num_blocks, block_size, Hkv, D] views; block_table: [batch, max_blocks];
        seq_lens: [batch] context length including the query tokens; query_start_loc: [batch + 1];
        max_query_len: host bound on the query tokens of any request (<= the size given at construction)."""
        batch = query_start_loc.shape[0] - 1
        self._check(q, key_cache, value_cache, block_table, seq_lens, batch, max_query_len)
        if out is None:
            out = torch.empty_like(q)
        if batch == 0:
            return out
        splits = num_splits or self.default_splits(batch)
        if not 1 <= splits <= self.max_splits:
            raise ValueError(f"num_splits must be in [1, {self.max_splits}], got {splits}")
        tile = tiles(max_query_len, self.group, self.block_n)
        split_kv_kernel[(batch, self.num_kv_heads, splits)](
            q, q.stride(0), q.stride(1),
            key_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache, value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_table, block_table.stride(0), seq_lens, query_start_loc, key_cache.shape[1], softmax_scale,
            self.part_o, self.part_lse, splits, self.max_rows,
            GROUP=self.group, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, D=self.head_dim, UPCAST_DOT=interpreting(),
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
        used_rows = max_query_len * self.group
        _merge_splits_kernel[(batch, self.num_kv_heads, triton.cdiv(used_rows, REDUCE_ROWS))](
            self.part_o, self.part_lse, out, out.stride(0), out.stride(1), query_start_loc, splits, self.max_rows,
            GROUP=self.group, ROWS=REDUCE_ROWS, D=self.head_dim, num_warps=4,
        )
        return out

    __call__ = forward

    def _check(self, q, key_cache, value_cache, block_table, seq_lens, batch, max_query_len) -> None:
        if q.dim() != 3 or q.shape[1:] != (self.num_q_heads, self.head_dim) or q.stride(2) != 1:
            raise ValueError(f"q must be [tokens, {self.num_q_heads}, {self.head_dim}] with unit last stride")
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            if cache.dim() != 4 or cache.shape[2:] != (self.num_kv_heads, self.head_dim) or cache.stride(3) != 1:
                raise ValueError(f"{name} must be [blocks, block_size, {self.num_kv_heads}, {self.head_dim}]")
        if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
            raise ValueError(f"KV dtype {key_cache.dtype}/{value_cache.dtype} must equal q's ({q.dtype})")
        if not 1 <= max_query_len <= self.max_query_len:
            raise ValueError(f"max_query_len must be in [1, {self.max_query_len}], got {max_query_len}")
        if batch > self.max_batch or block_table.shape[0] < batch or seq_lens.shape[0] < batch:
            raise ValueError(f"batch {batch} exceeds max_batch {self.max_batch} or the metadata tensors")


def spec_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """fp32 definition: gather each request's pages, causal attention inside the verify block."""
    num_q_heads, num_kv_heads = q.shape[1], key_cache.shape[2]
    page = key_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(query_start_loc.shape[0] - 1):
        q0, q1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len = int(seq_lens[b])
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_table[b, pos // page].long()
        k = key_cache[blocks, pos % page].float()  # [seq, Hkv, D]
        v = value_cache[blocks, pos % page].float()
        k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_q_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * softmax_scale
        limit = seq_len - (q1 - q0) + torch.arange(q1 - q0, device=q.device) + 1
        scores = scores.masked_fill(pos[None, None, :] >= limit[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out
