"""The scripted DFlash2 drafter (qwen_serving/checkpoint/scripted_dflash2.py): format, proposals, acceptance dial.

vLLM's own DFlash2 module is built and loaded from the written directory on the CPU and its forward,
candidate head, selector and walk kernel are compared with the reference
(tests/helpers/scripted_dflash2_vllm.py); the dial is then checked by simulating vLLM's rejection
rule against the target's reference rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen_serving.checkpoint import scripted_dflash2 as sd2
from qwen_serving.checkpoint import synth
from qwen_serving.checkpoint.scripted import Design
from qwen_serving.checkpoint.scripted_reference import (
    DEFAULT_SAMPLING,
    GREEDY,
    sampling_probs,
    simulate_step,
)

REPO = Path(__file__).resolve().parents[1]
AGREES = (0.0, 0.5, 0.8, 1.0)
STEPS = 20  # verify steps per simulated generation (one from every active token)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sd2") / "tiny8"
    argv = ["--size", "tiny", "--layers", "8", "--out", str(out), "--seed", "0", "--behaviour", "scripted"]
    assert synth.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def design(target) -> Design:
    return Design.read(target)


@pytest.fixture(scope="module")
def drafters(target) -> dict[float, Path]:
    out = {}
    for q in AGREES:
        path = target.parent / f"dflash2-{q}"
        assert sd2.main([str(target), "--out", str(path), "--agree", str(q), "--seed", "1"]) == 0
        out[q] = path
    return out


@pytest.fixture(scope="module")
def references(drafters, target) -> dict[float, sd2.DraftReference]:
    return {q: sd2.DraftReference(path, target) for q, path in drafters.items()}


# ---------------------------------------------------------------- format and design


def test_config_is_vllms_dflash2_format(drafters, design):
    config = json.loads((drafters[0.5] / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == sd2.LAYERS and config["hidden_size"] == design.hidden
    assert config["vocab_size"] == design.vocab
    dflash = config["dflash_config"]
    assert dflash["block_size"] == 8 and dflash["selector_top_k"] == len(design.active)
    assert dflash["target_layer_ids"] == [0, 1, 3, 5, 7]  # the 64-layer taps spread over 8 layers
    assert dflash["mask_token_id"] not in set(design.active)


def test_target_layers_map_onto_the_depth():
    assert sd2.map_target_layers(64) == list(sd2.REAL_TARGET_LAYERS)
    for layers in (5, 8, 12, 16, 32, 48):
        ids = sd2.map_target_layers(layers)
        assert len(set(ids)) == 5 and ids == sorted(ids) and 0 <= ids[0] and ids[-1] < layers
    with pytest.raises(ValueError, match="--layers 8"):
        sd2.map_target_layers(4)


def test_walk_follows_the_chain_for_the_agreeing_share(references, drafters, design):
    """The reference's walk is f: sigma(t) for the agreeing share q, else a token the target rules
    out after t; and the selector's margin dwarfs the unary spread and any Gumbel noise."""
    for q, ref in references.items():
        follow, margin = ref.follow_map(design.active)
        recorded = sd2.DrafterDesign.read(drafters[q])
        assert follow == recorded.follow
        agreeing = {t for t, f in zip(design.active, follow, strict=True) if f == design.next_in_chain(t)}
        assert agreeing == set(recorded.agreeing)
        assert abs(len(agreeing) / len(design.active) - q) < 0.01
        for t, f in zip(design.active, follow, strict=True):
            if t not in agreeing:
                assert f not in {s for s, _ in design.successors(t)}
        assert margin > 40


# ---------------------------------------------------------------- vLLM's module against the reference


