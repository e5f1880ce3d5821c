"""Is sampled output distributed as the scripted checkpoint's weights say? (issue #16 item 5, chi-square)

Every sample is DEPTH tokens after one fixed prompt, at temperature 1, top-k 20, top-p 0.95. There the
target keeps three tokens per context (docs/scripted-model.md), so all the contexts a sample can pass
through form a tree of 1 + 3 + ... + 3^(DEPTH-1) nodes: `support_tree` computes the exact sampling
distribution at every node from the weights (the float32 reference, a batched forward per depth), and
`chi_square` sets the observed next-token counts of each context against them. With MTP k=4 the first
token comes from the prefill and the next five from one verify step (four drafts and the bonus) when all
are accepted, so the draft, accept, reject-and-resample and bonus paths are all inside the tree.

`simulate` draws samples from the same rows with vLLM's rejection rule for greedy drafts (a draft d is
kept with probability p(d); a rejection resamples from p without d, renormalised), or with the rule
broken (resampling from p itself): the broken rule must fail the same test, which shows it has the
power to see a wrong sampler (tests/test_scripted_chisq.py, and the GPU run on the real rows).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

DEPTH = 6
SAMPLING = {"temperature": 1.0, "top_k": 20, "top_p": 0.95}
MIN_EXPECTED = 5.0  # per chi-square cell; smaller cells are pooled
P_VALUE_FLOOR = 0.01  # the bar

Context = tuple[int, ...]
Rows = dict[Context, dict[int, float]]  # context (tokens after the prompt) -> token -> probability


def support_tree(ref, prompt: Sequence[int], depth: int = DEPTH, sampling: Mapping[str, float] = SAMPLING,
                 batch: int = 256) -> tuple[Rows, float]:
    """Exact next-token distributions at every context the sampler can reach within `depth` tokens, and the
    smallest top-p margin among them (how far each kept set is from changing: scripted_reference.nucleus_margin)."""
    import torch

    from qwen_serving.checkpoint.scripted_reference import Sampling, nucleus_margin, sampling_probs

    rule = Sampling(**sampling)
    head = ref.w.linear("lm_head")
    rows: Rows = {}
    margin = math.inf
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


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, statistic/2)."""
    import torch

    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _cells(expected: list[tuple[int, float]]) -> list[list[int]]:
    """Tokens grouped into cells of expected count >= MIN_EXPECTED: the likeliest alone, the rest pooled."""
    cells: list[list[int]] = []
    pooled: list[int] = []
    pooled_e = 0.0
    for token, e in sorted(expected, key=lambda x: -x[1]):
        if e >= MIN_EXPECTED:
            cells.append([token])
        else:
            pooled.append(token)
            pooled_e += e
    if pooled:
        if pooled_e >= MIN_EXPECTED or not cells:
            cells.append(pooled)
        else:
            cells[-1] += pooled
    return cells


def chi_square(samples: Sequence[Sequence[int]], rows: Rows, depth: int = DEPTH) -> dict:
    """Pearson's statistic over every context the samples reached, per depth and in total. A token the
    reference gives probability 0 after its context is counted apart (`outside_support`): one is a failure."""
    reached: dict[Context, Counter] = {}
    for sample in samples:
        for d in range(min(depth, len(sample))):
            reached.setdefault(tuple(sample[:d]), Counter())[int(sample[d])] += 1
    per_depth = {d: {"statistic": 0.0, "df": 0, "tokens": 0, "contexts": 0} for d in range(depth)}
    outside, unknown = 0, 0
    for context, observed in reached.items():
        d = len(context)
        n = sum(observed.values())
        per_depth[d]["tokens"] += n
        row = rows.get(context)
        if row is None:
            unknown += n  # a context outside the tree: only reachable through a token outside the support
            continue
        outside += sum(c for t, c in observed.items() if t not in row)
        cells = _cells([(t, n * p) for t, p in row.items()])
        if len(cells) < 2:
            continue
        per_depth[d]["contexts"] += 1
        per_depth[d]["df"] += len(cells) - 1
        for cell in cells:
            e = n * sum(row[t] for t in cell)
            o = sum(observed.get(t, 0) for t in cell)
            per_depth[d]["statistic"] += (o - e) ** 2 / e
    statistic = sum(v["statistic"] for v in per_depth.values())
    df = sum(v["df"] for v in per_depth.values())
    for v in per_depth.values():
        v["p_value"] = chi2_sf(v["statistic"], v["df"])
    p_value = chi2_sf(statistic, df)
    tokens = sum(v["tokens"] for v in per_depth.values())
    return {"samples": len(samples), "tokens": tokens, "statistic": statistic, "df": df, "p_value": p_value,
            "outside_support": outside, "unknown_context": unknown,
            "per_depth": {str(d): v for d, v in per_depth.items()},
            "passed": tokens > 0 and outside == 0 and unknown == 0 and p_value > P_VALUE_FLOOR}


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
    import random

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


def rows_to_json(rows: Rows) -> list[dict]:
    return [{"context": list(c), "probs": {str(t): p for t, p in row.items()}} for c, row in rows.items()]


def rows_from_json(data: list[dict]) -> Rows:
    return {tuple(item["context"]): {int(t): p for t, p in item["probs"].items()} for item in data}
