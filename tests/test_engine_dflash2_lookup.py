"""patches/dflash2-lookup.patch and qwen_serving/engine/spec_dflash2_lookup.py: the lookup fused with DFlash2's drafts.

The merge rule against the plain-torch lookup (kernels/lookup.lookup_draft_reference); the point masses through
DFlash2's own draft-logits cache kernel; the weak-match rule's output distribution by chi-square with
tests/helpers/spec_rejection.py's toy chain and rejection rule; and, on the scripted tiny checkpoint, vLLM 0.28.0's
DFlash2 speculator (built on the CPU from the engine config) with the drafts vLLM's own drafter module and walk
kernel propose (tests/helpers/scripted_dflash2_vllm.py), fused by the hook the patched runner builds: the quoting
prompt gets the quoted continuation, the free prompt the drafter's block.

The long verify block (patches/dflash2-verify-block.patch): at num_speculative_tokens 15 the speculator, built from
the drafter's config view, proposes its 7; the hook hands back 15 drafts whose tail is the lookup's continuation
(point masses in the widened draft-logits cache) and the next step's block: long after two saturated copying steps,
held STICKY steps with one request, dropped at once with two; its per-step path converts no tensor to a host value
and waits only on the previous step's flag copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
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
    proc = subprocess.run([sys.executable, str(script), "--blocks-only", str(target), ",".join(map(str, anchors)),
                           str(drafter), str(out)], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
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


# ---------------------------------------------------------------- the long verify block (dflash2-verify-block.patch)

LONG = 15


def _engine_config(drafter: Path, target: Path, k: int, sample: str = "probabilistic", seats: int = 2):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(target), language_model_only=True, max_model_len=512, enforce_eager=True,
                      max_num_seqs=seats, speculative_config={"method": "dflash", "model": str(drafter),
                                                          "num_speculative_tokens": k,
                                                          "draft_sample_method": sample}).create_engine_config()


@pytest.fixture(scope="module")
def long_block(scripted):
    """The runner's config at 15 verify drafts and vLLM's DFlash2 speculator built as the patched runner builds it."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    from qwen_serving.engine import spec_verify_block as svb

    target, drafter = scripted
    config = _engine_config(drafter, target, LONG)
    with set_current_vllm_config(config):
        speculator = init_speculator(svb.drafter_config(config), torch.device("cpu"))
    return config, speculator


def test_the_drafter_is_built_at_its_own_block_while_the_runner_verifies_the_long_one(long_block):
    from vllm.config import replace

    from qwen_serving.engine import spec_verify_block as svb

    config, speculator = long_block
    assert config.num_speculative_tokens == LONG  # what the runner, sampler and rejection sampler are sized by
    assert type(speculator).__name__ == sdl.SPECULATOR
    assert speculator.num_speculative_steps == K and speculator.num_query_per_req == K + 1
    assert tuple(speculator.draft_tokens.shape) == (2, K)
    # load_dflash_model rebuilds the config it builds the drafter from, as here: the drafter's conv block reads
    # 1 + num_speculative_tokens from it, and the runner's shared sub-configs come out as they were
    capture, scheduled = config.compilation_config.cudagraph_capture_sizes, \
        config.scheduler_config.max_num_scheduled_tokens
    view = svb.drafter_config(config)
    rebuilt = replace(view, attention_config=replace(view.attention_config, use_non_causal=True))
    assert rebuilt.speculative_config.num_speculative_tokens == K
    assert config.compilation_config.cudagraph_capture_sizes == capture
    assert config.scheduler_config.max_num_scheduled_tokens == scheduled
    assert svb.decode_query_lens(config, LONG + 1) == [K + 1, LONG + 1]


def test_decode_graphs_are_captured_for_both_block_lengths_and_a_step_replays_its_own(scripted, vllm_world,
                                                                                       monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils

    from qwen_serving.engine import spec_verify_block as svb

    target, drafter = scripted
    config = _engine_config(drafter, target, LONG, seats=4)
    # the sizes vLLM picks on a GPU (1, 2, 4, then multiples of 8), up to 64; enforce_eager on the CPU leaves none
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, *range(8, 65, 8)]
    config.compilation_config.max_cudagraph_capture_size = 64
    monkeypatch.setattr(cudagraph_utils.current_platform, "get_global_graph_pool", lambda: None)  # none on the CPU
    mode = CUDAGraphMode.FULL_AND_PIECEWISE
    with set_current_vllm_config(config):
        runner = cudagraph_utils.CudaGraphManager(config, torch.device("cpu"), mode, decode_query_len=LONG + 1)
        drafter_graphs = cudagraph_utils.CudaGraphManager(svb.drafter_config(config), torch.device("cpu"), mode,
                                                          decode_query_len=K + 1)
    full = {(d.uniform_token_count, d.num_reqs) for d in runner._capture_descs[CUDAGraphMode.FULL]}
    assert full == {(q, n) for q in (K + 1, LONG + 1) for n in range(1, 5)}
    assert {d.uniform_token_count for d in drafter_graphs._capture_descs[CUDAGraphMode.FULL]} == {K + 1}
    runner._graphs_captured = True  # what capture() sets; dispatch only reads the descriptors
    short, long = runner.dispatch(1, K + 1, K + 1, 0), runner.dispatch(2, 2 * (LONG + 1), LONG + 1, 0)
    assert (short.cg_mode, short.num_tokens, short.uniform_token_count) == (CUDAGraphMode.FULL, K + 1, K + 1)
    assert (long.cg_mode, long.num_reqs, long.uniform_token_count) == (CUDAGraphMode.FULL, 2, LONG + 1)