def test_vllm_loads_and_proposes_what_the_reference_says(drafters, references, target, design):
    """vLLM 0.28.0's DFlash2Qwen3ForCausalLM, loaded by its DefaultModelLoader from the directory, run
    forward + candidates + selector + walk kernel on the CPU (scripted_dflash2_vllm.py): the same
    blocks as the reference, at several agree values, for two different contexts, greedy and sampled."""
    anchors = design.active[::37]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])),
           "OMP_NUM_THREADS": "1"}
    script = REPO / "tests" / "helpers" / "scripted_dflash2_vllm.py"
    agrees = (0.5, 1.0)
    outs = {q: drafters[q].parent / f"vllm-blocks-{q}.json" for q in agrees}
    pairs = [str(x) for q in agrees for x in (drafters[q], outs[q])]  # one process: vLLM's import is paid once
    proc = subprocess.run([sys.executable, str(script), str(target), ",".join(map(str, anchors)), *pairs],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for q in agrees:
        result = json.loads(outs[q].read_text())
        assert result["candidates"] == len(design.active)
        expected = {str(a): references[q].block(a) for a in anchors}
        assert result["blocks"] == expected
        assert result["blocks_other_context"] == expected
        # Gumbel-noised walk (probabilistic drafts) at T 0.6 / 1 / 2: the margin keeps it on the same path ...
        assert all(block == expected[a] for a, blocks in result["blocks_sampled"].items() for block in blocks)
        # ... while the same kernel over scores 1000 times flatter does sample (the noise path is live)
        assert sum(block != expected[a] for a, blocks in result["blocks_flattened_scores"].items()
                   for block in blocks) >= len(anchors)
        if q == 1.0:
            assert all(block == design.walk(int(a), 7)[1:] for a, block in result["blocks"].items())


# ---------------------------------------------------------------- the acceptance dial


def _simulate(ref: sd2.DraftReference, design: Design, sampling, steps: int, seed: int) -> list[float]:
    """vLLM's rejection rule on a Markov target (the reference's context-free rows): one generation of
    `steps` verify steps from every active token, each step starting where the previous one's
    emitted token landed; per-position acceptance averaged over all steps."""
    active = design.active
    index = {t: i for i, t in enumerate(active)}
    rows = sampling_probs(ref.target.context_free_logits(active)[:, torch.tensor(active)], sampling)
    follow, _ = ref.follow_map(active)
    gen = torch.Generator().manual_seed(seed)
    accepted = torch.zeros(sd2.DRAFTS, dtype=torch.float64)
    for start in range(len(active)):
        anchor = start
        for _ in range(steps):
            drafts, prev = [], anchor
            for _ in range(sd2.DRAFTS):
                prev = index[follow[prev]]
                drafts.append(prev)
            n_ok, emitted = simulate_step(rows[torch.tensor([anchor, *drafts])], drafts, gen)
            accepted[:n_ok] += 1
            anchor = emitted
    return (accepted / (steps * len(active))).tolist()


@pytest.mark.parametrize("sampling", [GREEDY, DEFAULT_SAMPLING], ids=["greedy", "default"])
def test_acceptance_dial_matches_the_prediction(references, design, sampling):
    prev_first = -1.0
    for q in AGREES:
        ref = references[q]
        predicted = sd2.predicted_acceptance(ref, design.active, sampling, steps=STEPS)
        measured = _simulate(ref, design, sampling, steps=STEPS, seed=7)
        assert max(abs(p - m) for p, m in zip(predicted, measured, strict=True)) < 0.03, (q, predicted, measured)
        assert predicted[0] >= prev_first - 1e-9  # the dial turns acceptance up
        prev_first = predicted[0]
    assert sd2.predicted_acceptance(references[0.0], design.active, GREEDY)[0] == 0.0
    assert sd2.predicted_acceptance(references[1.0], design.active, GREEDY) == pytest.approx([1.0] * sd2.DRAFTS)


# ---------------------------------------------------------------- bad input


def test_bad_target_or_agree_is_a_clear_error(tmp_path, target, capsys):
    random_target = tmp_path / "random"
    assert synth.main(["--size", "tiny", "--out", str(random_target), "--seed", "0"]) == 0
    for argv, message in (
        ([str(random_target)], "synth --behaviour scripted"),
        ([str(tmp_path / "missing")], "not a checkpoint directory"),
        ([str(target), "--agree", "1.5"], "--agree must be in [0, 1]"),
    ):
        full = [*argv, "--out", str(tmp_path / "d"), "--seed", "0"]
        if "--agree" not in full:
            full += ["--agree", "0.5"]
        with pytest.raises(SystemExit):
            sd2.main(full)
        assert message in capsys.readouterr().err
        assert not (tmp_path / "d").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".d.")]  # nothing half-written left
    four = tmp_path / "four-layers"
    assert synth.main(["--size", "tiny", "--out", str(four), "--seed", "0", "--behaviour", "scripted"]) == 0
    with pytest.raises(SystemExit):
        sd2.main([str(four), "--out", str(tmp_path / "d"), "--agree", "0.5", "--seed", "0"])
    assert "--layers 8" in capsys.readouterr().err


