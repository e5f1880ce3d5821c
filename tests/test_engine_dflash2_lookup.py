"""patches/dflash2-lookup.patch and qwen_serving/engine/spec_dflash2_lookup.py: the lookup fused with DFlash2's drafts.

The merge rule against the plain-torch lookup (kernels/lookup.lookup_draft_reference); the point masses through
DFlash2's own draft-logits cache kernel; the weak-match rule's output distribution by chi-square with
tests/helpers/spec_rejection.py's toy chain and rejection rule; and, on the scripted tiny checkpoint, vLLM 0.28.0's
DFlash2 speculator (built on the CPU from the engine config) with the drafts vLLM's own drafter module and walk
kernel propose (tests/helpers/scripted_dflash2_vllm.py), fused by the hook the patched runner builds: the quoting
prompt gets the quoted continuation, the free prompt the drafter's block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen_serving.engine import spec_dflash2_lookup as sdl
from qwen_serving.engine.kernels.lookup import LookupDraft, lookup_draft_reference
from tests.helpers import spec_rejection as sr

REPO = Path(__file__).resolve().parents[1]
K = 7  # DFlash2's drafts per step
PARAMS = sdl.LookupParams(nmin=3, nmax=6, nstrong=5, agree=2)


def _history(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    history = torch.full((len(seqs), width), 9999, dtype=torch.int32)  # junk past each length
    for i, s in enumerate(seqs):
        history[i, : len(s)] = torch.tensor(s, dtype=torch.int32)
    return history, torch.tensor([len(s) for s in seqs], dtype=torch.int32)


def _merge(seqs, drafted, params=PARAMS, decoding=None):
    history, lengths = _history(seqs)
    found = lookup_draft_reference(history, lengths, K, params.nmin, params.nmax)
    drafted = torch.tensor(drafted, dtype=torch.int64)
    decoding = torch.ones(len(seqs), dtype=torch.bool) if decoding is None else torch.tensor(decoding)
    filled = sdl.lookup_positions(drafted, found, params, decoding)
    return found, filled, torch.where(filled, found.tokens, drafted)


# a 5-token match (strong) continuing with 50 51 ...: "1 2 3 4 5 | 50 51 52 53 54 55 56 57 ... 1 2 3 4 5"
STRONG = [1, 2, 3, 4, 5, 50, 51, 52, 53, 54, 55, 56, 57, 8, 1, 2, 3, 4, 5]
# a 3-token match (weak): "9 2 3 4" earlier, "... 7 2 3 4" now; continuation 60 61 62
WEAK = [9, 2, 3, 4, 60, 61, 62, 63, 64, 65, 66, 67, 7, 2, 3, 4]
DRAFTER = [90, 91, 92, 93, 94, 95, 96]


def test_a_strong_match_is_taken_alone():
    found, filled, merged = _merge([STRONG], [DRAFTER])
    assert found.match_len.tolist() == [5] and filled.all()
    assert merged[0].tolist() == [50, 51, 52, 53, 54, 55, 56]


def test_a_weak_match_needs_the_drafter_to_agree_and_leaves_it_the_agreed_positions():
    found, filled, merged = _merge([WEAK, WEAK, WEAK], [DRAFTER, [60, 61, 92, 93, 94, 95, 96], [60, 95, *DRAFTER[2:]]])
    assert found.match_len.tolist() == [3, 3, 3]
    assert merged[0].tolist() == DRAFTER and not filled[0].any()  # no agreement
    assert filled[1].tolist() == [False, False, True, True, True, True, True]  # agreed: filled after the two
    assert merged[1].tolist() == [60, 61, 62, 63, 64, 65, 66]
    assert not filled[2].any()  # one of two agreeing is not agreement


def test_the_drafter_keeps_the_positions_past_the_continuation_and_unmatched_or_prefilling_requests():
    periodic = [7, 1, 2, 1, 2, 1, 2, 1, 2]  # a 6-token match one period back: its continuation is the last 2 tokens
    free = [10, 11, 12, 13, 14, 15, 16, 17]
    found, filled, merged = _merge([periodic, free, STRONG], [DRAFTER] * 3, decoding=[True, True, False])
    assert found.match_len.tolist() == [6, 0, 5] and found.num_valid.tolist() == [2, 0, 7]
    assert merged[0].tolist() == [1, 2, *DRAFTER[2:]]  # the drafter's tail is untouched
    assert merged[1].tolist() == DRAFTER and not filled[1].any()  # nothing matched
    assert merged[2].tolist() == DRAFTER and not filled[2].any()  # still prefilling: nothing sampled this step


def test_parameters_are_checked_with_the_variable_named():
    for params, name in ((sdl.LookupParams(7, 6, 8, 2), "VLLM_DFLASH2_LOOKUP_NMIN=7"),
                         (sdl.LookupParams(6, 65, 8, 2), "VLLM_DFLASH2_LOOKUP_NMAX=65"),
                         (sdl.LookupParams(6, 12, 8, 8), "VLLM_DFLASH2_LOOKUP_AGREE=8")):
        with pytest.raises(ValueError, match=name):
            params.check(K)


def test_the_variables_reach_the_hook_through_vllm_envs(monkeypatch):
    monkeypatch.setenv("VLLM_DFLASH2_LOOKUP_NSTRONG", "11")
    monkeypatch.setenv("VLLM_DFLASH2_LOOKUP_AGREE", "3")
    assert sdl.LookupParams.from_env() == sdl.LookupParams(nmin=6, nmax=12, nstrong=11, agree=3)


# ---------------------------------------------------------------- exactness of the merged proposal


def _weak_step(toy: sr.Toy, n: int, seed: int, point_mass_on_agreed: bool):
    """One verify step of n requests: the drafter samples K=3 drafts from its own chain, the lookup always has a
    weak match continuing the drafter's most likely chain, the merge decides; the rejection rule verifies."""
    gen = torch.Generator().manual_seed(seed)
    drafts, q = toy.propose(torch.full((n,), toy.start), (sr.SAMPLED,) * 3, gen)
    chain = [toy.start]
    for _ in range(3):
        chain.append(int(toy.lookup_map[chain[-1]]))
    tokens = torch.tensor(chain[1:]).repeat(n, 1)
    found = LookupDraft(tokens, torch.full((n,), 3, dtype=torch.int32), torch.full((n,), 2, dtype=torch.int32))
    params = sdl.LookupParams(nmin=2, nmax=4, nstrong=3, agree=2)
    filled = sdl.lookup_positions(drafts, found, params, torch.ones(n, dtype=torch.bool))
    if point_mass_on_agreed:  # the broken variant: the agreed positions report a point mass too
        filled = filled | (filled.any(1, keepdim=True) & (torch.arange(3) < 2))
    drafts = torch.where(filled, tokens, drafts)
    q = torch.where(filled[..., None], torch.nn.functional.one_hot(tokens, toy.vocab).double(), q)
    emitted, count = sr.rejection_step(toy.verify_rows(torch.full((n,), toy.start), drafts), q, drafts, gen)
    return sr.continue_exactly(toy, emitted, count, 4, seed + 1), int(filled.any(1).sum())


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_the_weak_match_rule_reproduces_the_target(temperature):
    toy = sr.Toy.make(5, sr.Sampling(temperature), seed=3)
    # the lookup proposes the drafter's most likely successor: the drafter agrees often
    toy = sr.Toy(toy.target, toy.drafter, toy.drafter.argmax(-1), toy.start)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sequences, fused = _weak_step(toy, 200_000, seed=5, point_mass_on_agreed=False)
        broken, _ = _weak_step(toy, 200_000, seed=5, point_mass_on_agreed=True)
    finally:
        torch.set_num_threads(threads)
    exact = toy.exact_joint(4)
    assert fused > 20_000  # the lookup filled positions in a good share of the steps
    assert sr.chi_square(sequences, toy.vocab, exact).p_value > 1e-3
    assert sr.chi_square(broken, toy.vocab, exact).p_value < 1e-9