class Copying:
    """One request state's history in a [2, 512] buffer: a random document, then an answer that quotes it from its
    start (each step appends what the step emitted) or writes prose (fresh random tokens)."""

    def __init__(self, history: torch.Tensor, lengths: torch.Tensor, slot: int, vocab: int, seed: int):
        self.gen = np.random.default_rng(seed)
        self.vocab = vocab
        self.doc = self.gen.choice(vocab, 160, replace=False).tolist()  # no repeated n-gram: one match only
        self.history, self.lengths, self.slot = history, lengths, slot
        self.quoted = 30  # the answer quotes the document's first 30 tokens so far
        self._write(self.doc + self.doc[: self.quoted])

    def _write(self, tokens: list[int]) -> None:
        self.history[self.slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        self.lengths[self.slot] = len(tokens)

    def continuation(self, n: int) -> list[int]:
        return self.doc[self.quoted : self.quoted + n]

    def emit(self, copying: bool, n: int) -> None:
        length = int(self.lengths[self.slot])
        tokens = self.history[self.slot, :length].tolist()
        if copying:
            tokens += self.continuation(n)
            self.quoted += n
        else:
            tokens += self.gen.integers(0, self.vocab, n).tolist()
            self.quoted = len(self.doc)  # quoting again needs a new match
        self._write(tokens)


def _hook(long_block, monkeypatch, sticky: int = 3):
    """The hook the patched runner attaches at 15 verify drafts (the speculator's 7-wide cache restored after)."""
    _, speculator = long_block
    monkeypatch.setattr(speculator, "draft_logits", torch.full_like(speculator.draft_logits, float("-inf")))
    speculator._cached_candidate_ids.zero_()
    history, lengths = torch.zeros(2, 512, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    req_states = SimpleNamespace(all_token_ids=SimpleNamespace(gpu=history), total_len=SimpleNamespace(gpu=lengths),
                                 draft_tokens=torch.zeros(2, LONG, dtype=torch.int64))
    monkeypatch.setenv("VLLM_DFLASH2_LOOKUP", "1")
    monkeypatch.setenv("VLLM_DFLASH2_LOOKUP_STICKY", str(sticky))
    hook = sdl.attach(speculator, req_states)
    assert hook is not None and hook.verify_tokens == LONG and hook.num_draft == K
    return hook, history, lengths


def _steps(hook, requests: dict[str, Copying], plan: list[dict[str, bool]], vocab: int, check_tail=True):
    """Run the hook once per step: each request copies (True) or writes prose (False) and emits what the block the
    hook picked the step before allows (all of it while copying, 2 tokens in prose). Returns the blocks picked."""
    gen = torch.Generator().manual_seed(7)
    blocks, block = [], K
    slots = torch.tensor([requests[r].slot for r in requests], dtype=torch.int32)
    for step in plan:
        emitted = {r: block + 1 if step[r] else 2 for r in requests}
        for r, request in requests.items():
            request.emit(step[r], emitted[r])
        drafts = torch.randint(0, vocab, (len(requests), K), generator=gen)
        out = hook.fuse(drafts.clone(), slots, torch.tensor([emitted[r] for r in requests]), list(requests))
        assert tuple(out.shape) == (len(requests), LONG)
        for i, (r, request) in enumerate(requests.items()):
            if check_tail and step[r]:  # a strong match: the lookup proposes every position, the tail included
                assert out[i].tolist() == request.continuation(LONG)
        block = hook.next_block
        blocks.append(block)
    return blocks


def test_the_block_goes_long_in_a_copy_holds_sticky_steps_with_one_request_and_falls_back(
        long_block, scripted, monkeypatch):
    from qwen_serving.checkpoint.scripted import Design

    vocab = Design.read(scripted[0]).vocab
    hook, history, lengths = _hook(long_block, monkeypatch, sticky=3)
    request = Copying(history, lengths, slot=1, vocab=vocab, seed=3)
    blocks = _steps(hook, {"a": request}, [{"a": True}] * 4 + [{"a": False}] * 6, vocab)
    # two saturated steps with a fillable tail, seen one step late: long from the third; the first prose flags land
    # at the sixth call, 3 steps held, then the drafter's block
    assert blocks == [K, K, LONG, LONG, LONG, LONG, LONG, LONG, K, K]
    # the tail's proposals are point masses on the lookup's tokens, in the columns the hook added to the cache
    logits = hook.speculator.draft_logits
    assert tuple(logits.shape[:2]) == (2, LONG)
    assert ((logits[1] == 0).sum(-1) == 1).all() and (torch.isfinite(logits[1]).sum(-1) == 1).all()
    assert torch.isinf(logits[0]).all()  # the other request state untouched


def test_sticky_zero_drops_the_block_as_soon_as_the_prose_flags_land(long_block, scripted, monkeypatch):
    from qwen_serving.checkpoint.scripted import Design

    vocab = Design.read(scripted[0]).vocab
    hook, history, lengths = _hook(long_block, monkeypatch, sticky=0)
    request = Copying(history, lengths, slot=0, vocab=vocab, seed=4)
    assert _steps(hook, {"a": request}, [{"a": True}] * 4 + [{"a": False}] * 3, vocab) == [K, K] + [LONG] * 3 + [K] * 2


def test_two_requests_share_the_block_and_get_no_hold(long_block, scripted, monkeypatch):
    from qwen_serving.checkpoint.scripted import Design

    vocab = Design.read(scripted[0]).vocab
    hook, history, lengths = _hook(long_block, monkeypatch, sticky=3)
    requests = {"a": Copying(history, lengths, slot=1, vocab=vocab, seed=5),
                "b": Copying(history, lengths, slot=0, vocab=vocab, seed=6)}
    requests["b"].emit(False, 3)  # "b" writes prose throughout
    plan = [{"a": True, "b": False}] * 4 + [{"a": False, "b": False}] * 3
    assert _steps(hook, requests, plan, vocab) == [K, K, LONG, LONG, LONG, K, K]


class HostReads(torch.overrides.TorchFunctionMode):
    """Records every torch call that turns a tensor into host values (each synchronises the device on a GPU)."""

    READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero"})

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        to_host = name == "to" and any(isinstance(a, str | torch.device) for a in (*args, *(kwargs or {}).values()))
        if not self.paused and (name in self.READS or to_host):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_the_per_step_path_reads_no_value_of_the_current_step(long_block, scripted, monkeypatch):
    """No tensor becomes a host value inside fuse (on a GPU each would synchronise the device on the step still
    running); the one host wait is on the event of the copy the previous step started."""
    from qwen_serving.checkpoint.scripted import Design
    from qwen_serving.engine import spec_verify_block as svb
    from tests.helpers.event_log import Events

    vocab = Design.read(scripted[0]).vocab
    hook, history, lengths = _hook(long_block, monkeypatch)
    events = Events()
    hook.flags = svb.StaleFlags(2, torch.device("cpu"), new_event=events)
    request = Copying(history, lengths, slot=1, vocab=vocab, seed=8)
    mode = HostReads()
    kernel = sdl.lookup_draft

    def launch(*args, **kwargs):  # a Triton launch: asynchronous on a GPU, host code in the CPU interpreter
        mode.paused = True
        try:
            return kernel(*args, **kwargs)
        finally:
            mode.paused = False

    fuse = hook.fuse

    def watched(*args, **kwargs):  # the hook's call, and nothing the test does around it
        with mode:
            return fuse(*args, **kwargs)

    monkeypatch.setattr(sdl, "lookup_draft", launch)
    monkeypatch.setattr(hook, "fuse", watched)
    blocks = _steps(hook, {"a": request}, [{"a": True}] * 4, vocab, check_tail=False)
    assert mode.reads == []
    assert blocks == [K, K, LONG, LONG]  # the decisions did read the flags: one step late
    assert events.log == [("record", 1), ("wait", 1), ("record", 2), ("wait", 2), ("record", 3), ("wait", 3),
                          ("record", 4)]


def test_a_long_block_without_the_lookup_is_refused_with_what_to_set(long_block, monkeypatch):
    _, speculator = long_block
    req_states = SimpleNamespace(draft_tokens=torch.zeros(2, LONG, dtype=torch.int64))
    monkeypatch.setenv("VLLM_DFLASH2_LOOKUP", "0")
    with pytest.raises(ValueError, match="VLLM_DFLASH2_LOOKUP=1"):
        sdl.attach(speculator, req_states)
