"""Sort-free small-k top-k/top-p (Triton, interpreted on CPU) against vLLM 0.28.0's own torch sampler path.

Tie rule: vLLM orders equal logits by whatever its sort returns. On CUDA at the real vocabulary that is a
stable radix sort (equal values by ascending index, so top-p masks the lower index first); on CPU torch's
default sort is stable only up to 16 columns. The kernels implement the stable order; wider CPU comparisons
therefore run vLLM's function with its sort made stable (`stable_vllm`), small ones run it untouched.
Masks must match exactly; probabilities to float32 rounding (atol 1e-6).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from qwen_serving.engine.kernels.topk_topp import (
    apply_top_k_top_p_small_k,
    sample_from_probs,
    sample_top_k_top_p,
    softmax,
    top_k_top_p_probs,
    top_k_top_p_reference,
)

vllm_sampler = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")


def vllm_masked(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    return vllm_sampler.apply_top_k_top_p_pytorch(logits.clone(), k, p)


@pytest.fixture
def stable_vllm(monkeypatch):
    unstable_sort = torch.Tensor.sort

    def stable_sort(self, *args, **kwargs):
        kwargs["stable"] = True
        return unstable_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", stable_sort)
    return vllm_masked


def _compare(logits, k, p, k_max, want_masked, block):
    got_masked = apply_top_k_top_p_small_k(logits.clone(), k, p, k_max, block=block)
    bad = (got_masked.isinf() != want_masked.isinf()).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"mask differs on rows {bad[:10]}"
    assert torch.equal(got_masked, want_masked)  # kept logits untouched
    probs = top_k_top_p_probs(logits, k, p, k_max, block=block)
    torch.testing.assert_close(probs, want_masked.softmax(dim=-1), atol=1e-6, rtol=1e-5)


def test_exhaustive_small_vocab_masks_match_vllm():
    # every vector over 3 levels in a 4-token vocabulary (ties everywhere), each with k in {1, 2} and two p;
    # k_max = 2 takes 3 candidates out of 4, so ties at the k-th value can spill past them
    vectors = torch.tensor(list(itertools.product([0.0, 0.9, 1.8], repeat=4)))
    combos = list(itertools.product([1, 2], [0.35, 0.8]))
    logits = vectors.repeat(len(combos), 1)
    k = torch.tensor([c[0] for c in combos]).repeat_interleave(len(vectors))
    p = torch.tensor([c[1] for c in combos]).repeat_interleave(len(vectors))
    _compare(logits, k, p, 2, vllm_masked(logits, k, p), block=4)


@pytest.mark.parametrize("with_p", [True, False])
def test_random_bf16_logits_match_vllm(stable_vllm, with_p):
    gen = torch.Generator().manual_seed(1)
    rows, vocab = 10, 300
    logits = (torch.randn(rows, vocab, generator=gen) * 2).bfloat16().float()  # bf16 levels: real ties
    logits[3, :250] = float("-inf")  # a grammar mask leaving fewer tokens than k
    logits[4, ::7] = logits[4].max()  # many tokens tied at the top
    k = torch.randint(1, 21, (rows,), generator=gen)
    k[3] = 20
    p = torch.rand(rows, generator=gen) * 0.9 + 0.1 if with_p else None
    if with_p:
        p[0] = 1.0
    _compare(logits, k, p, 20, stable_vllm(logits, k, p), block=64)


def test_reference_is_vllms_rule(stable_vllm):
    # the plain-torch reference (used by the GPU tests, where vLLM may be absent) is vLLM's rule
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(64, 500, generator=gen) * 2).bfloat16().float()
    logits[0] = 0.0
    k = torch.randint(1, 500, (64,), generator=gen)
    p = torch.rand(64, generator=gen)
    for kk, pp in [(k, p), (k, None), (None, p)]:
        assert torch.equal(top_k_top_p_reference(logits, kk, pp), stable_vllm(logits, kk, pp))


def test_ties_beyond_the_candidates(stable_vllm):
    # more tokens tie at the k-th value than k_max + 1 candidates hold: counted and ranked across blocks
    vocab = 200
    flat = torch.zeros(vocab)
    spike = torch.zeros(vocab)
    spike[17] = 3.0
    spike[torch.arange(5, vocab, 4)] = 1.0  # 49 tokens tied at the second value
    logits = torch.stack([flat, flat, spike, spike, spike])
    k = torch.tensor([3, 3, 2, 2, 1])
    p = torch.tensor([0.5, 1.0, 0.9, 0.3, 0.5])
    want = stable_vllm(logits, k, p)
    kept = (~want[0].isinf()).nonzero().flatten()
    assert kept.tolist() == list(range(100, 200))  # uniform row, p = 0.5: the upper half of the indices
    _compare(logits, k, p, 3, want, block=32)
    _compare(logits, k, None, 3, stable_vllm(logits, k, None), block=32)


def _chi_square_critical(df: int, z: float = 3.0902) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_distribution_matches_vllm_probabilities():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 48, generator=gen)
    k = torch.tensor([12, 5])
    p = torch.tensor([0.85, 0.6])
    want = vllm_masked(logits, k, p).softmax(dim=-1)
    probs = top_k_top_p_probs(logits, k, p, 12, block=16)
    torch.manual_seed(0)
    draws = 20000
    for row in range(2):
        tokens = sample_from_probs(probs[row].expand(draws, -1).contiguous())
        counts = torch.bincount(tokens, minlength=48).double()
        support = want[row] > 0
        assert counts[~support].sum() == 0, "sampled a token outside the truncated support"
        expected = want[row][support].double() * draws
        chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
        df = int(support.sum()) - 1
        # fixed seed; threshold: the 0.1% tail of chi-square with df degrees of freedom
        assert df >= 2 and chi2 < _chi_square_critical(df), (chi2, df)


def test_sample_respects_support_and_generators():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 64, generator=gen)
    k = torch.tensor([4, 1, 8])
    p = torch.tensor([0.9, 0.9, 0.5])
    support = ~vllm_masked(logits, k, p).isinf()
    seeded = [sample_top_k_top_p(logits, k, p, 8, {0: torch.Generator().manual_seed(9)}, block=32) for _ in range(2)]
    assert seeded[0][0][0] == seeded[1][0][0]  # a seeded row repeats
    tokens, _ = seeded[0]
    assert support[torch.arange(3), tokens].all()
    assert tokens[1] == logits[1].argmax()


def test_multi_block_softmax():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 1000, generator=gen) * 4
    logits[1, 100:900] = float("-inf")
    torch.testing.assert_close(softmax(logits, block=128), logits.softmax(-1), atol=1e-7, rtol=1e-5)
    half = logits.bfloat16()
    torch.testing.assert_close(softmax(half, block=256), half.float().softmax(-1), atol=1e-7, rtol=1e-5)


def test_bad_inputs_raise():
    logits = torch.zeros(2, 10)
    k = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="float32"):
        apply_top_k_top_p_small_k(logits.bfloat16(), k, None, 2)
    with pytest.raises(ValueError, match="k_max"):
        apply_top_k_top_p_small_k(logits, k, None, 65)
    with pytest.raises(ValueError, match="k must have shape"):
        apply_top_k_top_p_small_k(logits, k[:1], None, 2)
    with pytest.raises(ValueError, match="p must have shape"):
        top_k_top_p_probs(logits, k, torch.ones(3), 2)
