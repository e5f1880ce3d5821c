"""patches/sampler-small-topk.patch: vLLM's top-k/top-p masking through qwen_serving.engine.kernels.topk_topp.

The patched vLLM (tests/run.sh puts it first on the path) runs on CPU with the kernels interpreted by Triton.
The stock reference is vLLM's own torch masking (``apply_top_k_top_p_pytorch``, or the pristine module with
Triton switched off); its CPU sort is made stable, as on CUDA (see tests/test_kernel_topk_topp.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from qwen_serving.engine import sampler_routing
from tests.helpers.engine_trees import load
from tests.helpers.sampler_rows import designed

VOCAB = 300


@pytest.fixture
def stable_sort(monkeypatch):
    unstable = torch.Tensor.sort

    def stable(self, *args, **kwargs):
        kwargs["stable"] = True
        return unstable(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", stable)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the kernel entry points the routing reaches."""
    calls = []
    for name in ("apply_top_k_top_p_small_k", "top_k_top_p_probs"):
        real = getattr(sampler_routing, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(sampler_routing, name, spy)
    return calls


def batch(rows: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, VOCAB, generator=gen) * 2).bfloat16().float()  # bf16 levels: real ties
    logits[1, ::5] = logits[1].max()  # many tokens tied at the top
    k = torch.randint(1, 21, (rows,), generator=gen)
    p = torch.rand(rows, generator=gen) * 0.8 + 0.15
    return logits, k, p


def stock_mask(logits, k, p):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    return apply_top_k_top_p_pytorch(logits.clone(), k, p).isinf()


