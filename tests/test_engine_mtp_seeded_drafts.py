"""qwen_serving.engine.mtp_seeded_drafts (mtp-seeded-drafts.patch, and the draft head's sampler): a seeded
request's probabilistic drafts draw their Exp(1) noise from its own generator, so two runs of it draft the same
tokens with the same probabilities whatever the global RNG did in between; rows without a seed draw exactly what
vLLM 0.28.0 drew; the noise stays Exp(1), independent across rows and drafts.

End to end: the patched ``propose`` (k = 4) on the stand-in drafter of tests/helpers/spec_propose.py, through the
draft head's sampler (a real ``DraftVocab``, the Triton kernel interpreted) and through vLLM's full-vocabulary
``compute_probs_and_sample_next_token``; and vLLM 0.28.0's own sampler, which the first test shows ignoring the seed.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen_serving.engine.kernels.draft_sample import candidates, sample_draft
from qwen_serving.engine.mtp_seeded_drafts import drafting_metadata, exponential_
from tests.helpers.spec_propose import (
    VOCAB,
    CountOps,
    DraftHeadDrafter,
    pristine_proposer_module,
    sampling,
    stub_proposer,
    verify_batch,
)

SEEDS = {0: 1234, 2: 99}  # batch row -> the request's seed; row 1 has none


def generators(seeds: dict[int, int]) -> dict[int, torch.Generator]:
    """Fresh generators, as vLLM makes them for a request with a seed (the rows of ``seeds``)."""
    return {row: torch.Generator().manual_seed(seed) for row, seed in seeds.items()}


def metadata(temperature, seeds: dict[int, int], top_k=None, top_p=None):
    """vLLM's own SamplingMetadata (the runner's; dataclasses.replace must work on it)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    t = torch.tensor(temperature, dtype=torch.float32)
    rows = t.shape[0]
    return SamplingMetadata(
        temperature=t, all_greedy=bool((t == 0).all()), all_random=not bool((t == 0).any()),
        top_p=None if top_p is None else torch.tensor(top_p), top_k=None if top_k is None else torch.tensor(top_k),
        generators=generators(seeds), max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows), output_token_ids=[], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(), top_k_max=None if top_k is None else max(top_k))


