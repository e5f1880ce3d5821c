"""vLLM 0.28.0's V2 rejection kernels, compiled on a CUDA GPU, with the lookup's point-mass proposals mixed
with the drafter's: the CPU chi-square (tests/test_spec_rejection_lookup.py) at 10^6 steps per configuration.

    pytest -m gpu tests/gpu/test_spec_rejection_gpu.py        # needs torch, triton and vLLM 0.28.0
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import spec_rejection as sr

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SAMPLES = 1_000_000
LENGTH = 4  # with 3 drafts the bonus token falls inside the window
SAMPLINGS = {
    "T0.6": sr.Sampling(0.6),
    "T1.0": sr.Sampling(1.0),
    "T0.6-topk-topp": sr.Sampling(0.6, top_k=4, top_p=0.9),
    "T1.0-topk-topp": sr.Sampling(1.0, top_k=4, top_p=0.9),
}


def _judge(name: str, drafter: str, lookup_as_drafter: bool = False) -> sr.ChiSquare:
    toy = sr.Toy.make(5, SAMPLINGS[name], seed=3)
    emitted, count = sr.vllm_step(toy, (sr.LOOKUP, drafter, sr.LOOKUP), SAMPLES, seed=4,
                                  temperature=SAMPLINGS[name].temperature, lookup_as_drafter=lookup_as_drafter,
                                  device="cuda")
    sequences = sr.continue_exactly(toy, emitted, count, LENGTH, seed=5)
    return sr.chi_square(sequences, toy.vocab, toy.exact_joint(LENGTH))


@pytest.mark.parametrize("drafter", [sr.GREEDY, sr.SAMPLED])
@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_vllm_kernels_reproduce_the_target(name, drafter):
    result = _judge(name, drafter)
    assert result.outside_support == 0 and result.p_value > 1e-3, result


def test_lookup_positions_reporting_the_drafter_q_fail():
    assert _judge("T1.0", sr.SAMPLED, lookup_as_drafter=True).p_value < 1e-9
