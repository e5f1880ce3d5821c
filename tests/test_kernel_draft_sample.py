"""Drafts sampled in the draft vocabulary's index space (Triton, interpreted on CPU) against the plain-torch
definition beside it: the same tokens for the same noise, the same q to float32 rounding, at several shapes,
temperatures, top-k/top-p settings and greedy rows; and q is the distribution the race draws from."""

from __future__ import annotations

import pytest
import torch

from qwen_serving.engine.kernels.draft_sample import MAX_CANDIDATES, sample_draft, sample_draft_reference

VOCAB = 1000


def _case(rows: int, width: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, width, generator=gen) * 3).to(torch.bfloat16)
    ids = torch.randperm(VOCAB, generator=gen)[:width].sort().values
    temperature = torch.rand(rows, generator=gen) * 1.2 + 0.3
    return gen, logits, ids, temperature


@pytest.mark.parametrize(("rows", "width"), [(1, 37), (4, 300), (5, 900)])
@pytest.mark.parametrize("truncation", ["none", "top_k", "top_k_top_p", "top_p"])
def test_kernel_matches_reference(rows, width, truncation):
    gen, logits, ids, temperature = _case(rows, width, seed=rows * 1000 + width)
    top_k = torch.randint(1, 80, (rows,), generator=gen) if "top_k" in truncation else None
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05 if "top_p" in truncation else None
    temperature[0] = 0.0  # a greedy row in the batch
    noise = torch.empty(rows, min(MAX_CANDIDATES, width)).exponential_(generator=gen)
    tokens, probs = sample_draft(logits, ids, VOCAB, temperature, top_k, top_p, noise)
    want_tokens, want_probs = sample_draft_reference(logits, ids, VOCAB, temperature, top_k, top_p, noise)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(probs, want_probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(probs.sum(1), torch.ones(rows), rtol=0, atol=1e-5)
    assert tokens[0] == ids[logits[0].float().argmax()]  # greedy: the largest draft logit
    support = probs > 0
    assert not support[:, [t for t in range(VOCAB) if t not in set(ids.tolist())]].any()  # only draft tokens
    assert support[torch.arange(rows), tokens].all()  # the draft has mass under q
    if top_k is not None:
        assert (support.sum(1) <= top_k.clamp(max=MAX_CANDIDATES)).all()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    ids = torch.tensor([7, 3, 9, 1])
    one = torch.ones(1)
    for p, kept in ((0.5, {7}), (0.51, {7, 3}), (0.8, {7, 3}), (0.81, {7, 3, 9}), (1.0, {7, 3, 9, 1})):
        _, probs = sample_draft(logits, ids, 10, one, None, torch.tensor([p]), torch.ones(1, 4))
        assert set(probs[0].nonzero().flatten().tolist()) == kept, p


def test_the_race_draws_from_q():
    # 4,000 draws of one row by the plain-torch race follow q (6 sigma at the largest cell), and the kernel draws
    # the reference's very tokens for the first 500 of those noise rows. A kernel whose draw differs from the
    # reference's on a share e of the noise passes that with probability (1 - e)^500: below 4e-11 at e = 0.047,
    # the 6-sigma band a 4,000-row frequency check of the kernel itself would allow (and its draw distribution is
    # within e of q). Each interpreted kernel row costs ~10 ms, the reference's ~0.1 ms.
    gen, logits, ids, temperature = _case(1, 50, seed=7)
    rows, kernel_rows = 4000, 500
    logits, temperature = logits.expand(rows, -1).contiguous(), temperature.expand(rows).contiguous()
    top_k = torch.full((rows,), 5)
    noise = torch.empty(rows, 50).exponential_(generator=gen)
    want_tokens, want_probs = sample_draft_reference(logits, ids, VOCAB, temperature, top_k, None, noise)
    some = slice(0, kernel_rows)
    tokens, probs = sample_draft(logits[some], ids, VOCAB, temperature[some], top_k[some], None, noise[some])
    q = probs[0]
    assert torch.equal(probs, q.expand(kernel_rows, -1))
    torch.testing.assert_close(want_probs, q.expand(rows, -1), rtol=0, atol=1e-6)
    assert torch.equal(tokens, want_tokens[some])
    counts = torch.bincount(want_tokens, minlength=VOCAB).float() / rows
    assert (counts - q).abs().max() < 6 * (0.25 / rows) ** 0.5
    assert set(counts.nonzero().flatten().tolist()) <= set(q.nonzero().flatten().tolist())


def test_q_written_into_a_row_of_a_step_buffer():
    """out=: q lands in that [rows, vocab] row of a [rows, k, vocab] buffer (row stride k * vocab), exactly as in a
    fresh row; the buffer's other rows stay zero."""
    gen, logits, ids, temperature = _case(3, 300, seed=3)
    top_k, top_p = torch.tensor([5, 80, 20]), torch.tensor([0.9, 1.0, 0.6])
    noise = torch.empty(3, MAX_CANDIDATES).exponential_(generator=gen)
    tokens, probs = sample_draft(logits, ids, VOCAB, temperature, top_k, top_p, noise)
    buffer = torch.zeros(3, 4, VOCAB)
    row_tokens, row = sample_draft(logits, ids, VOCAB, temperature, top_k, top_p, noise, out=buffer[:, 2])
    assert row.data_ptr() == buffer[:, 2].data_ptr() and torch.equal(row_tokens, tokens)
    assert torch.equal(buffer[:, 2], probs)
    assert not buffer[:, [0, 1, 3]].any()
