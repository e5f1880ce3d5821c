"""Scripted checkpoints (qwen_serving/checkpoint/scripted.py): format, designed behaviour, the reference.

The reference (scripted_reference.py) computes every distribution from the written tensors; it is
checked against vLLM's own model code (tests/helpers/scripted_vllm_forward.py), then used to check
the design: greedy chain, MTP agreement, draft-vocabulary coverage, acceptance, prompts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen_serving.checkpoint import scripted, steps, synth
from qwen_serving.checkpoint.int4 import negative_scale_share
from qwen_serving.checkpoint.scripted_reference import (
    DEFAULT_SAMPLING,
    GREEDY,
    Reference,
    Sampling,
    markov_acceptance,
    markov_inputs,
    nucleus_margin,
    sampling_probs,
    simulate_step,
    step_acceptance,
)

REPO = Path(__file__).resolve().parents[1]
AGREE = 0.75
COVERAGE = 0.6
CHI_SAMPLING = Sampling(1.0, 20, 0.95)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the reference's recurrence is many small ops: one thread is ~4x faster on 2 shared cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _generate(out: Path, *extra: str) -> Path:
    argv = ["--size", "tiny", "--out", str(out), "--seed", "0", "--behaviour", "scripted", *extra]
    assert synth.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _generate(tmp_path_factory.mktemp("scripted") / "tiny", "--mtp-agree", str(AGREE),
                     "--draft-coverage", str(COVERAGE))


@pytest.fixture(scope="module")
def design(tiny) -> scripted.Design:
    return scripted.Design.read(tiny)


@pytest.fixture(scope="module")
def ref(tiny) -> Reference:
    return Reference(tiny)


@pytest.fixture(scope="module")
def quoting(design) -> dict:
    return scripted.quoting_prompt(design, seed=3, segments=4, segment_len=24, cue_len=6)


# ---------------------------------------------------------------- format


def test_format_is_the_synthetic_one(tiny, tmp_path):
    random = tmp_path / "random"
    assert synth.main(["--size", "tiny", "--out", str(random), "--seed", "0"]) == 0
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny / name).read_bytes() == (random / name).read_bytes(), name
    ours, theirs = dict(synth.iter_checkpoint(tiny)), dict(synth.iter_checkpoint(random))
    assert {n: (t.shape, t.dtype) for n, t in ours.items()} == {n: (t.shape, t.dtype) for n, t in theirs.items()}
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    assert index == json.loads((random / "model.safetensors.index.json").read_text())  # same shards too
    assert json.loads((tiny / "synth.json").read_text())["behaviour"] == "scripted"
    # the body stays synth's: same non-branch int4 bytes, branches scaled, negative scales kept
    body = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight_packed"
    assert torch.equal(ours[body], theirs[body])
    for layer, branch in ((0, "linear_attn.in_proj_z"), (0, "linear_attn.out_proj"), (3, "self_attn.v_proj"),
                          (3, "self_attn.o_proj"), (1, "mlp.up_proj"), (1, "mlp.down_proj")):
        name = f"model.language_model.layers.{layer}.{branch}.weight_scale"
        ratio = ours[name].float().abs().mean() / theirs[name].float().abs().mean()
        assert float(ratio) == pytest.approx(scripted.BRANCH_SCALE**0.5, rel=0.02), name
        assert 0.4 <= negative_scale_share(ours[name]) <= 0.6
    for name in scripted.MTP_ZERO:
        assert not ours[name].any()


def test_branch_scales_stay_fp16_normal_at_full_size():
    """The widest branch matrix of the real shape (MLP down_proj, 17,408 inputs) keeps every group
    scale a normal fp16 number: a scale of 0.01 on one matrix would have put them below 6.1e-5."""
    d = synth.REAL
    down = synth.Int4Linear("model.language_model.layers.1.mlp.down_proj", d.hidden, d.intermediate)
    values = scripted.branch_values(0, down, scripted.BRANCH_SCALE**0.5, torch.device("cpu"))
    scales = values[f"{down.module}.weight_scale"].float().abs()
    assert float(scales.min()) >= torch.finfo(torch.float16).tiny


def test_cli_refuses_bad_dials(tmp_path, capsys):
    for extra, message in (
        (["--mtp-agree", "1.5"], "mtp-agree"),
        (["--draft-coverage", "0.01"], "draft-coverage"),
    ):
        with pytest.raises(SystemExit) as exc:
            _generate(tmp_path / "x", *extra)
        assert exc.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        synth.main(["--size", "tiny", "--out", str(tmp_path / "y"), "--seed", "0", "--mtp-agree", "0.5"])
    assert "need --behaviour scripted" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- the reference against vLLM


def test_reference_matches_vllms_forward(tiny, ref, quoting):
    """vLLM's modules (dequantized int4, torch attention / GDN core: see scripted_vllm_forward.py) in
    float32 against the reference, over a 102-token prompt: logits, final hidden and MTP logits."""
    ids = quoting["ids"]
    out = tiny.parent / "vllm-forward.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])),
           "OMP_NUM_THREADS": "1"}
    script = REPO / "tests" / "helpers" / "scripted_vllm_forward.py"
    proc = subprocess.run([sys.executable, str(script), str(tiny), str(out), *map(str, ids)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    vllm = torch.load(out)
    hidden = ref.hidden(ids)
    logits = hidden @ ref.w.linear("lm_head").T
    assert float((vllm["hidden"] - hidden).abs().max()) < 1e-4
    assert float((vllm["target"] - logits).abs().max()) < 1e-3
    mtp = ref.mtp_step(ids[1:], hidden[:-1], torch.arange(1, len(ids))) @ ref.w.linear("lm_head").T
    assert float((vllm["mtp"] - mtp).abs().max()) < 1e-3
    # the residual branches move the logits by far more than the tolerance: the comparison covers them
    wobble = logits - ref.context_free_logits(ids)
    assert float(wobble[:, scripted_active(ref)].std()) > 0.01


def scripted_active(ref: Reference) -> torch.Tensor:
    return torch.tensor(scripted.Design.read(ref.w.path).active)


# ---------------------------------------------------------------- the designed target


def test_context_free_logits_are_the_designed_table(design, ref):
    logits = ref.context_free_logits(design.active)
    expected = torch.full_like(logits, scripted.INACTIVE_LOGIT)
    expected[:, torch.tensor(design.active)] = scripted.BACKGROUND_LOGIT
    for i, t in enumerate(design.active):
        for succ, logit in design.successors(t):
            expected[i, succ] = logit
    assert float((logits - expected).abs().max()) < 0.1  # bf16 embed / lm_head rounding


def test_greedy_follows_the_chain_and_state_moves_the_logits(design, ref, quoting):
    ids = [*quoting["ids"], *quoting["continuation"]]
    logits = ref.logits(ids)
    assert logits.argmax(-1).tolist() == [design.next_in_chain(t) for t in ids]
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 0.8  # designed gap 1.5, wobble well below it
    # the same token in two contexts: the logits differ (state / KV), the argmax does not
    t = quoting["continuation"][0]
    first = ids.index(t)
    again = len(ids) - 1 - ids[::-1].index(t)
    assert again > first
    assert float((logits[first] - logits[again]).abs().max()) > 1e-3


def test_batched_forward_equals_one_sequence_at_a_time(design, ref, quoting):
    """hidden_batch (the GPU run's chi-square reference over many sampled contexts) is hidden per row."""
    ids = quoting["ids"][:40]
    other = design.walk(design.active[5], 39)
    together = ref.hidden_batch([ids, other])
    for row, seq in zip(together, (ids, other), strict=True):
        assert torch.allclose(row, ref.hidden(seq), atol=1e-5)
    with pytest.raises(ValueError, match="one length"):
        ref.hidden_batch([ids, other[:-1]])


def test_sampling_sets_have_margin(design, ref, quoting):
    logits = ref.logits(quoting["ids"])
    for sampling in (DEFAULT_SAMPLING, CHI_SAMPLING):
        assert nucleus_margin(logits, sampling) > 0.01, sampling
    kept = (sampling_probs(logits, DEFAULT_SAMPLING) > 0).sum(-1)
    assert kept.tolist() == [2] * len(kept)  # chain + first alternative at T 0.6, top-p 0.95
    assert (sampling_probs(logits, CHI_SAMPLING) > 0).sum(-1).tolist() == [3] * len(kept)


# ---------------------------------------------------------------- drafters


def _proposals(ref: Reference, tokens: list[int]) -> list[int]:
    hidden = torch.randn(len(tokens), ref.t["hidden_size"], generator=torch.Generator().manual_seed(1))
    out = ref.mtp_step(tokens, hidden, torch.arange(len(tokens)))
    logits, vocab = ref.draft_logits(out)
    return vocab[logits.argmax(-1)].tolist()


def test_mtp_agreement_dial_bf16_and_after_prepare(tiny, design, ref, quoting, tmp_path):
    chain = [design.next_in_chain(t) for t in design.active]
    proposed = _proposals(ref, design.active)
    agreement = sum(p == c for p, c in zip(proposed, chain, strict=True))
    rest = len(chain) - len(design.core)
    assert agreement == round(AGREE * len(design.core)) + round(AGREE * rest)
    assert proposed == [design.mtp_proposal(t) for t in design.active]
    # the MTP reads the token only: the chained drafts of a real context are the same map
    ids = [*design.walk(design.active[5], 30)]
    drafts = ref.mtp_drafts(ids, 3)
    expected = [design.mtp_proposal(ids[-1])]
    for _ in range(2):
        expected.append(design.mtp_proposal(expected[-1]))
    assert drafts == expected
    # after prepare's int8 steps (MTP linears, lm_head, embedding) the design survives: same
    # proposals, same greedy chain, logits within the int8 rounding
    prepared = tmp_path / "int8"
    shutil.copytree(tiny, prepared)
    for step in ("quant_mtp", "quant_lm_head", "quant_embed"):
        assert steps.run(str(prepared), step) == 0
    int8 = Reference(prepared)
    assert all(int8.w.has(f"{m}.weight_packed") for m in ("mtp.fc", "lm_head", "model.language_model.embed_tokens"))
    assert _proposals(int8, design.active) == proposed
    ids = quoting["ids"]
    logits = int8.logits(ids)
    assert logits.argmax(-1).tolist() == [design.next_in_chain(t) for t in ids]
    bf16 = ref.logits(ids)
    assert float((logits - bf16)[:, torch.tensor(design.active)].abs().max()) < 0.3  # ~1% of |logit| <= 14
    shift = sampling_probs(logits, CHI_SAMPLING) - sampling_probs(bf16, CHI_SAMPLING)
    assert float(shift.abs().max()) < 0.05  # measured 0.022: run the reference on what the engine serves


def test_redial_changes_the_mtp_dial_only_and_equals_synth_at_that_dial(tiny, design, tmp_path):
    high = tmp_path / "high"
    assert scripted.main(["redial", str(tiny), "--mtp-agree", "0.9", "--out", str(high)]) == 0
    fresh = _generate(tmp_path / "fresh", "--mtp-agree", "0.9", "--draft-coverage", str(COVERAGE))
    assert scripted.Design.read(high) == scripted.Design.read(fresh)
    redialled, written = dict(synth.iter_checkpoint(high)), dict(synth.iter_checkpoint(fresh))
    assert redialled.keys() == written.keys()
    assert all(torch.equal(redialled[name], written[name]) for name in written)
    index = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
    assert not torch.equal(redialled["mtp.fc.weight"], dict(synth.iter_checkpoint(tiny))["mtp.fc.weight"])
    for path in tiny.iterdir():  # every file the dial leaves alone is the base's own bytes, linked
        same = path.stat().st_ino == (high / path.name).stat().st_ino
        assert same == (path.name not in {index["mtp.fc.weight"], scripted.DESIGN_FILE, scripted.DRAFT_IDS_FILE,
                                          "synth.json"}), path.name
    assert json.loads((high / "synth.json").read_text())["mtp_agree"] == 0.9
    # the design's target is the base's: the same chain, a higher agreement
    chain = [design.next_in_chain(t) for t in design.active]
    proposed = _proposals(Reference(high), design.active)
    assert sum(p == c for p, c in zip(proposed, chain, strict=True)) > sum(
        design.mtp_proposal(t) == c for t, c in zip(design.active, chain, strict=True))
    # refused: an existing --out, a dial outside [0, 1], a prepared copy as the base (nothing left behind)
    with pytest.raises(SystemExit):
        scripted.main(["redial", str(tiny), "--mtp-agree", "0.9", "--out", str(high)])
    with pytest.raises(SystemExit):
        scripted.main(["redial", str(tiny), "--mtp-agree", "1.5", "--out", str(tmp_path / "bad")])
    prepared = tmp_path / "prepared"
    shutil.copytree(tiny, prepared)
    assert steps.run(str(prepared), "quant_mtp") == 0
    with pytest.raises(SystemExit):
        scripted.main(["redial", str(prepared), "--mtp-agree", "0.9", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_draft_vocabulary_coverage_dial(tiny, design, tmp_path):
    ids = json.loads((tiny / scripted.DRAFT_IDS_FILE).read_text())["ids"]
    assert scripted.draft_coverage(design, ids) == pytest.approx(COVERAGE, abs=1 / len(design.active))
    assert set(design.core) <= set(ids)
    prepared = tmp_path / "drafthead"
    shutil.copytree(tiny, prepared)
    assert steps.run_step(prepared, "draft_vocab", lambda m: steps.build_draft_head(m, ids, "test")) == 0
    ref = Reference(prepared)
    proposed = _proposals(ref, design.active)
    inside = set(ids)
    for t, p in zip(design.active, proposed, strict=True):
        assert p in inside
        full = design.mtp_proposal(t)
        if full in inside:
            assert p == full
        else:  # a miss: the best designed successor of the MTP's source token inside the list
            source = design.mtp_source[design.index[t]]
            assert p == next(s for s, _ in design.successors(source) if s in inside)
    misses = sum(design.next_in_chain(t) not in inside for t in design.active) / len(design.active)
    assert misses == pytest.approx(1 - COVERAGE, abs=1 / len(design.active))


# ---------------------------------------------------------------- acceptance


def test_step_acceptance_matches_a_monte_carlo_of_the_rejection_rule(design, ref, quoting):
    ids = quoting["ids"]
    drafts = ref.mtp_drafts(ids, 4)
    gen = torch.Generator().manual_seed(7)
    for sampling in (DEFAULT_SAMPLING, CHI_SAMPLING):
        predicted = step_acceptance(ref, ids, drafts, sampling)
        rows = sampling_probs(ref.logits([*ids, *drafts])[len(ids) - 1 :], sampling)
        trials = 2000
        accepted = torch.zeros(len(drafts))
        for _ in range(trials):
            n, _token = simulate_step(rows, drafts, gen)
            accepted[:n] += 1
        for p, got in zip(predicted, (accepted / trials).tolist(), strict=True):
            assert abs(got - p) <= 4 * (p * (1 - p) / trials) ** 0.5 + 1e-9, (sampling, predicted, accepted)
    greedy = step_acceptance(ref, ids, drafts, GREEDY)
    agree = [d == design.next_in_chain(prev) for prev, d in zip([ids[-1], *drafts], drafts, strict=False)]
    assert greedy == [float(all(agree[: i + 1])) for i in range(len(drafts))]


def _markov(design: scripted.Design, ref: Reference, sampling: Sampling):
    transition, propose = markov_inputs(ref, design.active, sampling)
    assert propose.tolist() == [design.index.get(design.mtp_proposal(t), -1) for t in design.active]
    return transition, propose


def _simulate(transition: torch.Tensor, propose: torch.Tensor, k: int, steps_run: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    x, accepted = 0, torch.zeros(k)
    for _ in range(steps_run):
        drafts = [int(propose[x])]
        for _ in range(k - 1):
            drafts.append(int(propose[drafts[-1]]))
        n, x = simulate_step(transition[[x, *drafts]], drafts, gen)
        accepted[:n] += 1
    return (accepted / steps_run).tolist()


@pytest.mark.parametrize("sampling", [GREEDY, DEFAULT_SAMPLING], ids=["greedy", "default"])
def test_markov_acceptance_matches_a_simulated_generation(design, ref, sampling):
    """The prediction for a whole generation (step starts where the previous step's emitted token
    lands) against vLLM's rejection rule simulated over 5000 steps of the Markov target."""
    k = 4
    transition, propose = _markov(design, ref, sampling)
    predicted = markov_acceptance(transition, propose, k)
    got = _simulate(transition, propose, k, 5000, seed=11)
    for p, g in zip(predicted, got, strict=True):
        assert abs(g - p) < 0.03, (predicted, got)
    assert all(a > b for a, b in zip(predicted, predicted[1:], strict=False))
    # the dial: an MTP that always agrees, and one that never does
    always = torch.tensor([design.index[c] for c in design.chain])
    assert markov_acceptance(transition, always, 1)[0] > (0.99 if sampling.greedy else 0.85)
    assert markov_acceptance(transition, torch.full_like(propose, -1), 1)[0] == 0.0


# ---------------------------------------------------------------- prompts


def test_quoting_prompt_continues_with_a_quote(design, ref, quoting, tiny):
    ids, continuation = quoting["ids"], quoting["continuation"]
    start, end = quoting["quoted_span"]
    assert ids[start:end] == continuation
    logits = ref.logits([*ids, *continuation[:-1]])
    assert logits[len(ids) - 1 :].argmax(-1).tolist() == continuation
    text = scripted.prompt_text(tiny, ids)
    assert isinstance(text, str) and text


def test_free_prompt_continuation_appears_nowhere_in_it(design, ref):
    prompt = scripted.free_prompt(design, seed=5, length=80, horizon=40)
    ids, continuation = prompt["ids"], prompt["continuation"]
    assert not set(continuation) & set(ids)
    logits = ref.logits([*ids, *continuation[:-1]])
    assert logits[len(ids) - 1 :].argmax(-1).tolist() == continuation