def exactly_k(logits, k, p):
    """What vLLM's Triton top-k/top-p keeps, as a reference: the k largest logits, ties taken by lowest index (its
    kernel's tie rule), then top-p over them as the sort does."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(logits.shape[1]).expand_as(order))
    kept = logits.masked_fill(ranks >= k[:, None], float("-inf"))
    return kept if p is None else apply_top_k_top_p_pytorch(kept, None, p)


@pytest.fixture
def cuda_dispatch(monkeypatch):
    """The patched module's dispatch as on CUDA: under 8 rows vLLM's torch sort (stable, as CUDA's radix sort is:
    use with `stable_sort`), from 8 rows its Triton top-k/top-p, which does not run interpreted. It is stood in for
    by `exactly_k`; the rows of every call to it are recorded."""
    from vllm.v1.sample.ops import topk_topp_sampler as patched

    triton_rows = []

    def triton(logits, k, p):
        triton_rows.append(logits.shape[0])
        return exactly_k(logits, k, p)

    monkeypatch.setattr(patched.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(patched, "HAS_TRITON", True)
    monkeypatch.setattr(patched, "apply_top_k_top_p_triton", triton)
    return triton_rows


@pytest.mark.parametrize("rows", [1, 4, 8, 16, 64])
def test_the_dispatch_keeps_stock_vllms_masks_at_every_batch_size(rows, cuda_dispatch, stable_sort, kernel_calls):
    """Issue #17: the distribution is exactly vLLM's. Under 8 rows the kernel gives the sort's masks, ties and exact
    top-p cuts included; from 8 rows vLLM's Triton path runs untouched (it keeps exactly k at a tie, the kernel
    would keep all 11 tied tokens)."""
    from vllm.v1.sample.ops import topk_topp_sampler as patched

    from qwen_serving.engine.kernels.topk_topp import apply_top_k_top_p_small_k

    logits, k, p = designed(rows, VOCAB)
    masks = {}
    for pp in (p, None):
        want = patched.apply_top_k_top_p(logits.clone(), k, pp)  # no host bound: vLLM's own dispatch
        got = patched.apply_top_k_top_p(logits.clone(), k, pp, int(k.max()))
        assert torch.equal(got, want), rows
        masks[pp is None] = want.isinf()
    if rows >= 4:  # the designed cuts, as the sort and the Triton path both make them
        assert (~masks[False][2]).sum() == 5 and (~masks[False][3]).sum() == 3
    if rows < 8:
        assert kernel_calls == ["apply_top_k_top_p_small_k"] * 2 and cuda_dispatch == []
    else:
        assert kernel_calls == [] and cuda_dispatch == [rows] * 4
        kernel = apply_top_k_top_p_small_k(logits.clone(), k, None, int(k.max())).isinf()
        assert (~kernel[1]).sum() == 11 and (~masks[True][1]).sum() == 4  # the tie row tells the two apart


def test_routing_takes_only_what_the_kernel_handles(monkeypatch):
    logits, k, p = batch(4)
    assert sampler_routing.takes_small_k(logits, k, p, 20)
    assert sampler_routing.takes_small_k(logits, k, None, 64)
    refused = {
        "no top-k": (logits, None, p, 20),
        "no host bound": (logits, k, p, None),
        "bound above 64": (logits, k, p, 65),
        "bound 0": (logits, k, p, 0),
        "bf16 logits": (logits.bfloat16(), k, p, 20),
        "strided rows": (torch.zeros(4, 2 * VOCAB)[:, ::2], k, p, 20),
        "3-D logits": (logits[None], k, p, 20),
        "k per request, rows per token": (logits, k[:2], p, 20),
        "p per request, rows per token": (logits, k, p[:2], 20),
    }
    for why, args in refused.items():
        assert not sampler_routing.takes_small_k(*args), why
        assert sampler_routing.apply_top_k_top_p(*args) is None, why
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not sampler_routing.takes_small_k(logits, k, p, 20), "CPU tensors without the Triton interpreter"


@pytest.mark.parametrize("with_p", [True, False])
def test_apply_top_k_top_p_matches_pristine_vllm(monkeypatch, stable_sort, kernel_calls, with_p):
    patched = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    pristine = load("pristine", "v1/sample/ops/topk_topp_sampler.py")
    for module in (patched, pristine):  # vLLM's Triton top-k (Qrita) does not run interpreted: its torch path
        monkeypatch.setattr(module, "HAS_TRITON", False)
    logits, k, p = batch()
    p = p if with_p else None
    want = pristine.apply_top_k_top_p(logits.clone(), k, p)
    got = patched.apply_top_k_top_p(logits.clone(), k, p, int(k.max()))
    assert kernel_calls == ["apply_top_k_top_p_small_k"]
    assert torch.equal(got, want)  # same mask, kept logits untouched
    # no host bound, or switched off: vLLM's own path
    assert torch.equal(patched.apply_top_k_top_p(logits.clone(), k, p), want)
    monkeypatch.setenv("VLLM_SMALL_TOPK_SAMPLER", "0")
    assert torch.equal(patched.apply_top_k_top_p(logits.clone(), k, p, int(k.max())), want)
    assert len(kernel_calls) == 1


def test_topk_topp_sampler_forward_native(cuda_dispatch, stable_sort, kernel_calls):
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    logits, k, p = batch(6)
    sampler = TopKTopPSampler(logprobs_mode="processed_logits")
    seeded = {2: torch.Generator().manual_seed(5)}
    tokens, processed = sampler.forward_native(logits.clone(), seeded, k, p, int(k.max()))
    assert kernel_calls == ["apply_top_k_top_p_small_k"]
    want = stock_mask(logits, k, p)
    assert torch.equal(processed.isinf(), want)
    assert not want[torch.arange(len(tokens)), tokens].any(), "sampled outside the top-k/top-p support"
    again, _ = sampler.forward_native(logits.clone(), {2: torch.Generator().manual_seed(5)}, k, p, int(k.max()))
    assert again[2] == tokens[2]


def sampling_metadata(k, p, temperature, top_k_max):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    rows = temperature.shape[0]
    greedy = temperature == 0
    return SamplingMetadata(
        temperature=temperature, all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()), top_p=p,
        top_k=k, generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows), presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows), output_token_ids=[], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(), top_k_max=top_k_max)


def test_rejection_sampler_constraints_per_token(cuda_dispatch, stable_sort, kernel_calls):
    # the verify step: per-request k/p expanded to every draft token's row
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    logits, _, _ = batch(7, seed=1)
    k, p, temperature = torch.tensor([4, 17, 9]), torch.tensor([0.9, 0.6, 0.75]), torch.tensor([0.7, 1.0, 1.3])
    draft_counts = torch.tensor([3, 1, 3])  # rows per request: 3 + 1 + 3
    metadata = sampling_metadata(k, p, temperature, top_k_max=17)
    got = apply_sampling_constraints(logits.clone(), draft_counts.cumsum(0), metadata)
    assert kernel_calls == ["apply_top_k_top_p_small_k"]
    per_row = [t.repeat_interleave(draft_counts) for t in (k, p, temperature)]
    want = stock_mask(logits / per_row[2][:, None], per_row[0], per_row[1])
    assert torch.equal(got.isinf(), want)


def test_input_batch_reports_host_top_k_max():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    batch_ = InputBatch(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=torch.device("cpu"),
                        vocab_size=VOCAB, block_sizes=[16], kernel_block_sizes=[16], max_num_blocks_per_req=[4])

    def add(i, params):
        batch_.add_request(CachedRequestState(req_id=f"r{i}", prompt_token_ids=[1, 2], mm_features=[],
                                              sampling_params=params, generator=None, block_ids=([],),
                                              num_computed_tokens=0, output_token_ids=[]))
        batch_.refresh_metadata()
        return batch_.sampling_metadata.top_k_max

    assert add(0, SamplingParams(temperature=0.7, top_p=0.9)) is None  # no top-k at all
    assert add(1, SamplingParams(temperature=0.7, top_k=20)) == VOCAB  # "no top-k" rows count as the vocabulary
    batch_.remove_request("r0")
    batch_.condense()
    batch_.refresh_metadata()
    assert batch_.sampling_metadata.top_k_max == 20
    assert add(2, SamplingParams(temperature=0.7, top_k=5)) == 20
    assert add(3, SamplingParams(temperature=0.0)) == VOCAB  # greedy rows have no top-k


def test_v2_sampling_states(monkeypatch, cuda_dispatch, stable_sort, kernel_calls):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.sample import sampler as v2_sampler
    from vllm.v1.worker.gpu.sample.states import SamplingStates

    class HostPool:  # the UVA pool pins memory, which needs CUDA; a host copy behaves the same here
        def __init__(self, *args, **kwargs):
            pass

        def copy_to_uva(self, array):
            return torch.from_numpy(np.array(array))

    monkeypatch.setattr(buffer_utils, "UvaBufferPool", HostPool)
    states = SamplingStates(max_num_reqs=4, vocab_size=VOCAB)
    for slot, params in enumerate([SamplingParams(temperature=0.8, top_k=12, top_p=0.7),
                                   SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3)]):
        states.add_request(slot, params)
    states.apply_staged_writes()
    assert states.top_k_max(np.array([0, 2])) == 12
    assert states.top_k_max(np.array([0, 1])) == VOCAB
    logits, _, _ = batch(4, seed=2)
    rows = torch.tensor([2, 0, 0, 2])  # expanded_idx_mapping: a request's slot for every logits row
    want = stock_mask(logits, states.top_k.gpu[rows], states.top_p.gpu[rows])
    got = states.apply_top_k_top_p(logits.clone(), rows, np.array([2, 0]))  # the verify step's path
    assert kernel_calls == ["apply_top_k_top_p_small_k"]
    assert torch.equal(got.isinf(), want)

    # the sampler's own path; everything before top-k/top-p (penalties, temperature) left out, and the
    # Gumbel draw (libdevice log1p, which the interpreter lacks) replaced by the argmax it ends in
    monkeypatch.setattr(v2_sampler, "gumbel_sample", lambda logits, *args, **kwargs: logits.argmax(-1))
    sampler = SimpleNamespace(sampling_states=states, use_flashinfer=False, use_fp64_gumbel=False,
                              apply_sampling_params=lambda logits, *args, **kwargs: logits)
    pos = torch.arange(4)
    _, processed = v2_sampler.Sampler.sample(sampler, logits.clone(), rows, rows, np.array([2, 0]), pos, pos, pos)
    assert kernel_calls == ["apply_top_k_top_p_small_k"] * 2
    assert torch.equal(processed.isinf(), want)


def test_draft_probs_over_the_target_support(monkeypatch, stable_sort, kernel_calls):
    from vllm.v1.spec_decode.llm_base_proposer import compute_probs_and_sample_next_token

    logits, k, p = batch(3, seed=3)
    temperature = torch.tensor([0.5, 1.0, 2.0])
    metadata = sampling_metadata(k[:3], p[:3], temperature, top_k_max=int(k[:3].max()))
    draft_logits = logits.bfloat16()  # the drafter's dtype
    scaled = draft_logits.clone().div_(temperature[:, None]).float()  # the proposer divides in place
    tokens, probs = compute_probs_and_sample_next_token(draft_logits, metadata)
    assert kernel_calls == ["top_k_top_p_probs"]
    support = ~stock_mask(scaled, k[:3], p[:3])
    assert support[torch.arange(3), tokens].all()
    torch.testing.assert_close(probs, scaled.masked_fill(~support, float("-inf")).softmax(-1), atol=1e-6, rtol=1e-5)
    monkeypatch.setenv("VLLM_SMALL_TOPK_SAMPLER", "0")  # vLLM's plain softmax over the whole vocabulary
    _, plain = compute_probs_and_sample_next_token(logits.clone(), metadata)
    torch.testing.assert_close(plain, (logits / temperature[:, None]).softmax(-1))
    assert len(kernel_calls) == 1