# ---------------------------------------------------------------- the GPU check, without a GPU


def _gpu_script():
    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    import scripted_dflash2 as gpu  # noqa: PLC0415
    import scripted_mtp as sm  # noqa: PLC0415

    return gpu, sm


def test_gpu_server_is_the_plan_that_vllm_serve_parses(vllm_cli, drafters):
    from bench import fullbench as fb
    from qwen_serving.plan import Probe

    gpu, _ = _gpu_script()
    cmd = fb.server_command(gpu.config(drafters[0.5], prefix_cache=False), python="py", ckpt=Path("/ckpt"),
                            port=18090, traces=Path("/t"), probe=Probe.detect(REPO))
    ns, ea = vllm_cli.serve(cmd.argv)
    assert ea.speculative_config == {"method": "dflash", "model": str(drafters[0.5]), "num_speculative_tokens": 7}
    assert ea.enable_prefix_caching is False and ea.async_scheduling is False
    assert cmd.env["VLLM_DISABLED_KERNELS"] == "MacheteLinearKernel"


def test_gpu_walk_over_answers_and_prediction(tmp_path, drafters, target, design):
    """The GPU check's expectations on the tiny pair: its --predict child, and the walk over greedy answers (the
    designed chain here) against scripted_mtp's exact greedy walk and the Markov prediction."""
    gpu, sm = _gpu_script()
    prediction = gpu.predict(target, drafters[0.8], "cpu")
    assert prediction["acceptance_per_position"]["greedy"] == pytest.approx(
        sd2.predicted_acceptance(sd2.DraftReference(drafters[0.8], target), design.active, GREEDY))
    successor = {int(t): v for t, v in prediction["greedy_successor"].items()}
    proposal = {int(t): v for t, v in prediction["proposal"].items()}
    assert all(successor[t] == design.next_in_chain(t) for t in design.active)
    firsts = [design.next_in_chain(t) for t in design.active]
    answers = [design.walk(first, 511) for first in firsts]
    walked = gpu.answer_walk_acceptance(answers, proposal, successor, 7)
    assert walked == sm.greedy_walk_acceptance(firsts, successor, proposal, 7, 512)
    # from every start, 512-token answers: the long-generation prediction up to the answers' ends
    assert max(abs(a - b) for a, b in zip(walked["acceptance_per_position"],
                                          prediction["acceptance_per_position"]["greedy"], strict=True)) < 0.03
    # a target that leaves the chain: the drafter's run stops where the answer does
    assert gpu.answer_walk_acceptance([[firsts[0], -5, -6]], proposal, successor, 7)["acceptance_per_position"][0] == 0.0


def test_gpu_judge_passes_the_expected_and_fails_a_wrong_acceptance(drafters, target, design):
    gpu, sm = _gpu_script()
    import smoke_lib  # noqa: PLC0415 (tests/gpu, on the path once scripted_mtp is imported)

    prediction = gpu.predict(target, drafters[0.5], "cpu")
    prompts = [{"ids": [design.active[i]]} for i in (0, 50, 100, 150)]
    traces = [smoke_lib.GreedyTrace(design.walk(p["ids"][-1], sm.MAX_TOKENS)[1:], [0.0] * sm.MAX_TOKENS,
                                    [{}] * sm.MAX_TOKENS) for p in prompts]
    proposal = {int(t): v for t, v in prediction["proposal"].items()}
    successor = {int(t): v for t, v in prediction["greedy_successor"].items()}
    walk = gpu.answer_walk_acceptance([t.token_ids for t in traces], proposal, successor, 7)["acceptance_per_position"]
    for measured, ok in ((walk, True), ([a + 0.05 for a in walk], False)):
        rec = {"prediction": prediction, "measurements": {"greedy": {"spec": {"per_position_acceptance": measured}}}}
        checks = gpu.judge(rec, traces, design, prompts)
        assert checks["greedy answers are the designed chain"]["passed"]
        assert checks["greedy acceptance per position = the drafter's walk over the answers"]["passed"] is ok
    off_chain = [smoke_lib.GreedyTrace([t.token_ids[0], -1, *t.token_ids[2:]], t.chosen, t.top) for t in traces]
    assert not gpu.judge(rec, off_chain, design, prompts)["greedy answers are the designed chain"]["passed"]
