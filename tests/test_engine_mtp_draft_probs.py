"""qwen_serving.engine.mtp_draft_vocab.StepDraftProbs (qwen3_5-mtp-draft-vocab.patch): the draft head's k draft
passes write their q into one zeroed [batch, k, vocab] buffer a step instead of k zeroed rows that vLLM stacks
after the loop, and the rejection sampler gets the same tensor.

vLLM's side is vLLM 0.28.0's own ``propose`` file, drafting through the same draft-head sampler (the patched
``_sample_draft_tokens`` hands it no step buffer there, so each draft zeroes its own row, as before this change);
the patched side is the patched ``propose``. Both run on the stand-in drafter of tests/helpers/spec_propose.py with
a real ``DraftVocab`` and a 120-of-300 draft vocabulary, the Triton kernels interpreted, the noise drawn from the
same seed: the draft ids, the probabilities handed to the rejection sampler (values, shape, dtype, strides) and
every draft forward's inputs must be the same. Without a draft head vLLM's drafter sampling runs, and propose
keeps its stack.
"""

from __future__ import annotations

import collections
import contextlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen_serving.engine import mtp_draft_inputs, mtp_draft_vocab
from qwen_serving.engine.mtp_draft_vocab import StepDraftProbs
from tests.helpers.spec_propose import (
    VOCAB,
    CountPropose,
    DraftHeadDrafter,
    NoLaunch,
    launches,
    pristine_proposer_module,
    same,
    sampling,
    stub_proposer,
    verify_batch,
)

CASES = {
    # name: (accepted per row, k, temperature, top-k, top-p)
    "k=4, batch 1, top-k and top-p": ([5], 4, [0.8], [20], [0.95]),
    "k=4, batch 1, neither": ([2], 4, [1.0], None, None),
    "k=4, batch 2, a greedy row": ([5, 1], 4, [0.0, 0.7], [20, 300], [1.0, 0.9]),
    "k=4, batch 3 (padded to 4), top-k only": ([5, 2, 1], 4, [0.6, 1.0, 1.3], [5, 300, 12], None),
    "k=3, batch 4, top-p only": ([2, 4, 1, 3], 3, [1.0, 0.5, 0.9, 1.2], None, [0.8, 1.0, 0.5, 0.99]),
    "k=2, batch 5 (padded to 8), mixed": ([3, 1, 2, 3, 2], 2, [0.0, 0.8, 1.0, 0.0, 0.6], [1, 20, 300, 20, 7],
                                          [1.0, 0.9, 0.7, 1.0, 1.0]),
    "k=1, batch 2 (vLLM's early exit)": ([2, 1], 1, [0.9, 1.1], [20, 20], None),
}


def run_propose(module, case, monkeypatch, with_head=True, steps=1, seed=0):
    """``steps`` propose() calls of ``module`` on one proposer; each step's drafts, probabilities and forward inputs."""
    accepted, k, temperature, top_k, top_p = case
    proposer, _ = stub_proposer(True, k, 128)
    proposer.model = DraftHeadDrafter(with_head)
    proposer._enable_probabilistic_draft_probs = True
    proposer.use_fp64_gumbel = False
    monkeypatch.setattr(module, "set_forward_context", lambda *a, **kw: contextlib.nullcontext())
    out = []
    torch.manual_seed(seed)  # the draft noise
    for step in range(steps):
        proposer.model.calls.clear()
        args = verify_batch(accepted, k, 30, 128, seed=11 + step)
        args["sampling_metadata"] = sampling(temperature, top_k, top_p)
        drafts = module.SpecDecodeBaseProposer.propose(proposer, num_speculative_tokens=k, mm_embed_inputs=None,
                                                       slot_mappings=None, **args)
        probs = proposer.take_last_draft_probs()
        # as handed over: the next step's rejection sampler reads them before its propose() runs
        probs = None if probs is None else (probs.clone(), probs.stride(), probs.is_contiguous())
        out.append((drafts, probs, list(proposer.model.calls)))
    return out