# ---------------------------------------------------------------- vLLM's DFlash2 speculator on the scripted checkpoint


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from qwen_serving.checkpoint import scripted_dflash2 as sd2
    from qwen_serving.checkpoint import synth

    root = tmp_path_factory.mktemp("lookup")
    target, drafter = root / "tiny8", root / "dflash2"
    assert synth.main(["--size", "tiny", "--layers", "8", "--out", str(target), "--seed", "0",
                       "--behaviour", "scripted"]) == 0
    # a drafter that never follows the chain: whatever the lookup fills differs from what it would have drafted
    assert sd2.main([str(target), "--out", str(drafter), "--agree", "0.0", "--seed", "1"]) == 0
    return target, drafter


def _vllm_blocks(target: Path, drafter: Path, anchors: list[int]) -> dict[int, list[int]]:
    """The drafter's block after each anchor, from vLLM's own DFlash2 module and walk kernel (a child process)."""
    out = target.parent / "vllm-blocks.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])),
           "OMP_NUM_THREADS": "1"}
    script = REPO / "tests" / "helpers" / "scripted_dflash2_vllm.py"
    proc = subprocess.run([sys.executable, str(script), str(target), str(drafter), str(out), *map(str, anchors)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {int(a): block for a, block in json.loads(out.read_text())["blocks"].items()}


def test_the_patched_hook_quotes_on_a_quoting_prompt_and_keeps_the_drafter_otherwise(scripted, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    from qwen_serving.checkpoint.scripted import Design, free_prompt, quoting_prompt

    target, drafter = scripted
    design = Design.read(target)
    quoting, free = quoting_prompt(design, seed=2), free_prompt(design, seed=2, length=100, horizon=32)
    prompts = [quoting["ids"], free["ids"]]
    blocks = _vllm_blocks(target, drafter, [ids[-1] for ids in prompts])
    config = EngineArgs(model=str(target), language_model_only=True, max_model_len=512, enforce_eager=True,
                        max_num_seqs=2, speculative_config={
                            "method": "dflash", "model": str(drafter), "num_speculative_tokens": K,
                            "draft_sample_method": "probabilistic"}).create_engine_config()
    with set_current_vllm_config(config):
        speculator = init_speculator(config, torch.device("cpu"))
    assert type(speculator).__name__ == sdl.SPECULATOR
    slots = torch.tensor([1, 0], dtype=torch.int32)  # batch entry -> request state: not the identity
    drafts = torch.tensor([blocks[ids[-1]] for ids in prompts])
    speculator.draft_tokens[:2] = drafts
    # the drafter's proposal, cached by DFlash2's own kernel: its K candidates per step, the drafted token among them
    top_k = speculator.selector_top_k
    gen = torch.Generator().manual_seed(0)
    others = [torch.randperm(design.vocab, generator=gen) for _ in range(2 * K)]
    candidates = torch.stack([torch.cat([d.view(1), perm[perm != d][: top_k - 1]])
                              for d, perm in zip(drafts.flatten(), others, strict=True)]).view(2, K, top_k)
    speculator.sample_idx_mapping[: 2 * K] = slots.repeat_interleave(K)
    speculator._selector_scores[:2] = torch.randn(2, K, top_k, generator=gen)
    speculator._cache_draft_logits(candidates, 2 * K)
    before = speculator.draft_logits.clone()

    history = torch.zeros(2, 512, dtype=torch.int32)
    for slot, ids in zip(slots.tolist(), prompts, strict=True):
        history[slot, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    lengths = torch.tensor([len(prompts[1]), len(prompts[0])], dtype=torch.int32)
    req_states = SimpleNamespace(all_token_ids=SimpleNamespace(gpu=history), total_len=SimpleNamespace(gpu=lengths),
                                 draft_tokens=torch.zeros(2, K, dtype=torch.int64))  # the runner's: K wide
    monkeypatch.setenv("VLLM_DFLASH2_LOOKUP", "0")
    assert sdl.attach(speculator, req_states) is None  # LOOKUP=0: the runner keeps no hook
    monkeypatch.setenv("VLLM_DFLASH2_LOOKUP", "1")
    hook = sdl.attach(speculator, req_states)  # what the patched runner builds beside its request states
    assert hook is not None
    fused = hook.fuse(speculator.draft_tokens[:2], slots, torch.tensor([1, 1]))  # and calls after propose

    assert fused[0].tolist() == quoting["continuation"][:K] != drafts[0].tolist()  # the quote, not the drafter
    assert fused[1].tolist() == drafts[1].tolist() == blocks[free["ids"][-1]]  # no match: the drafter's block
    logits = speculator.draft_logits
    quoted_rows = logits[1]  # the quoting prompt's request state
    assert torch.equal(quoted_rows.argmax(-1), fused[0]) and ((quoted_rows == 0).sum(-1) == 1).all()
    assert torch.isinf(quoted_rows).sum(-1).tolist() == [design.vocab - 1] * K  # a point mass on every position
    assert torch.equal(logits[0], before[0])  # the free prompt's proposal untouched
    # next step DFlash2's kernel resets what the cache recorded: no trace of the point mass is left
    speculator._selector_scores[:2] = torch.randn(2, K, top_k, generator=gen)
    speculator._cache_draft_logits(candidates, 2 * K)
    finite = torch.isfinite(logits[1])
    assert finite.sum().item() == K * top_k and torch.equal(finite, torch.isfinite(before[1]))
