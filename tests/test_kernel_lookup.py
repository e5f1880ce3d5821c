"""Lookup drafting kernel (Triton, interpreted on CPU) against its plain-torch definition: exact equality."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qwen_serving.engine.kernels.lookup import (
    DEFAULT_BLOCK,
    LookupDraft,
    lookup_chunks,
    lookup_draft,
    lookup_draft_reference,
    lookup_scratch,
)

REPO = Path(__file__).resolve().parents[1]


def _pack(seqs: list[list[int]], width: int | None = None, dtype=torch.int32) -> tuple[torch.Tensor, torch.Tensor]:
    width = width or max(1, max(len(s) for s in seqs))
    history = torch.full((len(seqs), width), 7777, dtype=dtype)  # junk past each length must be ignored
    for i, s in enumerate(seqs):
        history[i, : len(s)] = torch.tensor(s, dtype=dtype)
    return history, torch.tensor([len(s) for s in seqs], dtype=torch.int32)


def _assert_same(got: LookupDraft, want: LookupDraft) -> None:
    assert torch.equal(got.match_len, want.match_len), (got.match_len, want.match_len)
    assert torch.equal(got.num_valid, want.num_valid), (got.num_valid, want.num_valid)
    assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)


def _single(seq: list[int], num_draft: int = 4, nmin: int = 3, nmax: int = 5, block: int = 8) -> tuple:
    history, lengths = _pack([seq])
    got = lookup_draft(history, lengths, num_draft, nmin, nmax, block=block)
    _assert_same(got, lookup_draft_reference(history, lengths, num_draft, nmin, nmax))
    n = int(got.num_valid[0])
    return int(got.match_len[0]), got.tokens[0, :n].tolist()


def test_hand_checked_cases():
    # longest suffix wins over a more recent shorter one: "1 2 3 4 5" occurs at the start, "3 4 5" later
    assert _single([1, 2, 3, 4, 5, 60, 61, 9, 3, 4, 5, 70, 1, 2, 3, 4, 5]) == (5, [60, 61, 9, 3])
    # ties broken by recency: "1 2 3" occurs twice before the suffix, the later one is proposed
    assert _single([1, 2, 3, 40, 41, 1, 2, 3, 50, 51, 1, 2, 3]) == (3, [50, 51, 1, 2])
    # periodic text: the most recent occurrence overlaps the suffix, continuation is one period
    assert _single([9, 8, 1, 2, 1, 2, 1, 2, 1, 2]) == (5, [1, 2])
    assert _single([5] * 8) == (5, [5])
    # no match, and a history too short to hold an earlier occurrence of nmin tokens
    assert _single([1, 2, 3, 4, 5, 6, 7, 8]) == (0, [])
    assert _single([1, 1, 1]) == (0, [])
    # the occurrence starts at position 0 and the continuation is cut by the history's end
    assert _single([1, 2, 3, 9, 1, 2, 3], num_draft=6) == (3, [9, 1, 2, 3])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_histories_batch_equal_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(9):
        length = int(torch.randint(0, 300, (1,), generator=gen))
        vocab = int(torch.randint(2, 6, (1,), generator=gen))  # small vocabularies: many matches and ties
        seqs.append(torch.randint(0, vocab, (length,), generator=gen).tolist())
    seqs.append([3] * 200)  # a single repeated token
    seqs.append(list(range(150)))  # never repeats
    history, lengths = _pack(seqs, width=320)
    for num_draft, nmin, nmax, block in [(4, 2, 5, 16), (7, 6, 12, 64), (1, 1, 1, 32)]:
        got = lookup_draft(history, lengths, num_draft, nmin, nmax, block=block)
        _assert_same(got, lookup_draft_reference(history, lengths, num_draft, nmin, nmax))


def test_block_boundaries_and_copied_text():
    # a document quoted later: matches that straddle block edges, for lengths around multiples of the block
    gen = torch.Generator().manual_seed(5)
    doc = torch.randint(0, 1000, (40,), generator=gen).tolist()
    seqs = []
    for total, quoted in [(31, 6), (32, 7), (33, 9), (40, 12), (64, 15), (65, 20)]:
        prefix = torch.randint(0, 1000, (total - 22 - quoted,), generator=gen).tolist()
        seqs.append(prefix + doc[:20] + [1, 2] + doc[:quoted])
    history, lengths = _pack(seqs)
    for block in (8, 16, 32):
        got = lookup_draft(history, lengths, 5, 6, 12, block=block)
        _assert_same(got, lookup_draft_reference(history, lengths, 5, 6, 12))
    assert got.match_len.tolist() == [6, 7, 9, 12, 12, 12]


def test_padding_slots_int64_history_and_preallocated_out():
    seqs = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 4, 4, 4, 4], [6, 7, 8, 6, 7]]
    history, lengths = _pack(seqs, width=12, dtype=torch.int64)
    lengths[2] = 99  # longer than the row: clamped to the row width (junk tokens are then real history)
    slots = torch.tensor([2, -1, 0, 3, 1], dtype=torch.int32)  # -1 and 3 are padding
    out = LookupDraft(torch.full((5, 3), -5, dtype=torch.int64), torch.full((5,), -5, dtype=torch.int32),
                      torch.full((5,), -5, dtype=torch.int32))
    got = lookup_draft(history, lengths, 3, 2, 4, slots=slots, out=out, block=4)
    assert got.tokens is out.tokens
    _assert_same(got, lookup_draft_reference(history, lengths, 3, 2, 4, slots=slots))
    assert got.num_valid[1] == 0 and got.num_valid[3] == 0 and (got.tokens[[1, 3]] == 0).all()


@pytest.mark.parametrize("block", [16, 128, None])  # None: the default block, wider than every history here
def test_shapes_far_matches_and_near_misses_equal_reference(block):
    gen = torch.Generator().manual_seed(11)
    unique = list(range(1000, 1700))
    seqs = [
        unique[:6] + [1] + unique[6:] + unique[:6],  # the only occurrence is in the oldest block
        unique[:5] + [2] + unique[6:600] + [unique[5]] * 3 + unique[:5] + [unique[5]],  # last token hits, nmin fails
        torch.randint(0, 50_000, (700,), generator=gen).tolist(),  # large vocabulary: nearly every block dies at once
        torch.randint(0, 3, (517,), generator=gen).tolist(),  # tiny vocabulary: every block extends
        unique[:40] + unique[:40] + unique[:40],  # nmax-long matches: the scan stops at the newest block
        [],
    ]
    history, lengths = _pack(seqs, width=730)
    kwargs = {} if block is None else {"block": block}
    for num_draft, nmin, nmax in [(8, 6, 12), (15, 4, 20), (3, 1, 2)]:
        got = lookup_draft(history, lengths, num_draft, nmin, nmax, **kwargs)
        _assert_same(got, lookup_draft_reference(history, lengths, num_draft, nmin, nmax))
    got = lookup_draft(history, lengths, 8, 6, 12, **kwargs)
    assert got.match_len.tolist()[:2] == [6, 0] and got.tokens[0, 0] == 1
    assert got.match_len[4] == 12 and got.tokens[4].tolist() == unique[:8]


def _quoted(quote: list[int], end: int, total: int, tail: list[int], seed: int) -> list[int]:
    """`total` tokens: unique filler with `quote` ending right before position `end`, and `tail` last."""
    gen = torch.Generator().manual_seed(seed)
    filler = (torch.randperm(5000, generator=gen) + 100).tolist()
    seq = filler[: end - len(quote)] + quote + filler[end - len(quote) : total - len(quote) - len(tail)]
    return seq + tail


@pytest.mark.parametrize("block", [1, 2, 8, 32])
def test_matches_straddling_chunk_boundaries(block):
    # the continuation lands just before, at and just after a chunk edge: the occurrence's tokens are in the
    # previous chunk, which the suffix test reads
    quote = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    seqs, conts = [], []
    for edge in (32, 64):
        for shift in (-2, -1, 0, 1, 2):
            conts.append(edge + shift)
            seqs.append(_quoted(quote + [50], edge + shift, 90, quote, seed=edge + shift))
    history, lengths = _pack(seqs, width=97)  # not a multiple of any chunk above 1
    got = lookup_draft(history, lengths, 3, 4, 9, block=block)
    _assert_same(got, lookup_draft_reference(history, lengths, 3, 4, 9))
    assert got.match_len.tolist() == [9] * len(seqs) and (got.tokens[:, 0] == 50).all()


@pytest.mark.parametrize("block", [4, 16])
def test_oldest_chunk_longest_match_and_ties_across_chunks(block):
    a = [11, 12, 13, 14, 15, 16, 17, 18]
    longest_oldest = _quoted(a + [60], 9, 80, [], seed=1)
    for at in (30, 50, 70):  # shorter occurrences in newer chunks, each with a different continuation
        longest_oldest[at - 5 : at + 1] = a[3:] + [61 + at]
    longest_oldest += a
    tie = _quoted(a + [70], 9, 80, [], seed=2)
    for at in (30, 50, 72):  # the same full-length occurrence in several chunks: the most recent one wins
        tie[at - 8 : at + 1] = a + [71 + at]
    tie += a
    history, lengths = _pack([longest_oldest, tie])
    got = lookup_draft(history, lengths, 2, 3, 8, block=block)
    _assert_same(got, lookup_draft_reference(history, lengths, 2, 3, 8))
    assert got.match_len.tolist() == [8, 8] and got.tokens[:, 0].tolist() == [60, 71 + 72]


@pytest.mark.parametrize("block", [1, 8, 64, None])
def test_short_histories_and_random_batches_across_chunk_sizes(block):
    gen = torch.Generator().manual_seed(21)
    seqs = [[], [5], [5, 5], [5, 5, 5], [1, 2, 1, 2, 1]]  # lengths 0 and 1, and shorter than one chunk
    for _ in range(4):
        seqs.append(torch.randint(0, 3, (int(torch.randint(20, 70, (1,), generator=gen)),), generator=gen).tolist())
    history, lengths = _pack(seqs, width=75)
    kwargs = {} if block is None else {"block": block}
    for num_draft, nmin, nmax in [(4, 1, 3), (6, 3, 7)]:
        got = lookup_draft(history, lengths, num_draft, nmin, nmax, **kwargs)
        _assert_same(got, lookup_draft_reference(history, lengths, num_draft, nmin, nmax))
    got = lookup_draft(history, lengths, 4, 1, 3, **kwargs)
    assert got.match_len.tolist()[:5] == [0, 0, 1, 2, 3] and got.num_valid.tolist()[:5] == [0, 0, 1, 1, 2]


def test_preallocated_scratch_is_overwritten_in_place():
    seqs = [[1, 2, 3, 1, 2, 3, 1, 2], [9, 8, 7, 6, 9, 8, 7]]
    history, lengths = _pack(seqs, width=21)
    assert lookup_chunks(21, 4) == 6 and lookup_chunks(21) == 1 and DEFAULT_BLOCK >= 1024
    scratch = lookup_scratch(2, 21, 4).fill_(-1)  # junk from an earlier step must not leak into this one
    got = lookup_draft(history, lengths, 3, 2, 4, block=4, scratch=scratch)
    _assert_same(got, lookup_draft_reference(history, lengths, 3, 2, 4))
    assert (scratch >= 0).all() and (scratch.amax(dim=1) >> 32).tolist() == [4, 3]
    with pytest.raises(ValueError, match="scratch"):
        lookup_draft(history, lengths, 3, 2, 4, block=8, scratch=scratch)


def test_bad_parameters_raise():
    history, lengths = _pack([[1, 2, 3]])
    with pytest.raises(ValueError, match="nmin"):
        lookup_draft(history, lengths, 2, nmin=5, nmax=4)
    with pytest.raises(ValueError, match="num_draft"):
        lookup_draft(history, lengths, 0)
    with pytest.raises(ValueError, match="lengths"):
        lookup_draft(history, lengths[:0], 2)
    with pytest.raises(ValueError, match="int32/int64"):
        lookup_draft(history.float(), lengths, 2)
    for block in (0, 100):
        with pytest.raises(ValueError, match="power of two"):
            lookup_draft(history, lengths, 2, block=block)


def test_out_of_range_slots_and_lengths_do_not_crash():
    # a wild slot or length must neither read outside the buffer nor take the interpreter down
    script = textwrap.dedent(
        """
        import torch
        from qwen_serving.engine.kernels.lookup import lookup_draft
        history = torch.arange(40, dtype=torch.int32).remainder(4).reshape(2, 20)
        lengths = torch.tensor([10**9, -7], dtype=torch.int32)
        slots = torch.tensor([0, 1, 2**30, -2**30], dtype=torch.int32)
        out = lookup_draft(history, lengths, 3, 2, 4, slots=slots, block=8)
        print(out.num_valid.tolist(), out.match_len.tolist(), out.tokens[0].tolist())
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # slot 0 holds 0 1 2 3 0 1 2 3 ... (period 4, length clamped to 20): suffix 0 1 2 3 recurs 4 tokens back
    assert proc.stdout.split("\n")[0] == "[3, 0, 0, 0] [4, 0, 0, 0] [0, 1, 2]"
