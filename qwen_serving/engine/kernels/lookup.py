"""Lookup drafting: propose the continuation of the most recent earlier occurrence of the history's suffix.

For each request, among suffix lengths ``nmin..nmax`` the longest one that occurs earlier in the request's
own token history wins; among its occurrences the most recent one wins (ties broken by recency). An
occurrence may overlap the suffix itself, so periodic text (a repeated list marker, an indent) matches at
its own period. The draft is the tokens that followed the occurrence, as many as the history holds, at
most ``num_draft``.

Equivalently, with ``c`` the position right after an occurrence (``nmin <= c <= L - 1``), the match length
at ``c`` is the number of tokens before ``c`` that equal the suffix, read backwards, capped at ``nmax``; the
best ``c`` has the largest match length (>= ``nmin``) and, among those, is the largest. The kernel scans
``c`` from the newest position backwards, one program per request, tests ``nmin`` tokens on a whole block
of candidates before extending any of them (a block none of whose candidates matches the suffix's last token
loads nothing more), and stops early once an ``nmax``-token match is found.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

DEFAULT_NMIN = 6
DEFAULT_NMAX = 12
MAX_NMAX = 64  # the match loop is unrolled nmax times
DEFAULT_BLOCK = 8192  # candidates per iteration: 8 iterations for a 64k history (unmeasured: bench/ times it)


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
def _lookup_kernel(
    hist_ptr,
    hist_stride,
    width,
    lengths_ptr,
    slots_ptr,
    num_slots,
    out_tokens_ptr,
    out_valid_ptr,
    out_match_ptr,
    NMIN: tl.constexpr,
    NMAX: tl.constexpr,
    NUM_DRAFT: tl.constexpr,
    DRAFT_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b).to(tl.int32)
    in_range = (slot >= 0) & (slot < num_slots)
    slot = tl.where(in_range, slot, 0)
    length = tl.load(lengths_ptr + slot).to(tl.int32)
    length = tl.minimum(tl.maximum(length, 0), width)
    length = tl.where(in_range, length, 0)
    row = hist_ptr + slot.to(tl.int64) * hist_stride

    best_len = tl.zeros((), dtype=tl.int32)
    best_cont = tl.zeros((), dtype=tl.int32)
    lanes = tl.arange(0, BLOCK)
    newest = length - 1  # the largest continuation position that leaves one token to propose
    while (newest >= NMIN) & (best_len < NMAX):
        cont = newest - lanes
        alive = cont >= NMIN
        # reject test, for the whole block at once: the suffix's last token first, and the block is done when no
        # candidate matched it (the common case on text that does not repeat); then the rest of the nmin tokens
        alive = alive & (tl.load(row + (cont - 1), mask=alive, other=0) == tl.load(row + (length - 1)))
        if tl.max(alive.to(tl.int32), axis=0) > 0:
            for t in tl.static_range(1, NMIN):
                want = tl.load(row + (length - 1 - t))
                got = tl.load(row + (cont - 1 - t), mask=alive, other=0)
                alive = alive & (got == want)
        if tl.max(alive.to(tl.int32), axis=0) > 0:
            mlen = alive.to(tl.int32) * NMIN
            for t in tl.static_range(NMIN, NMAX):
                ok = (length - 1 - t >= 0) & (cont - 1 - t >= 0)
                want = tl.load(row + (length - 1 - t), mask=length - 1 - t >= 0, other=0)
                got = tl.load(row + (cont - 1 - t), mask=alive & ok, other=0)
                alive = alive & ok & (got == want)
                mlen += alive.to(tl.int32)
            block_best = tl.max(mlen, axis=0)
            # lanes run from newest to oldest, so the largest position among the longest is the most recent
            block_cont = tl.max(tl.where(mlen == block_best, cont, -1), axis=0)
            better = block_best > best_len
            best_cont = tl.where(better, block_cont, best_cont)
            best_len = tl.where(better, block_best, best_len)
        newest -= BLOCK

    count = tl.where(best_len > 0, tl.minimum(length - best_cont, NUM_DRAFT), 0)
    d = tl.arange(0, DRAFT_PAD)
    draft = tl.load(row + best_cont + d, mask=d < count, other=0)
    tl.store(out_tokens_ptr + b * NUM_DRAFT + d, draft.to(tl.int64), mask=d < NUM_DRAFT)
    tl.store(out_valid_ptr + b, count)
    tl.store(out_match_ptr + b, best_len)


def lookup_draft(
    history: torch.Tensor,
    lengths: torch.Tensor,
    num_draft: int,
    nmin: int = DEFAULT_NMIN,
    nmax: int = DEFAULT_NMAX,
    slots: torch.Tensor | None = None,
    out: LookupDraft | None = None,
    block: int = DEFAULT_BLOCK,
) -> LookupDraft:
    """Draft ``num_draft`` tokens per request from its own history, in one launch for the whole batch.

    history: [num_slots, width] int32/int64 token buffer (vLLM's ``all_token_ids``), rows indexed by slot.
    lengths: [num_slots] number of valid tokens per slot (clamped to [0, width]).
    slots: [batch] slot of each batch entry (default: slot b for entry b); a slot outside
        [0, num_slots) marks a padded entry and yields no draft.
    out: preallocated outputs (fixed addresses for CUDA graphs); written in place and returned.
    """
    _check_params(num_draft, nmin, nmax)
    _check_block(block)
    if history.dim() != 2 or history.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"history must be a 2-D int32/int64 tensor, got {history.dtype} {tuple(history.shape)}")
    if history.stride(1) != 1:
        raise ValueError("history rows must be contiguous")
    num_slots, width = history.shape
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
    if batch == 0:
        return out
    _lookup_kernel[(batch,)](
        history,
        history.stride(0),
        width,
        lengths,
        slots,
        num_slots,
        out.tokens,
        out.num_valid,
        out.match_len,
        NMIN=nmin,
        NMAX=nmax,
        NUM_DRAFT=num_draft,
        DRAFT_PAD=triton.next_power_of_2(num_draft),
        BLOCK=block,
        num_warps=8,
    )
    return out
