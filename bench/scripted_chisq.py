"""Is sampled output distributed as the scripted checkpoint's weights say? (issue #16 item 5, chi-square)

The GPU run samples >= 1e5 tokens at temperature 1, top-k 20, top-p 0.95 as long answers; there the target
keeps three tokens per context (docs/scripted-model.md). `position_rows` computes the exact sampling
distribution before every sampled token from the weights (the float32 reference over the sampled sequences
themselves, batched), and `rank_test` sets the sampled tokens' ranks against the exact probabilities of those
ranks. tests/test_scripted_chisq.py shows the test passing on samples drawn by vLLM's rejection rule, MTP on and
off, and failing on a broken rule (tests/helpers/chisq_tree.py draws them on the tiny checkpoint).
"""


from __future__ import annotations

from collections.abc import Mapping, Sequence

SAMPLING = {"temperature": 1.0, "top_k": 20, "top_p": 0.95}
P_VALUE_FLOOR = 0.01  # the bar


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, statistic/2)."""
    import torch

    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def position_rows(ref, prompts: Sequence[Sequence[int]], samples: Sequence[Sequence[int]],
                  sampling: Mapping[str, float] = SAMPLING, batch: int = 32) -> list[list[dict[int, float]]]:
    """For each sampled sequence (its prompt, then the sampled tokens), the exact sampling distribution before
    each sampled token: one batched reference forward per group of sequences of one total length."""
    import torch

    from qwen_serving.checkpoint.scripted_reference import Sampling, sampling_probs

    rule = Sampling(**sampling)
    head = ref.w.linear("lm_head")
    out: list[list[dict[int, float]] | None] = [None] * len(samples)
    by_length: dict[int, list[int]] = {}
    for i, (prompt, sample) in enumerate(zip(prompts, samples, strict=True)):
        by_length.setdefault(len(prompt) + len(sample), []).append(i)
    for members in by_length.values():
        for start in range(0, len(members), batch):
            chunk = members[start : start + batch]
            seqs = [[*prompts[i], *samples[i][:-1]] for i in chunk]
            hidden = ref.hidden_batch(seqs)
            for row_index, i in enumerate(chunk):
                first = len(prompts[i]) - 1
                probs = sampling_probs(hidden[row_index, first:] @ head.T, rule)
                out[i] = [{int(t): float(p[t]) for t in torch.nonzero(p).flatten().tolist()} for p in probs]
            del hidden
    return out  # type: ignore[return-value]


def rank_test(samples: Sequence[Sequence[int]], rows: Sequence[Sequence[Mapping[int, float]]]) -> dict:
    """Samples whose every position has its own context: each sampled token's rank in its kept set (likeliest
    first) against the exact probabilities of those ranks. X = sum over positions of (one-hot(rank) - p), C = sum of
    (diag(p) - p p^T); X^T C^-1 X over all ranks but the last is chi-square with (ranks - 1) degrees of freedom
    for independent positions with known distributions. A token outside its kept set is counted apart (a failure)."""
    import torch

    ranks = max((len(r) for seq in rows for r in seq), default=0)
    # the sums run over tokens, but a token adds only its row's p: count ranks per row object, then sum in one go
    seen: dict[int, tuple[Mapping[int, float], dict[int, int], int]] = {}  # id(row) -> (row, rank of token, index)
    probs: list[list[float]] = []  # per row, likeliest first
    counts: list[list[int]] = []  # per row, tokens sampled at each rank
    outside = tokens = 0
    for sample, seq_rows in zip(samples, rows, strict=True):
        for token, row in zip(sample, seq_rows, strict=True):
            tokens += 1
            if token not in row:
                outside += 1
                continue
            entry = seen.get(id(row))
            if entry is None:  # the entry holds the row, so its id is not reused while counting
                order = sorted(row, key=lambda t: -row[t])
                entry = seen[id(row)] = (row, {t: r for r, t in enumerate(order)}, len(counts))
                probs.append([row[t] for t in order] + [0.0] * (ranks - len(order)))
                counts.append([0] * ranks)
            counts[entry[2]][entry[1][token]] += 1
    p = torch.tensor(probs, dtype=torch.float64).reshape(len(probs), ranks)
    n = torch.tensor(counts, dtype=torch.float64).reshape(len(counts), ranks)
    weighted = n.sum(1, keepdim=True) * p  # each row's p once per token drawn from it
    observed = n.sum(0)
    x = observed - weighted.sum(0)
    cov = torch.diag(weighted.sum(0)) - p.T @ weighted
    df = max(ranks - 1, 0)
    statistic = float(x[:df] @ torch.linalg.solve(cov[:df, :df], x[:df])) if df else 0.0
    p_value = chi2_sf(statistic, df)
    return {"tokens": tokens, "ranks": ranks, "observed": observed.tolist(), "expected": (observed - x).tolist(),
            "statistic": statistic, "df": df, "p_value": p_value, "outside_support": outside,
            "passed": tokens > 0 and outside == 0 and p_value > P_VALUE_FLOOR}
