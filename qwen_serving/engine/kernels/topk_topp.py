"""Sort-free top-k/top-p for small k, a multi-block softmax, and sampling from the truncated distribution.

vLLM's torch path (``apply_top_k_top_p_pytorch``) sorts the whole vocabulary of every row. When every row's
top-k is at most ``MAX_K`` and the caller knows a bound ``k_max`` on the host, the top-k support lies in
``torch.topk(logits, k_max + 1)``, so top-p only needs those candidates, and the full-vocabulary work is
one pass writing probabilities (and/or the masked logits) over several programs per row.

Semantics are exactly those of vLLM's sort path, ties included (sampler-small-topk.patch hands the kernel only
the batches vLLM's dispatch would sort; its Triton path, from 8 rows on CUDA, keeps exactly k at a tie and runs
as it is). In vLLM's ascending (stable) sort, equal values are ordered by
index, so the kept set is always ``{(x, i) >= (cut_value, cut_index)}`` in (value, index) order:
- top-k keeps every logit >= the k-th largest value, so ties at the k-th value are all kept (more than k
  tokens survive);
- top-p then masks the ascending prefix whose cumulative probability (over the top-k support) is
  <= 1 - p, never the largest token; among tied tokens the lower indices go first.
When more tokens tie at the k-th value than ``k_max + 1`` candidates can hold ("overflow", only with
degenerate logits), the tied tokens' count and their rank by index come from a counting pass over the row.

Probabilities agree with vLLM's to float32 rounding; masks agree exactly except where a cumulative
probability lies within rounding of 1 - p (the summation order differs), where neither answer is more right.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 64  # above this the candidate sort stops being cheap; use vLLM's path
DEFAULT_BLOCK = 4096


@triton.jit
def _count_ties_kernel(
    logits_ptr, stride, vocab, vals_ptr, k_ptr, k_cap, tie_count_ptr, num_blocks, K: tl.constexpr, BLOCK: tl.constexpr
):
    # Only rows whose candidates may miss tied tokens at the k-th value read their logits.
    r = tl.program_id(0)
    b = tl.program_id(1)
    k = tl.minimum(tl.maximum(tl.load(k_ptr + r).to(tl.int32), 1), k_cap)
    thr = tl.load(vals_ptr + r * K + k - 1)
    overflow = (tl.load(vals_ptr + r * K + K - 1) == thr) & (K < vocab) & (thr > float("-inf"))
    offs = b * BLOCK + tl.arange(0, BLOCK)
    in_row = tl.where(overflow, offs < vocab, False)  # (vector & scalar-bool trips the interpreter)
    x = tl.load(logits_ptr + r.to(tl.int64) * stride + offs, mask=in_row, other=0.0)
    tl.store(tie_count_ptr + r * num_blocks + b, tl.sum((in_row & (x == thr)).to(tl.int32), axis=0))


@triton.jit
def _plan_kernel(
    vals_ptr,
    idx_ptr,
    k_ptr,
    k_cap,
    p_ptr,
    vocab,
    tie_count_ptr,
    num_blocks,
    row_max_ptr,
    norm_ptr,
    cut_val_ptr,
    cut_key_ptr,
    rank_mode_ptr,
    tie_offset_ptr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_P: tl.constexpr,
    NB_PAD: tl.constexpr,
):
    # One program per row: top-p over the <= k_max + 1 candidates, reduced to a cut point and a normalizer.
    r = tl.program_id(0)
    k = tl.minimum(tl.maximum(tl.load(k_ptr + r).to(tl.int32), 1), k_cap)
    thr = tl.load(vals_ptr + r * K + k - 1)
    row_max = tl.load(vals_ptr + r * K)
    overflow = (tl.load(vals_ptr + r * K + K - 1) == thr) & (K < vocab) & (thr > float("-inf"))

    blocks = tl.arange(0, NB_PAD)
    counts = tl.load(tie_count_ptr + r * num_blocks + blocks, mask=blocks < num_blocks, other=0)
    tl.store(tie_offset_ptr + r * num_blocks + blocks, tl.cumsum(counts, axis=0) - counts, mask=blocks < num_blocks)

    # Ascending (value, index) order without sorting: compare every candidate with every other one.
    # The int64 key orders like (value, index); padding lanes get the smallest key and weigh nothing.
    j = tl.arange(0, K_PAD)
    lane_ok = j < K
    v = tl.load(vals_ptr + r * K + j, mask=lane_ok, other=float("-inf"))
    ids = tl.load(idx_ptr + r * K + j, mask=lane_ok, other=0).to(tl.int32)
    bits = (v + 0.0).to(tl.int32, bitcast=True)  # + 0.0 makes -0.0 equal to 0.0
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(lane_ok, (ordered.to(tl.int64) << 32) | ids.to(tl.int64), -9223372036854775807 - 1)

    support = lane_ok & (v >= thr)
    tied = lane_ok & (v == thr)
    cand_ties = tl.sum(tied.to(tl.int32), axis=0)
    num_ties = tl.where(overflow, tl.sum(counts, axis=0), cand_ties)
    is_last_tied = tied & (key == tl.max(tl.where(tied, key, -9223372036854775807 - 1), axis=0))
    e = tl.where(support, tl.exp(v - row_max), 0.0)
    e_thr = tl.exp(thr - row_max)
    # ties outside the candidates sit just before the last tied candidate in ascending order
    w = e + tl.where(is_last_tied, (num_ties - cand_ties).to(tl.float32) * e_thr, 0.0)
    support_sum = tl.sum(w, axis=0)
    if HAS_P:
        one_minus_p = 1.0 - tl.load(p_ptr + r).to(tl.float32)
        at_or_below = key[None, :] <= key[:, None]
        cum = tl.sum(tl.where(at_or_below, (w / support_sum)[None, :], 0.0), axis=1)
        masked = (cum <= one_minus_p) & (key != tl.max(key, axis=0))  # never the largest token
    else:
        one_minus_p = 0.0
        masked = j < 0
    kept = support & ~masked

    # overflow and top-p stops inside the tied group: the cut is a rank among the tied tokens
    rank_mode = overflow & (tl.sum((masked & is_last_tied).to(tl.int32), axis=0) == 0)
    tied_masked = tl.floor(one_minus_p / (e_thr / support_sum))
    tied_masked = tl.minimum(tl.maximum(tied_masked, 0.0), (num_ties - 1).to(tl.float32)).to(tl.int32)
    is_first_kept = key == tl.min(tl.where(kept, key, 9223372036854775807), axis=0)
    lex_val = tl.sum(tl.where(is_first_kept, v, 0.0), axis=0)
    lex_idx = tl.sum(tl.where(is_first_kept, ids, 0), axis=0)
    above_sum = tl.sum(tl.where(lane_ok & (v > thr), e, 0.0), axis=0)
    rank_norm = above_sum + (num_ties - tied_masked).to(tl.float32) * e_thr
    tl.store(row_max_ptr + r, row_max)
    tl.store(norm_ptr + r, tl.where(rank_mode, rank_norm, tl.sum(tl.where(kept, w, 0.0), axis=0)))
    tl.store(cut_val_ptr + r, tl.where(rank_mode, thr, lex_val))
    tl.store(cut_key_ptr + r, tl.where(rank_mode, tied_masked, lex_idx))
    tl.store(rank_mode_ptr + r, rank_mode.to(tl.int32))


@triton.jit
def _apply_cut_kernel(
    logits_ptr,
    stride,
    vocab,
    probs_ptr,
    probs_stride,
    row_max_ptr,
    norm_ptr,
    cut_val_ptr,
    cut_key_ptr,
    rank_mode_ptr,
    tie_offset_ptr,
    num_blocks,
    WRITE_PROBS: tl.constexpr,
    MASK_LOGITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < vocab
    row = logits_ptr + r.to(tl.int64) * stride
    x = tl.load(row + offs, mask=in_row, other=float("-inf"))
    cut_val = tl.load(cut_val_ptr + r)
    at_cut = in_row & (x == cut_val)
    # rank of a tied token among all tokens equal to the cut value, by index
    rank = tl.load(tie_offset_ptr + r * num_blocks + b) + tl.cumsum(at_cut.to(tl.int32), axis=0) - at_cut.to(tl.int32)
    key = tl.where(tl.load(rank_mode_ptr + r) != 0, rank, offs)
    kept = in_row & ((x > cut_val) | (at_cut & (key >= tl.load(cut_key_ptr + r))))
    if WRITE_PROBS:
        probs = tl.exp(x - tl.load(row_max_ptr + r)) / tl.load(norm_ptr + r)
        tl.store(probs_ptr + r.to(tl.int64) * probs_stride + offs, tl.where(kept, probs, 0.0), mask=in_row)
    if MASK_LOGITS:
        tl.store(row + offs, float("-inf"), mask=in_row & ~kept)


def _check(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor | None, k_max: int) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be 2-D float32 (vLLM's sampler dtype), got {logits.dtype} {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        raise ValueError("logits rows must be contiguous")
    if not 1 <= k_max <= MAX_K:
        raise ValueError(f"k_max must be in [1, {MAX_K}] (larger k: use vLLM's sort-based path), got {k_max}")
    rows = logits.shape[0]
    if k.shape != (rows,):
        raise ValueError(f"k must have shape ({rows},), got {tuple(k.shape)}")
    if p is not None and p.shape != (rows,):
        raise ValueError(f"p must have shape ({rows},), got {tuple(p.shape)}")


def _top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor | None,
    k_max: int,
    probs_out: torch.Tensor | None,
    mask_logits: bool,
    block: int,
) -> None:
    _check(logits, k, p, k_max)
    rows, vocab = logits.shape
    if rows == 0:
        return
    k_cap = min(k_max, vocab)
    num_cand = min(vocab, k_max + 1)
    vals, idx = torch.topk(logits, num_cand, dim=1)  # contiguous [rows, num_cand]; idx int64
    num_blocks = triton.cdiv(vocab, block)
    dev = logits.device
    tie_count = torch.empty(rows, num_blocks, dtype=torch.int32, device=dev)
    tie_offset = torch.empty_like(tie_count)
    row_max = torch.empty(rows, dtype=torch.float32, device=dev)
    norm = torch.empty_like(row_max)
    cut_val = torch.empty_like(row_max)
    cut_key = torch.empty(rows, dtype=torch.int32, device=dev)
    rank_mode = torch.empty_like(cut_key)
    _count_ties_kernel[(rows, num_blocks)](
        logits, logits.stride(0), vocab, vals, k, k_cap, tie_count, num_blocks, K=num_cand, BLOCK=block
    )
    _plan_kernel[(rows,)](
        vals,
        idx,
        k,
        k_cap,
        p if p is not None else row_max,
        vocab,
        tie_count,
        num_blocks,
        row_max,
        norm,
        cut_val,
        cut_key,
        rank_mode,
        tie_offset,
        K=num_cand,
        K_PAD=max(16, triton.next_power_of_2(num_cand)),
        HAS_P=p is not None,
        NB_PAD=max(16, triton.next_power_of_2(num_blocks)),
    )
    _apply_cut_kernel[(rows, num_blocks)](
        logits,
        logits.stride(0),
        vocab,
        probs_out if probs_out is not None else logits,
        probs_out.stride(0) if probs_out is not None else 0,
        row_max,
        norm,
        cut_val,
        cut_key,
        rank_mode,
        tie_offset,
        num_blocks,
        WRITE_PROBS=probs_out is not None,
        MASK_LOGITS=mask_logits,
        BLOCK=block,
    )


def top_k_top_p_reference(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Plain-torch definition (full stable sort): a masked copy of logits, -inf outside the kept set."""
    ascending, order = logits.sort(dim=-1, stable=True)
    drop = torch.zeros_like(ascending, dtype=torch.bool)
    if k is not None:
        kth_largest = ascending.gather(1, (logits.shape[1] - k.long()).clamp(min=0)[:, None])
        drop = ascending < kth_largest
    if p is not None:
        probs = ascending.masked_fill(drop, float("-inf")).softmax(dim=-1)
        drop = drop | (probs.cumsum(dim=-1) <= 1 - p[:, None])
        drop[:, -1] = False  # the most likely token always survives
    return logits.scatter(1, order, ascending.masked_fill(drop, float("-inf")))