def logits(rows: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 2


# --- the noise ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64: vLLM's use_fp64_gumbel
def test_without_seeds_the_draw_is_vllms(dtype):
    """No seeded row: one exponential_ over the whole tensor, bit-identical to vLLM's draw, the global RNG left where
    vLLM's leaves it, no per-row operation and no device read."""
    torch.manual_seed(3)
    want = torch.empty(5, 70, dtype=dtype).exponential_()
    state = torch.get_rng_state()
    torch.manual_seed(3)
    with CountOps() as ops:
        got = exponential_(torch.empty(5, 70, dtype=dtype), {})
    assert torch.equal(got, want) and torch.equal(torch.get_rng_state(), state)
    assert [op for op in ops.ops if "empty" not in op] == ["aten.exponential_.default"]


def test_a_mixed_batch():
    """Unseeded rows are the global draw's values (as if no row had a seed), seeded rows their generator's next
    draw; the global RNG moves as in vLLM's draw."""
    torch.manual_seed(5)
    plain = torch.empty(4, 64).exponential_()
    state = torch.get_rng_state()
    torch.manual_seed(5)
    noise = exponential_(torch.empty(4, 64), generators({1: 7, 3: 8}))
    assert torch.equal(noise[[0, 2]], plain[[0, 2]]) and torch.equal(torch.get_rng_state(), state)
    for row, seed in ((1, 7), (3, 8)):
        assert torch.equal(noise[row], torch.empty(64).exponential_(generator=torch.Generator().manual_seed(seed)))


def test_a_batch_of_seeded_rows_only_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    noise = exponential_(torch.empty(2, 64), generators({0: 1, 1: 2}))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(noise[1], torch.empty(64).exponential_(generator=torch.Generator().manual_seed(2)))


def test_a_parallel_drafters_rows_of_a_request_come_from_its_generator():
    """rows_per_request consecutive rows a request (a parallel drafter's K drafts): request 1's rows 3..5 are one
    draw of its generator, the other requests' the global draw's."""
    torch.manual_seed(9)
    plain = torch.empty(9, 20).exponential_()
    torch.manual_seed(9)
    noise = exponential_(torch.empty(9, 20), generators({1: 42}), rows_per_request=3)
    assert torch.equal(noise[3:6], torch.empty(3, 20).exponential_(generator=torch.Generator().manual_seed(42)))
    assert torch.equal(noise[:3], plain[:3]) and torch.equal(noise[6:], plain[6:])


def ks_statistic(x: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance between the sample and Exp(1)."""
    x = x.double().flatten().sort().values
    n = x.numel()
    cdf = 1 - torch.exp(-x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max())


def noise_problems(draws: torch.Tensor) -> set[str]:
    """draws: [drafts, rows, columns]. Rows whose draws fail a Kolmogorov-Smirnov test against Exp(1) (critical
    value 1.95/sqrt(n): alpha 0.001), pairs of rows and rows' successive drafts correlated beyond 4/sqrt(n)."""
    drafts, rows, columns = draws.shape
    n = drafts * columns
    found = {f"row {r}: not Exp(1)" for r in range(rows) if ks_statistic(draws[:, r]) >= 1.95 / math.sqrt(n)}
    centred = draws.double() - 1
    for a in range(rows):
        if abs(float((centred[1:, a] * centred[:-1, a]).mean())) >= 4 / math.sqrt(n - columns):
            found.add(f"row {a}: successive drafts correlated")
        for b in range(a + 1, rows):
            if abs(float((centred[:, a] * centred[:, b]).mean())) >= 4 / math.sqrt(n):
                found.add(f"rows {a}, {b}: correlated")
    return found


def test_the_noise_is_exp1_independent_across_rows_and_drafts():
    """400 drafts of a batch of 4, two rows seeded, 64 columns: Exp(1) in every row, no correlation between rows or
    between a row's successive drafts. A generator that restarts every draft, and two rows with one seed, fail."""
    torch.manual_seed(11)
    gens = generators(SEEDS)
    assert noise_problems(torch.stack([exponential_(torch.empty(4, 64), gens) for _ in range(400)])) == set()
    restarted = torch.stack([exponential_(torch.empty(4, 64), generators(SEEDS)) for _ in range(400)])
    assert {"row 0: successive drafts correlated", "row 2: successive drafts correlated"} <= noise_problems(restarted)
    shared = generators({0: 5, 2: 5})
    assert noise_problems(torch.stack([exponential_(torch.empty(4, 64), shared) for _ in range(400)])) == {
        "rows 0, 2: correlated"}


# --- the draft head's sampler ------------------------------------------------------------------------------------


def draft_head_sample(drafter, hidden, meta):
    return drafter.draft_vocab.sample(drafter.draft_head, hidden, meta)


def test_the_draft_heads_sampler_without_seeds_draws_as_before():
    """The draft head's noise for a batch without seeds is the [rows, C] global draw its sampler made before."""
    drafter = DraftHeadDrafter()
    hidden = torch.randn(3, drafter.draft_head.weight.shape[1], generator=torch.Generator().manual_seed(1))
    meta = sampling([0.8, 1.0, 0.6], [20, 300, 5], None)
    torch.manual_seed(4)
    tokens, probs = draft_head_sample(drafter, hidden, meta)
    torch.manual_seed(4)
    draft_logits = drafter.head_gemm(drafter.draft_head, hidden)
    noise = torch.empty(3, candidates(draft_logits.shape[1]), dtype=torch.float32).exponential_()
    want_tokens, want_probs = sample_draft(draft_logits, drafter.draft_vocab.target_ids, VOCAB, meta.temperature,
                                           meta.top_k, meta.top_p, noise)
    assert torch.equal(tokens, want_tokens) and torch.equal(probs, want_probs)


# --- end to end: the patched propose(), and vLLM's own sampler ---------------------------------------------------


def propose(with_head: bool, global_seed: int, steps: int, monkeypatch):
    """``steps`` propose() calls (k = 4, batch 3, rows 0 and 2 seeded, every row at temperature 1 without top-k and
    top-p: vLLM's full-vocabulary sampler takes those too) from one set of the requests' generators, the global RNG
    seeded with ``global_seed``: each step's drafts and draft probabilities."""
    from vllm.v1.spec_decode import llm_base_proposer as patched

    proposer, _ = stub_proposer(True, 4, 128)
    proposer.model = DraftHeadDrafter(with_head)
    proposer._enable_probabilistic_draft_probs = True
    proposer.use_fp64_gumbel = False
    monkeypatch.setattr(patched, "set_forward_context", lambda *a, **kw: contextlib.nullcontext())
    gens = generators(SEEDS)
    torch.manual_seed(global_seed)
    out = []
    for step in range(steps):
        args = verify_batch([5, 2, 3], 4, 30, 128, seed=11 + step)
        args["sampling_metadata"] = sampling([1.0, 1.0, 1.0], None, None, gens)
        drafts = patched.SpecDecodeBaseProposer.propose(proposer, num_speculative_tokens=4, mm_embed_inputs=None,
                                                        slot_mappings=None, **args)
        out.append((drafts, proposer.take_last_draft_probs().clone()))
    return out


@pytest.mark.parametrize("with_head", [True, False], ids=["draft head", "vLLM's full-vocabulary sampler"])
def test_seeded_requests_draft_the_same_every_run(with_head, monkeypatch):
    """Two runs of two propose() steps under different global RNG states: the seeded rows' drafts and draft
    probabilities are the same, the unseeded row's drafts are not."""
    first = propose(with_head, 0, 2, monkeypatch)
    second = propose(with_head, 1, 2, monkeypatch)
    for (drafts, probs), (again, probs_again) in zip(first, second, strict=True):
        assert probs.shape == (3, 4, VOCAB)
        for row in SEEDS:
            assert torch.equal(drafts[row], again[row]) and torch.equal(probs[row], probs_again[row])
        assert not torch.equal(drafts[1], again[1])
    assert not torch.equal(first[0][0], first[1][0])  # the generators moved on between the steps


def test_vllms_own_sampler_ignores_the_seed():
    """vLLM 0.28.0's compute_probs_and_sample_next_token: the same seeded rows drafted under two global RNG states
    differ (the bug); the patched one agrees on them, and on the unseeded rows with vLLM's draw of the same state."""
    from vllm.v1.spec_decode import llm_base_proposer as patched

    stock = pristine_proposer_module()
    x = logits(3, VOCAB, seed=2)
    runs = {}
    for name, module in (("stock", stock), ("patched", patched)):
        for global_seed in (0, 1):
            torch.manual_seed(global_seed)
            runs[name, global_seed] = module.compute_probs_and_sample_next_token(x.clone(), metadata([1.0] * 3, SEEDS))
    assert not all(runs["stock", 0][0][row] == runs["stock", 1][0][row] for row in SEEDS)
    for row in SEEDS:
        assert runs["patched", 0][0][row] == runs["patched", 1][0][row]
    assert runs["patched", 0][0][1] == runs["stock", 0][0][1]
    assert torch.equal(runs["patched", 0][1], runs["stock", 0][1])  # the probabilities: unchanged


def test_vllms_sampler_without_seeds_is_unchanged():
    """A batch without seeds (a greedy row among them): the patched sampler's tokens and probabilities and the
    global RNG after it are vLLM's."""
    from vllm.v1.spec_decode import llm_base_proposer as patched

    x = logits(4, VOCAB, seed=6)
    out = {}
    for name, module in (("stock", pristine_proposer_module()), ("patched", patched)):
        torch.manual_seed(8)
        tokens, probs = module.compute_probs_and_sample_next_token(x.clone(), metadata([1.0, 0.0, 0.7, 1.3], {}))
        out[name] = tokens, probs, torch.get_rng_state()
    assert all(torch.equal(a, b) for a, b in zip(out["stock"], out["patched"], strict=True))


def test_a_parallel_drafter_seeds_its_rows_by_request():
    """_sample_from_logits with K rows a request (parallel drafting): the request's K rows follow its generator."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = type("P", (), {"_enable_probabilistic_draft_probs": True, "use_fp64_gumbel": False})()
    x = logits(6, VOCAB, seed=3)  # 3 requests, 2 drafts each
    runs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        runs.append(SpecDecodeBaseProposer._sample_from_logits(proposer, x.clone(), metadata([1.0] * 3, {1: 5})))
    assert torch.equal(runs[0][0][2:4], runs[1][0][2:4]) and not torch.equal(runs[0][0], runs[1][0])


# --- the runner: partial prefills' drafts leave the generator alone ------------------------------------------------


def test_a_discarded_rows_generator_is_left_out_of_the_drafts():
    meta = metadata([1.0, 1.0, 1.0], SEEDS)
    live = dict(meta.generators)
    drafted = drafting_metadata(meta, np.array([False, False, True]))
    assert set(drafted.generators) == {0} and drafted.generators[0] is live[0]
    assert meta.generators == live  # the input batch's own dict is not touched
    assert all(getattr(drafted, f.name) is getattr(meta, f.name) for f in dataclasses.fields(meta)
               if f.name != "generators")
    assert drafting_metadata(meta, np.array([False, True, False])) is meta  # nothing left out: vLLM's object
    unseeded = metadata([1.0, 1.0], {})
    assert drafting_metadata(unseeded, np.array([True, True])) is unseeded


def test_the_runner_hands_the_drafter_the_filtered_metadata():
    """In the patched GPUModelRunner.propose_draft_token_ids, the first statement that reads sampling_metadata
    replaces it with drafting_metadata's, over this step's discard mask (the module does not import on CPU)."""
    path = Path(os.environ["QS_PATCHED_VLLM"]) / "v1" / "worker" / "gpu_model_runner.py"
    tree = ast.parse(path.read_text())
    method = next(node for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef) and node.name == "propose_draft_token_ids")
    first = next(stmt for stmt in method.body
                 if any(isinstance(n, ast.Name) and n.id == "sampling_metadata" for n in ast.walk(stmt)))
    assert ast.unparse(first) == ("sampling_metadata = drafting_metadata(sampling_metadata, "
                                  "self.discard_request_mask.np[:self.input_batch.num_reqs])")
