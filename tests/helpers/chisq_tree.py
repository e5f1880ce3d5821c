"""The tiny scripted checkpoint's whole sampling tree after one prompt, and samples drawn from it by vLLM's
rejection rule for greedy drafts (or a broken rule): the instruments of tests/test_scripted_chisq.py."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from bench.scripted_chisq import SAMPLING

DEPTH = 6  # tokens per sample: the prefill's token, a k=4 verify step's drafts and bonus
Context = tuple[int, ...]
Rows = dict[Context, dict[int, float]]  # context (tokens after the prompt) -> token -> probability


def support_tree(ref, prompt: Sequence[int], depth: int = DEPTH, sampling: Mapping[str, float] = SAMPLING,
                 batch: int = 256) -> tuple[Rows, float]:
    """Exact next-token distributions at every context the sampler can reach within `depth` tokens (three kept
    tokens per context), and the smallest top-p margin among them (scripted_reference.nucleus_margin)."""
    import torch

    from qwen_serving.checkpoint.scripted_reference import Sampling, nucleus_margin, sampling_probs

    rule = Sampling(**sampling)
    head = ref.w.linear("lm_head")
    rows: Rows = {}
    margin = float("inf")
    frontier: list[Context] = [()]
    for level in range(depth):
        nxt: list[Context] = []
        for start in range(0, len(frontier), batch):
            chunk = frontier[start : start + batch]
            hidden = ref.hidden_batch([[*prompt, *c] for c in chunk])[:, -1]
            logits = hidden @ head.T
            margin = min(margin, nucleus_margin(logits, rule))
            probs = sampling_probs(logits, rule)
            for context, row in zip(chunk, probs, strict=True):
                kept = torch.nonzero(row).flatten().tolist()
                rows[context] = {int(t): float(row[t]) for t in kept}
                if level + 1 < depth:
                    nxt += [(*context, int(t)) for t in kept]
            del hidden, logits, probs
        frontier = nxt
    return rows, margin


def _draw(row: Mapping[int, float], uniform: float) -> int:
    acc = 0.0
    for token, p in row.items():
        acc += p
        if uniform < acc:
            return token
    return next(reversed(row))  # rounding: the last kept token


def simulate(rows: Rows, proposal: Callable[[int], int], k: int, n: int, seed: int, *, broken: bool = False,
             depth: int = DEPTH) -> list[list[int]]:
    """n samples of `depth` tokens by vLLM's verify steps with greedy drafts d_j = proposal(d_(j-1)) from the
    last emitted token: each draft kept with probability p(d), the first rejection resampled from p without d
    (broken: from p, the draft included), a fully kept chain followed by a bonus token from p."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = [_draw(rows[()], rnd.random())]  # the prefill's token
        while len(tokens) < depth:
            draft = tokens[-1]
            for _ in range(k):
                draft = proposal(draft)
                row = rows[tuple(tokens)]
                if rnd.random() < row.get(draft, 0.0):
                    tokens.append(draft)
                else:
                    residual = row if broken else {t: p for t, p in row.items() if t != draft}
                    total = sum(residual.values())
                    tokens.append(_draw({t: p / total for t, p in residual.items()}, rnd.random()))
                    break
                if len(tokens) == depth:
                    break
            else:
                if len(tokens) < depth:
                    tokens.append(_draw(rows[tuple(tokens)], rnd.random()))  # the bonus token
        out.append(tokens[:depth])
    return out
