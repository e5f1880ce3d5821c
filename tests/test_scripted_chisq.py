"""bench/scripted_chisq.py on the tiny scripted checkpoint: the per-position rank test passing on samples
drawn by vLLM's rejection rule (MTP on and off) and failing on a broken rule or a token outside the support,
and the batched reference rows equal to the exact sampling tree (tests/helpers/chisq_tree.py)."""

from __future__ import annotations

import pytest
import torch

from bench import scripted_chisq as sc
from qwen_serving.checkpoint import scripted, synth
from qwen_serving.checkpoint.scripted_reference import Reference, Sampling, sampling_probs
from tests.helpers import chisq_tree as ct

SAMPLES = 20_000  # 1.2e5 tokens, as the GPU run draws


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops: one thread is faster on 2 shared cores
    out = tmp_path_factory.mktemp("chisq") / "tiny"
    assert synth.main(["--size", "tiny", "--out", str(out), "--seed", "0", "--behaviour", "scripted",
                       "--mtp-agree", "0.75"]) == 0
    design = scripted.Design.read(out)
    prompt = design.walk(design.active[3], 23)
    ref = Reference(out)
    rows, margin = ct.support_tree(ref, prompt)
    torch.set_num_threads(threads)
    return design, prompt, ref, rows, margin


def along(rows, samples):
    """Each sample's rows: the tree's row at every prefix."""
    return [[rows[tuple(s[:d])] for d in range(len(s))] for s in samples]


def test_support_tree_is_the_reference_at_every_node(tree):
    design, prompt, ref, rows, margin = tree
    assert len(rows) == sum(3**d for d in range(ct.DEPTH))  # three kept tokens per context
    assert margin > 0.01
    context = next(c for c in rows if len(c) == 3)
    probs = sampling_probs(ref.logits([*prompt, *context])[-1], Sampling(**sc.SAMPLING))
    assert rows[context] == pytest.approx({int(t): float(probs[t]) for t in torch.nonzero(probs).flatten()})
    assert sum(rows[context].values()) == pytest.approx(1.0)


def test_vllms_rule_passes_and_a_broken_rule_fails(tree):
    design, _prompt, _ref, rows, _margin = tree
    for k in (0, 4):  # MTP off, MTP k=4 with the checkpoint's greedy drafts
        good = ct.simulate(rows, design.mtp_proposal, k, SAMPLES, seed=k)
        result = sc.rank_test(good, along(rows, good))
        assert result["passed"] and result["ranks"] == 3 and result["tokens"] == SAMPLES * ct.DEPTH, result
        assert sum(result["expected"]) == pytest.approx(result["tokens"])
    broken = ct.simulate(rows, design.mtp_proposal, 4, SAMPLES, seed=9, broken=True)
    result = sc.rank_test(broken, along(rows, broken))
    assert not result["passed"] and result["p_value"] < 1e-6


def test_a_token_outside_the_support_fails(tree):
    design, _prompt, _ref, rows, _margin = tree
    samples = ct.simulate(rows, design.mtp_proposal, 4, 2_000, seed=1)
    expected_rows = along(rows, samples)
    outside = next(t for t in design.active if t not in rows[()])
    samples = [[outside, *s[1:]] for s in samples[:10]] + samples[10:]
    result = sc.rank_test(samples, expected_rows)
    assert not result["passed"] and result["outside_support"] == 10


def test_position_rows_are_the_tree_rows(tree):
    design, prompt, ref, rows, _margin = tree
    samples = ct.simulate(rows, design.mtp_proposal, 4, 6, seed=5)
    computed = sc.position_rows(ref, [prompt] * len(samples), samples, batch=4)
    for sample, seq_rows in zip(samples, computed, strict=True):
        for d, row in enumerate(seq_rows):
            assert row == pytest.approx(rows[tuple(sample[:d])], abs=1e-6)  # batch composition: float32 noise