def differences(want, got) -> set[str]:
    found = set()
    for step, ((drafts, probs, calls), (want_drafts, want_probs, want_calls)) in enumerate(zip(got, want, strict=True)):
        if not same(drafts, want_drafts):
            found.add(f"step {step}: draft ids")
        if (probs is None) != (want_probs is None) or probs is not None and (
                not same(probs[0], want_probs[0]) or probs[1:] != want_probs[1:] or not probs[2]):
            found.add(f"step {step}: draft probabilities")
        if len(calls) != len(want_calls) or not all(
                same(mine[n], theirs[n]) for mine, theirs in zip(calls, want_calls, strict=True) for n in theirs):
            found.add(f"step {step}: draft forward inputs")
    return found


@pytest.mark.parametrize("case", CASES)
def test_the_step_buffer_equals_vllms_stack(case, monkeypatch):
    """The same drafts, the same [batch, k, vocab] float32 probabilities (contiguous, as vLLM's stack), the same
    forward inputs; and the designed inputs make every draft's q its own (a row written twice would show)."""
    from vllm.v1.spec_decode import llm_base_proposer as patched

    want = run_propose(pristine_proposer_module(), CASES[case], monkeypatch)
    got = run_propose(patched, CASES[case], monkeypatch)
    assert differences(want, got) == set()
    accepted, k = CASES[case][:2]
    probs = got[0][1][0]
    assert probs.shape == (len(accepted), k, VOCAB) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(accepted), k), rtol=0, atol=1e-5)
    if k > 1:
        assert not torch.equal(probs[:, 0], probs[:, 1])


def test_all_greedy_batches_hand_over_no_probabilities(monkeypatch):
    from vllm.v1.spec_decode import llm_base_proposer as patched

    case = ([3, 1], 4, [0.0, 0.0], None, None)
    want = run_propose(pristine_proposer_module(), case, monkeypatch)
    got = run_propose(patched, case, monkeypatch)
    assert got[0][1] is None and want[0][1] is None and same(got[0][0], want[0][0])


@pytest.mark.parametrize("case", ["k=4, batch 2, a greedy row", "k=4, batch 3 (padded to 4), top-k only"])
def test_without_a_draft_head_vllms_sampling_and_stack_stay(case, monkeypatch):
    """The drafter's sample_draft returns None: vLLM's drafter sampling over compute_logits, and propose stacks its
    k rows (no step buffer is allocated)."""
    from vllm.v1.spec_decode import llm_base_proposer as patched

    allocated = []
    monkeypatch.setattr(StepDraftProbs, "next_row", lambda self, *a: allocated.append(a))
    want = run_propose(pristine_proposer_module(), CASES[case], monkeypatch, with_head=False)
    got = run_propose(patched, CASES[case], monkeypatch, with_head=False)
    assert differences(want, got) == set() and allocated == []
    assert got[0][1][0].shape == (len(CASES[case][0]), 4, VOCAB)


class OneRow(StepDraftProbs):
    """Broken: every draft writes row 0."""

    def next_row(self, rows, vocab_size, device):
        row = super().next_row(rows, vocab_size, device)
        return self.buffer[:, 0] if self.written > 1 else row


KEPT: dict = {}


class KeptBuffer(StepDraftProbs):
    """Broken: the buffer kept from step to step, so not zeroed again (the last step's q stays where this one's
    support does not reach)."""

    def next_row(self, rows, vocab_size, device):
        self.buffer = KEPT.setdefault((rows, self.num_drafts, vocab_size), torch.zeros(
            rows, self.num_drafts, vocab_size, dtype=torch.float32, device=device))
        return super().next_row(rows, vocab_size, device)


@pytest.mark.parametrize(("broken", "caught"), [
    (OneRow, {"step 0: draft probabilities", "step 1: draft probabilities"}),
    (KeptBuffer, {"step 1: draft probabilities"}),
])
def test_a_broken_step_buffer_is_caught(broken, caught, monkeypatch):
    from vllm.v1.spec_decode import llm_base_proposer as patched

    case = CASES["k=4, batch 3 (padded to 4), top-k only"]
    KEPT.clear()
    want = run_propose(pristine_proposer_module(), case, monkeypatch, steps=2)
    monkeypatch.setattr(mtp_draft_vocab, "StepDraftProbs", broken)
    got = run_propose(patched, case, monkeypatch, steps=2)
    assert differences(want, got) == caught  # the drafts are the same: only q is wrong