def apply_top_k_top_p_small_k(
    logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor | None, k_max: int, block: int = DEFAULT_BLOCK
) -> torch.Tensor:
    """Drop-in for vLLM's ``apply_top_k_top_p`` when every row's k <= k_max <= MAX_K: masks logits in place.

    k: [rows] int, each in [1, k_max] (values outside are clamped); p: [rows] float in (0, 1] or None.
    """
    _top_k_top_p(logits, k, p, k_max, None, True, block)
    return logits


def top_k_top_p_probs(
    logits: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor | None,
    k_max: int,
    out: torch.Tensor | None = None,
    mask_logits: bool = False,
    block: int = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Probabilities of the top-k/top-p truncated distribution (softmax of vLLM's masked logits), fp32."""
    if out is None:
        out = torch.empty_like(logits, dtype=torch.float32)
    elif out.shape != logits.shape or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError("out must be a float32 tensor shaped like logits with contiguous rows")
    _top_k_top_p(logits, k, p, k_max, out, mask_logits, block)
    return out


def sample_top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor,
    p: torch.Tensor | None,
    k_max: int,
    generators: dict[int, torch.Generator] | None = None,
    block: int = DEFAULT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from the truncated distribution; returns (tokens int64, probs).

    Used for the target and for drafts alike, so a draft is drawn from the same truncated support the target
    verifies against. generators: optional per-row torch generators (seeded requests).
    """
    probs = top_k_top_p_probs(logits, k, p, k_max, block=block)
    return sample_from_probs(probs, generators), probs


def sample_from_probs(probs: torch.Tensor, generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
    """One token per row by exponential race (argmax of p / Exp(1)), as vLLM samples; no host sync."""
    noise = torch.empty_like(probs)
    generators = generators or {}
    if len(generators) != probs.shape[0]:
        noise.exponential_()
    for row, gen in generators.items():
        noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


@triton.jit
def _softmax_partial_kernel(x_ptr, stride, vocab, part_max_ptr, part_sum_ptr, num_blocks, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r.to(tl.int64) * stride + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - tl.where(m > float("-inf"), m, 0.0)), axis=0)  # an all -inf block sums to 0
    tl.store(part_max_ptr + r * num_blocks + b, m)
    tl.store(part_sum_ptr + r * num_blocks + b, s)


@triton.jit
def _softmax_normalize_kernel(
    x_ptr, stride, vocab, out_ptr, out_stride, part_max_ptr, part_sum_ptr, num_blocks, NB_PAD: tl.constexpr,
    BLOCK: tl.constexpr
):
    r = tl.program_id(0)
    b = tl.program_id(1)
    parts = tl.arange(0, NB_PAD)
    pm = tl.load(part_max_ptr + r * num_blocks + parts, mask=parts < num_blocks, other=float("-inf"))
    ps = tl.load(part_sum_ptr + r * num_blocks + parts, mask=parts < num_blocks, other=0.0)
    m = tl.max(pm, axis=0)
    total = tl.sum(tl.where(pm > float("-inf"), ps * tl.exp(pm - m), 0.0), axis=0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r.to(tl.int64) * stride + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64) * out_stride + offs, tl.exp(x - m) / total, mask=offs < vocab)


def softmax(logits: torch.Tensor, out: torch.Tensor | None = None, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Row softmax in fp32 over several programs per row: a partial max/sum pass, then a normalize pass."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point or logits.stride(1) != 1:
        raise ValueError("logits must be a 2-D floating tensor with contiguous rows")
    rows, vocab = logits.shape
    if out is None:
        out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
    num_blocks = triton.cdiv(vocab, block)
    if rows == 0 or vocab == 0:
        return out
    part_max = torch.empty(rows, num_blocks, dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    _softmax_partial_kernel[(rows, num_blocks)](logits, logits.stride(0), vocab, part_max, part_sum, num_blocks,
                                                BLOCK=block)
    _softmax_normalize_kernel[(rows, num_blocks)](
        logits, logits.stride(0), vocab, out, out.stride(0), part_max, part_sum, num_blocks,
        NB_PAD=max(16, triton.next_power_of_2(num_blocks)), BLOCK=block,
    )
    return out
