"""Probabilistic MTP drafts sampled in the draft vocabulary's own index space, in one kernel after a small top-k.

With a draft head (qwen_serving.engine.mtp_draft_vocab) the draft logits have K columns (a few thousand to 40k),
not the 248k of the full vocabulary. vLLM's path scatters them into a -inf row of the full vocabulary, then
samples that row with a dozen full-width operations per draft (temperature, top-k/top-p, softmax, exponential
noise, a clone, argmax): on an H200 at C1 the step then waits on the host (bench/README.md, the visit-9 profile).

Here a draft is drawn from the `C` largest draft logits (C = min(the request's top-k, MAX_CANDIDATES)), then
top-p over them, at the request's temperature: the proposal q is that truncated softmax, written into a zeroed
full-vocabulary row at the candidates' token ids, and the draft is the exponential race over the same q
(argmax q / Exp(1)), so the probabilities the rejection sampler reads are exactly the ones sampled from. Any q
keeps speculative decoding exact; this one only spares candidates the target's own top-k would never accept.
Greedy rows (temperature below vLLM's epsilon) take the largest logit, as vLLM's drafter does.

Operations per draft: torch.topk over the K columns, a memset of the probability row (none when the caller hands
over a row it zeroed, mtp_draft_vocab.StepDraftProbs), the noise (the caller's: mtp_seeded_drafts), one kernel (a
request without top-k or top-p adds none: the kernel skips that cut).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CANDIDATES = 64  # the spec's top-k is 20; a larger top-k drafts from the 64 most likely tokens
SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


def candidates(width: int) -> int:
    """C, the candidates a row draws from (and the noise columns it needs) for ``width`` draft logits."""
    return min(MAX_CANDIDATES, width)


@triton.jit
def _draft_sample_kernel(
    vals_ptr,  # [rows, C] descending draft logits
    cand_ptr,  # [rows, C] their columns in the draft vocabulary
    noise_ptr,  # [rows, C] Exp(1) draws
    temp_ptr,  # [rows] float32
    k_ptr,  # [rows] top-k (read when HAS_K)
    p_ptr,  # [rows] float32 top-p (read when HAS_P)
    ids_ptr,  # [K] int64 token id of each draft column
    probs_ptr,  # [rows, vocab] float32, zeroed
    probs_stride,
    tokens_ptr,  # [rows] int64
    C: tl.constexpr,
    C_PAD: tl.constexpr,
    EPS: tl.constexpr,
    HAS_K: tl.constexpr,
    HAS_P: tl.constexpr,
):
    r = tl.program_id(0)
    j = tl.arange(0, C_PAD)
    in_c = j < C
    x = tl.load(vals_ptr + r * C + j, mask=in_c, other=float("-inf")).to(tl.float32)
    t = tl.load(temp_ptr + r)
    greedy = t < EPS
    x = x / tl.where(greedy, 1.0, t)
    keep = in_c
    if HAS_K:
        keep = keep & (j < tl.minimum(tl.maximum(tl.load(k_ptr + r).to(tl.int32), 1), C))
    e = tl.where(keep, tl.exp(x - tl.max(tl.where(keep, x, float("-inf")), axis=0)), 0.0)
    prob = e / tl.sum(e, axis=0)
    # top-p over the descending candidates: keep a candidate while the mass before it is below p (the first always)
    if HAS_P:
        before = tl.cumsum(prob, axis=0) - prob
        keep = keep & ((before < tl.load(p_ptr + r)) | (j == 0))
        e = tl.where(keep, e, 0.0)
        prob = e / tl.sum(e, axis=0)
    noise = tl.load(noise_ptr + r * C + j, mask=in_c, other=1.0)
    race = tl.where(keep, prob / noise, -1.0)
    winner = tl.where(greedy, 0, tl.argmax(race, axis=0))
    col = tl.load(cand_ptr + r * C + j, mask=in_c, other=0)
    token_ids = tl.load(ids_ptr + col, mask=in_c, other=0)
    tl.store(probs_ptr + r.to(tl.int64) * probs_stride + token_ids, prob, mask=keep)
    tl.store(tokens_ptr + r, tl.sum(tl.where(j == winner, token_ids, 0), axis=0))


def sample_draft(
    logits: torch.Tensor,
    ids: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    noise: torch.Tensor,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft token ids of the full vocabulary [rows] int64, q [rows, vocab_size] float32) from draft-vocabulary
    logits [rows, K] (ids: the token id of each column). noise: [rows, candidates(K)] Exp(1) draws (a seeded
    request's from its own generator: mtp_seeded_drafts.exponential_).
    out: a zeroed [rows, vocab_size] float32 with unit column stride to write q into (a fresh one if None)."""
    rows, width = logits.shape
    c = candidates(width)  # known on the host: no device read
    vals, cand = torch.topk(logits, c, dim=1)
    probs = torch.zeros(rows, vocab_size, dtype=torch.float32, device=logits.device) if out is None else out
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    temperature = temperature.float()  # no copy when it is float32 already, as vLLM's is
    _draft_sample_kernel[(rows,)](  # an absent top-k / top-p passes a pointer the kernel never reads
        vals, cand, noise, temperature, temperature if top_k is None else top_k,
        temperature if top_p is None else top_p.float(), ids, probs, probs.stride(0), tokens,
        C=c, C_PAD=max(16, triton.next_power_of_2(c)), EPS=SAMPLING_EPS, HAS_K=top_k is not None, HAS_P=top_p is not None,
    )
    return tokens, probs


def sample_draft_reference(
    logits: torch.Tensor,
    ids: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same draw in plain torch, row by row: the definition the kernel is tested against."""
    rows, width = logits.shape
    c = candidates(width)
    probs = torch.zeros(rows, vocab_size, dtype=torch.float32)
    tokens = torch.empty(rows, dtype=torch.int64)
    for r in range(rows):
        vals, cand = torch.topk(logits[r].float(), c)
        t = float(temperature[r])
        greedy = t < SAMPLING_EPS
        k = c if top_k is None else max(1, min(int(top_k[r]), c))
        q = torch.softmax(vals[:k] / (1.0 if greedy else t), dim=0)
        if top_p is not None:  # the mass before a kept candidate is below p; the largest is always kept
            kept = max(1, int((torch.cumsum(q, 0) - q < float(top_p[r])).sum()))
            q = q[:kept] / q[:kept].sum()
        winner = 0 if greedy else int(torch.argmax(q / noise[r, : len(q)]))
        probs[r, ids[cand[: len(q)]]] = q
        tokens[r] = ids[cand[winner]]
    return tokens, probs