def test_stacked_falls_back_to_vllms_stack():
    """A step whose drafts did not all write the buffer (none did, or some went vLLM's way) gets vLLM's stack."""
    rows = [torch.rand(2, 10) for _ in range(3)]
    untouched = StepDraftProbs(3)
    assert same(untouched.stacked(rows), torch.stack(rows, dim=1).contiguous())
    partly = StepDraftProbs(3)
    mixed = [partly.next_row(2, 10, torch.device("cpu")), *rows[1:]]
    mixed[0].copy_(rows[0])
    assert partly.stacked(mixed) is not partly.buffer and same(partly.stacked(mixed), torch.stack(rows, dim=1))


class CountMemsets(CountPropose):
    """Also the shape of every zeroed allocation outside the drafter."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.zeroed: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.zeros.default and not self.drafter.busy:
            self.zeroed.append(tuple(args[0]))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_a_k4_step_drops_three_memsets_and_the_stack(monkeypatch):
    """k=4, batch 1, with the draft head: vLLM's propose zeroes four [1, vocab] rows and stacks them; the patched
    one zeroes one [1, 4, vocab] buffer. Also gone (mtp-draft-inputs.patch): 3 casts, 9 copies, 1 gather. The
    input kernels' launches are stubbed; the draft kernel runs interpreted on both sides, its interpreter's host
    copies the same on both; the drafter's forward and head GEMM are not counted."""
    from vllm.v1.spec_decode import llm_base_proposer as patched
    from vllm.v1.spec_decode import utils

    monkeypatch.setattr(utils, "eagle_step_slot_mapping_metadata_kernel", NoLaunch())
    monkeypatch.setattr(mtp_draft_inputs, "advance_kernel", NoLaunch())
    builder = SimpleNamespace(build_for_drafting=lambda **kwargs: SimpleNamespace())
    counts, zeroed = {}, {}
    for name, module in (("vllm", pristine_proposer_module()), ("patched", patched)):
        proposer, _ = stub_proposer(True, 4, 128)
        proposer.model = DraftHeadDrafter()
        proposer._enable_probabilistic_draft_probs = True
        proposer.draft_attn_groups = [SimpleNamespace(get_metadata_builder=lambda: builder, layer_names=["mtp.attn"])]
        args = verify_batch([5], 4, 40, 128, seed=11)
        args["sampling_metadata"] = sampling([0.8], [20], [0.95])
        monkeypatch.setattr(module, "set_forward_context", lambda *a, **kw: contextlib.nullcontext())
        with CountMemsets(proposer.model) as mode:
            module.SpecDecodeBaseProposer.propose(proposer, num_speculative_tokens=4, mm_embed_inputs=None,
                                                  slot_mappings=None, **args)
        counts[name] = collections.Counter(launches(mode.ops))
        zeroed[name] = mode.zeroed
    removed, added = counts["vllm"] - counts["patched"], counts["patched"] - counts["vllm"]
    assert removed == {"aten.zeros.default": 3, "aten.stack.default": 1,
                       "aten._to_copy.default": 3, "aten.copy_.default": 9, "aten.index.Tensor": 1}
    assert added == {}
    assert zeroed == {"vllm": [(1, VOCAB)] * 4, "patched": [(1, 4, VOCAB)]}  # the same 4 x 300 floats, one memset


def test_the_patched_propose_routes_through_the_step_buffer():
    patched = Path(os.environ["QS_PATCHED_VLLM"]) / "v1" / "spec_decode" / "llm_base_proposer.py"
    text = patched.read_text()
    assert "step_probs = StepDraftProbs(self.num_speculative_tokens)" in text
    assert text.count(", sampling_metadata, step_probs") == 3  # the hook, the first draft, the loop's drafts
    assert "self._last_draft_probs = step_probs.stacked(draft_probs_list)" in text
    assert "torch.stack(draft_probs_list" not in text  # vLLM's stack is StepDraftProbs.stacked's fallback
