"""bench/scripted_chisq.py on the tiny scripted checkpoint: the exact support tree, the chi-square test
passing on samples drawn by vLLM's rejection rule (MTP on and off) and failing on a broken rule."""

from __future__ import annotations

import pytest
import torch

from bench import scripted_chisq as sc
from qwen_serving.checkpoint import scripted, synth
from qwen_serving.checkpoint.scripted_reference import Reference

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
    rows, margin = sc.support_tree(ref, prompt)
    torch.set_num_threads(threads)
    return design, prompt, ref, rows, margin


def test_support_tree_is_the_reference_at_every_node(tree):
    design, prompt, ref, rows, margin = tree
    assert len(rows) == sum(3**d for d in range(sc.DEPTH))  # three kept tokens per context
    assert margin > 0.01
    context = next(c for c in rows if len(c) == 3)
    logits = ref.logits([*prompt, *context])[-1]
    from qwen_serving.checkpoint.scripted_reference import Sampling, sampling_probs

    probs = sampling_probs(logits, Sampling(**sc.SAMPLING))
    assert rows[context] == pytest.approx({int(t): float(probs[t]) for t in torch.nonzero(probs).flatten()})
    assert sum(rows[context].values()) == pytest.approx(1.0)


def test_vllms_rule_passes_and_a_broken_rule_fails(tree):
    design, _prompt, _ref, rows, _margin = tree
    for k in (0, 4):  # MTP off, MTP k=4 with the checkpoint's greedy drafts
        good = sc.chi_square(sc.simulate(rows, design.mtp_proposal, k, SAMPLES, seed=k), rows)
        assert good["tokens"] == SAMPLES * sc.DEPTH
        assert good["passed"], good
    broken = sc.chi_square(sc.simulate(rows, design.mtp_proposal, 4, SAMPLES, seed=9, broken=True), rows)
    assert not broken["passed"] and broken["p_value"] < 1e-6


def test_a_token_outside_the_support_fails(tree):
    design, _prompt, _ref, rows, _margin = tree
    samples = sc.simulate(rows, design.mtp_proposal, 4, 2_000, seed=1)
    outside = next(t for t in design.active if t not in rows[()])
    samples[0] = [outside, *samples[0][1:]]
    result = sc.chi_square(samples, rows)
    assert not result["passed"] and result["outside_support"] == 1 and result["unknown_context"] == 5


def test_rows_round_trip_through_json(tree):
    rows = tree[3]
    assert sc.rows_from_json(sc.rows_to_json(rows)) == rows
