"""Rejection sampling with the lookup's point-mass proposals mixed with the drafter's reproduces the target.

Two instruments (tests/helpers/spec_rejection.py): the rule written out in torch, run on 10^6 sequences per
configuration, and vLLM 0.28.0's own V2-runner rejection kernels (rejection_sampler_utils.rejection_sample,
Triton under TRITON_INTERPRET=1, libdevice's log1p stood in for), on 400 one-step samples: the interpreter
costs ~50 ms per request, so 10^6 of them are a GPU run's job.
Both are judged by Pearson's chi-square against the chain's exact joint distribution; broken rules and a
lookup position that reports the drafter's q instead of a point mass must fail the same test.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import spec_rejection as sr

SAMPLES = 1_000_000
VOCAB = 5
LENGTH = 4  # tokens judged per sample: with 3 drafts a step's bonus token falls inside the window
PASS = 1e-3  # deterministic seeds: a correct rule clears it, a broken one lands far below
FAIL = 1e-9
SAMPLINGS = {
    "T0.6": sr.Sampling(0.6),
    "T1.0": sr.Sampling(1.0),
    "T0.6-topk-topp": sr.Sampling(0.6, top_k=4, top_p=0.9),
    "T1.0-topk-topp": sr.Sampling(1.0, top_k=4, top_p=0.9),
}


def _kinds(drafter: str) -> tuple[str, ...]:
    # a lookup position first (a strong match replaces the drafter) and one in the tail past the drafter's block
    return (sr.LOOKUP, drafter, sr.LOOKUP)


def _judge(toy: sr.Toy, sequences: torch.Tensor) -> sr.ChiSquare:
    return sr.chi_square(sequences, toy.vocab, toy.exact_joint(sequences.shape[1]))


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors, two shared cores
    yield
    torch.set_num_threads(threads)


def test_processed_probs_truncates_like_the_sampler():
    probs = sr.processed_probs(torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]), sr.Sampling(1.0, top_k=3, top_p=0.8))
    full = torch.softmax(torch.tensor([3.0, 2.0, 1.0]).double(), -1)
    # top-3 renormalised holds 0.665 / 0.245 / 0.090: the first two reach 0.8 of it, so the nucleus is 2 tokens
    assert torch.allclose(probs[0, :2], full[:2] / full[:2].sum()) and (probs[0, 2:] == 0).all()


@pytest.mark.parametrize("drafter", [sr.GREEDY, sr.SAMPLED])
@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_rule_reproduces_the_target(name, drafter):
    toy = sr.Toy.make(VOCAB, SAMPLINGS[name], seed=1)
    sequences = sr.sample_sequences(toy, _kinds(drafter), SAMPLES, LENGTH, seed=2)
    result = _judge(toy, sequences)
    assert result.outside_support == 0
    assert result.p_value > PASS, result


@pytest.mark.parametrize("broken", [*sr.RULE_BROKEN, "lookup_as_drafter"])
def test_broken_rule_or_proposal_fails(broken):
    toy = sr.Toy.make(VOCAB, SAMPLINGS["T1.0"], seed=1)
    kinds = _kinds(sr.SAMPLED)
    if broken == "lookup_as_drafter":
        sequences = sr.sample_sequences(toy, kinds, SAMPLES, LENGTH, seed=2, lookup_as_drafter=True)
    else:
        sequences = sr.sample_sequences(toy, kinds, SAMPLES, LENGTH, seed=2, broken=broken)
    result = _judge(toy, sequences)
    assert result.p_value < FAIL, result


def test_a_token_outside_the_support_fails():
    toy = sr.Toy.make(VOCAB, SAMPLINGS["T1.0-topk-topp"], seed=1)
    sequences = sr.sample_sequences(toy, _kinds(sr.SAMPLED), 10_000, LENGTH, seed=2)
    outside = int((toy.target[toy.start] == 0).nonzero()[0])
    sequences[0, 0] = outside
    assert _judge(toy, sequences).outside_support == 1



VLLM_SAMPLES = 400  # the interpreter costs ~50 ms per request
VLLM_BROKEN_SAMPLES = 100  # the broken proposal is far off: chi-square ~3 per sample (310 at 100, df 6), whose
# spread there (sd ~35) leaves the p = 1e-9 point (53 at df 6) 7 sd below it
VLLM_LENGTH = 2  # a step's first token, and the second one (a kept draft, or the chain's own draw after it)


@pytest.fixture
def vllm_kernels(monkeypatch):
    sr.interpreter_libdevice(monkeypatch)


@pytest.mark.parametrize("name, lookup_as_drafter", [("T1.0", False), ("T0.6-topk-topp", False), ("T1.0", True)],
                         ids=["T1.0", "T0.6-topk-topp", "broken-lookup-q"])
def test_vllm_rejection_kernels_reproduce_the_target(vllm_kernels, name, lookup_as_drafter):
    """vLLM's kernels with the lookup's positions encoded as point-mass draft logits, and the drafter's sampled."""
    toy = sr.Toy.make(4, SAMPLINGS[name], seed=3)
    samples = VLLM_BROKEN_SAMPLES if lookup_as_drafter else VLLM_SAMPLES
    emitted, count = sr.vllm_step(toy, (sr.LOOKUP, sr.SAMPLED), samples, seed=4,
                                  temperature=SAMPLINGS[name].temperature, lookup_as_drafter=lookup_as_drafter)
    assert ((count >= 1) & (count <= 3)).all()
    result = _judge(toy, sr.continue_exactly(toy, emitted, count, VLLM_LENGTH, seed=5))
    if lookup_as_drafter:
        assert result.p_value < FAIL, result
    else:
        assert result.outside_support == 0 and result.p_value > PASS, result
