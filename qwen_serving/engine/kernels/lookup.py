"""Lookup drafting: propose the continuation of the most recent earlier occurrence of the history's suffix.

For each request, among suffix lengths ``nmin..nmax`` the longest one that occurs earlier in the request's
own token history wins; among its occurrences the most recent one wins (ties broken by recency). An
occurrence may overlap the suffix itself, so periodic text (a repeated list marker, an indent) matches at
its own period. The draft is the tokens that followed the occurrence, as many as the history holds, at
most ``num_draft``.

Equivalently, with ``c`` the position right after an occurrence (``nmin <= c <= L - 1``), the match length
at ``c`` is the number of tokens before ``c`` that equal the suffix, read backwards, capped at ``nmax``; the
best ``c`` has the largest match length (>= ``nmin``) and, among those, is the largest. The candidates ``c`` are
split into chunks of ``block`` positions, one program per (request, chunk), all at once: a program tests ``nmin``
tokens on its whole chunk before extending any candidate (a chunk none of whose candidates matches the suffix's
last token loads nothing more) and writes its best as one int64, ``match_len << 32 | c`` (0: none), so the
largest key is the longest match and, among those, the most recent. A second kernel, one program per request,
takes the largest of its chunks' keys and writes the draft. The grid depends only on the history buffer's width,
so a CUDA graph can hold both launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

DEFAULT_NMIN = 6
DEFAULT_NMAX = 12
MAX_NMAX = 64  # the match loop is unrolled nmax times
DEFAULT_BLOCK = 2048  # candidates per program: 32 x 8 programs for 64k x 8 (unmeasured: bench/ times it)


class LookupDraft(NamedTuple):
    tokens: torch.Tensor  # [batch, num_draft] int64; positions past num_valid hold 0
    num_valid: torch.Tensor  # [batch] int32; 0 where nothing matched (or a padded / invalid entry)
    match_len: torch.Tensor  # [batch] int32; length of the matched suffix, 0 where nothing matched


def _check_block(block: int) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two (a Triton range), got {block}")


def _check_params(num_draft: int, nmin: int, nmax: int) -> None:
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    if not 1 <= nmin <= nmax <= MAX_NMAX:
        raise ValueError(f"need 1 <= nmin <= nmax <= {MAX_NMAX}, got nmin={nmin} nmax={nmax}")


def lookup_draft_reference(
    history: torch.Tensor,
    lengths: torch.Tensor,
    num_draft: int,
    nmin: int = DEFAULT_NMIN,
    nmax: int = DEFAULT_NMAX,
    slots: torch.Tensor | None = None,
) -> LookupDraft:
    """Plain-torch definition: for each suffix length, longest first, the last earlier window equal to it."""
    _check_params(num_draft, nmin, nmax)
    history = history.cpu()
    lengths = lengths.cpu()
    num_slots, width = history.shape
    slots = torch.arange(num_slots) if slots is None else slots.cpu()
    batch = slots.shape[0]
    tokens = torch.zeros(batch, num_draft, dtype=torch.int64)
    num_valid = torch.zeros(batch, dtype=torch.int32)
    match_len = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        slot = int(slots[b])
        if not 0 <= slot < num_slots:
            continue
        length = min(max(int(lengths[slot]), 0), width)
        seq = history[slot, :length].to(torch.int64)
        for n in range(nmax, nmin - 1, -1):
            if length < n + 1:
                continue
            # windows starting at j = 0 .. length-n-1: every earlier occurrence, overlapping ones included
            windows = seq[: length - 1].unfold(0, n, 1)
            hits = (windows == seq[length - n :]).all(dim=1).nonzero()
            if hits.numel():
                cont = int(hits[-1]) + n
                count = min(num_draft, length - cont)
                tokens[b, :count] = seq[cont : cont + count]
                num_valid[b] = count
                match_len[b] = n
                break
    return LookupDraft(tokens, num_valid, match_len)


@triton.jit
def _request_row(hist_ptr, hist_stride, width, lengths_ptr, slots_ptr, num_slots, b):
    """(row pointer, clamped length) of batch entry b; a padded entry reads as an empty row 0."""
    slot = tl.load(slots_ptr + b).to(tl.int32)
    in_range = (slot >= 0) & (slot < num_slots)
    slot = tl.where(in_range, slot, 0)
    length = tl.load(lengths_ptr + slot).to(tl.int32)
    length = tl.minimum(tl.maximum(length, 0), width)
    length = tl.where(in_range, length, 0)
    return hist_ptr + slot.to(tl.int64) * hist_stride, length


@triton.jit
def _lookup_chunk_kernel(
    hist_ptr,
    hist_stride,
    width,
    lengths_ptr,
    slots_ptr,
    num_slots,
    best_ptr,
    num_chunks,
    NMIN: tl.constexpr,
    NMAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    row, length = _request_row(hist_ptr, hist_stride, width, lengths_ptr, slots_ptr, num_slots, b)
    cont = chunk * BLOCK + tl.arange(0, BLOCK)
    alive = (cont >= NMIN) & (cont <= length - 1)  # leaves at least one token to propose
    # reject test: the suffix's last token first, and the chunk is done when no candidate matched it (the common case
    # on text that does not repeat); then the rest of the nmin tokens
    last = tl.load(row + (length - 1), mask=length > 0, other=0)
    alive = alive & (tl.load(row + (cont - 1), mask=alive, other=0) == last)
    if tl.max(alive.to(tl.int32), axis=0) > 0:
        for t in tl.static_range(1, NMIN):
            want = tl.load(row + (length - 1 - t))
            got = tl.load(row + (cont - 1 - t), mask=alive, other=0)
            alive = alive & (got == want)
    key = tl.zeros((), dtype=tl.int64)
    if tl.max(alive.to(tl.int32), axis=0) > 0:
        mlen = alive.to(tl.int32) * NMIN
        for t in tl.static_range(NMIN, NMAX):
            ok = cont - 1 - t >= 0  # cont < length, so the suffix's token is in the row too
            want = tl.load(row + (length - 1 - t), mask=length - 1 - t >= 0, other=0)
            got = tl.load(row + (cont - 1 - t), mask=alive & ok, other=0)
            alive = alive & ok & (got == want)
            mlen += alive.to(tl.int32)
        # longest first, then most recent: one max over (length, position) packed into an int64; 0 is "no match"
        key = tl.max(tl.where(mlen > 0, (mlen.to(tl.int64) << 32) | cont.to(tl.int64), 0), axis=0)
    tl.store(best_ptr + b * num_chunks + chunk, key)


@triton.jit
def _lookup_draft_kernel(
    hist_ptr,
    hist_stride,
    width,
    lengths_ptr,
    slots_ptr,
    num_slots,
    best_ptr,
    num_chunks,
    out_tokens_ptr,
    out_valid_ptr,
    out_match_ptr,
    NUM_DRAFT: tl.constexpr,
    DRAFT_PAD: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    row, length = _request_row(hist_ptr, hist_stride, width, lengths_ptr, slots_ptr, num_slots, b)
    k = tl.arange(0, CHUNKS_PAD)
    key = tl.max(tl.load(best_ptr + b * num_chunks + k, mask=k < num_chunks, other=0), axis=0)
    best_len = (key >> 32).to(tl.int32)
    best_cont = key.to(tl.int32)  # the low 32 bits: positions are below 2**31
    count = tl.where(best_len > 0, tl.minimum(length - best_cont, NUM_DRAFT), 0)
    d = tl.arange(0, DRAFT_PAD)
    draft = tl.load(row + best_cont + d, mask=d < count, other=0)
    tl.store(out_tokens_ptr + b * NUM_DRAFT + d, draft.to(tl.int64), mask=d < NUM_DRAFT)
    tl.store(out_valid_ptr + b, count)
    tl.store(out_match_ptr + b, best_len)


def lookup_chunks(width: int, block: int = DEFAULT_BLOCK) -> int:
    """Candidate chunks per request: the scratch's width and the first kernel's grid (fixed by the buffer's width)."""
    _check_block(block)
    return max(1, triton.cdiv(width, block))


def lookup_scratch(batch: int, width: int, block: int = DEFAULT_BLOCK, device=None) -> torch.Tensor:
    """The per-chunk best matches, [batch, chunks] int64, for callers that preallocate (CUDA graphs)."""
    return torch.empty(batch, lookup_chunks(width, block), dtype=torch.int64, device=device)


def lookup_draft(
    history: torch.Tensor,
    lengths: torch.Tensor,
    num_draft: int,
    nmin: int = DEFAULT_NMIN,
    nmax: int = DEFAULT_NMAX,
    slots: torch.Tensor | None = None,
    out: LookupDraft | None = None,
    block: int = DEFAULT_BLOCK,
    scratch: torch.Tensor | None = None,
) -> LookupDraft:
    """Draft ``num_draft`` tokens per request from its own history, in two launches for the whole batch.

    history: [num_slots, width] int32/int64 token buffer (vLLM's ``all_token_ids``), rows indexed by slot.
    lengths: [num_slots] number of valid tokens per slot (clamped to [0, width]).
    slots: [batch] slot of each batch entry (default: slot b for entry b); a slot outside
        [0, num_slots) marks a padded entry and yields no draft.
    out: preallocated outputs (fixed addresses for CUDA graphs); written in place and returned.
    block: candidates per program (a power of two).
    scratch: preallocated per-chunk results (``lookup_scratch(batch, width, block)``); fully overwritten.
    """
    _check_params(num_draft, nmin, nmax)
    if history.dim() != 2 or history.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"history must be a 2-D int32/int64 tensor, got {history.dtype} {tuple(history.shape)}")
    if history.stride(1) != 1:
        raise ValueError("history rows must be contiguous")
    num_slots, width = history.shape
    num_chunks = lookup_chunks(width, block)
    if lengths.shape != (num_slots,):
        raise ValueError(f"lengths must have shape ({num_slots},), got {tuple(lengths.shape)}")
    if slots is None:
        slots = torch.arange(num_slots, dtype=torch.int32, device=history.device)
    batch = slots.shape[0]
    if out is None:
        out = LookupDraft(
            torch.empty(batch, num_draft, dtype=torch.int64, device=history.device),
            torch.empty(batch, dtype=torch.int32, device=history.device),
            torch.empty(batch, dtype=torch.int32, device=history.device),
        )
    elif out.tokens.shape != (batch, num_draft) or out.num_valid.shape != (batch,):
        raise ValueError("out buffers do not match batch x num_draft")
    if scratch is None:
        scratch = lookup_scratch(batch, width, block, history.device)
    elif scratch.shape != (batch, num_chunks) or scratch.dtype != torch.int64 or not scratch.is_contiguous():
        raise ValueError(f"scratch must be a contiguous int64 ({batch}, {num_chunks}) tensor (lookup_scratch)")
    if batch == 0:
        return out
    row_args = (history, history.stride(0), width, lengths, slots, num_slots, scratch, num_chunks)
    # every chunk of every request at once (the grid depends only on the buffer's width), then one program per
    # request takes the best of its chunks and writes the draft
    _lookup_chunk_kernel[(batch, num_chunks)](*row_args, NMIN=nmin, NMAX=nmax, BLOCK=block, num_warps=4)
    _lookup_draft_kernel[(batch,)](
        *row_args,
        out.tokens,
        out.num_valid,
        out.match_len,
        NUM_DRAFT=num_draft,
        DRAFT_PAD=triton.next_power_of_2(num_draft),
        CHUNKS_PAD=triton.next_power_of_2(num_chunks),
        num_warps=1,
    )
    return out
