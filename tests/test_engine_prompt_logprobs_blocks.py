"""qwen_serving.engine.worker_prompt_logprobs (worker-prompt-logprobs-blocks.patch): the patched
``GPUModelRunner._get_prompt_logprobs_dict`` gives the same prompt logprobs as vLLM 0.28.0's own, bit for bit, while
never asking ``compute_logits`` for more than BLOCK_ROWS rows at once.

Both methods run unbound on a fake runner (the attributes the method reads) with vLLM's real Sampler, step after
step of a schedule: chunk sizes below, at and past a block, ones that are no multiple of it, a prompt split over
chunks (its LogprobsTensors filled slice by slice across steps), several requests in one batch, a request without
prompt logprobs and one with prompt embeddings, every logprobs_mode, bf16 and float32 logits. The fake lm_head is
exact (small-integer weights and hidden states, a power-of-two scale): a row's logits are the same bits whatever the
rows beside it, as the real GEMM's must be for the claim to mean anything beyond the row-wise steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from qwen_serving.engine import worker_prompt_logprobs
from tests.helpers.engine_trees import load

VOCAB = 600
HIDDEN = 32
MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


class FakeModel:
    """compute_logits as an exact matmul; records the rows of each call."""

    def __init__(self, dtype: torch.dtype):
        gen = torch.Generator().manual_seed(1)
        self.weight = torch.randint(-3, 4, (VOCAB, HIDDEN), generator=gen).float()
        # distinct per token (multiples of 2**-13 below 2**-3 apart from any logit step): no ties in float32
        self.bias = torch.arange(VOCAB, dtype=torch.float32) * 2.0**-13
        self.dtype = dtype
        self.calls: list[int] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        return (hidden @ self.weight.T * 0.125 + self.bias).to(self.dtype)


@dataclass
class Req:
    prompt_len: int
    num_prompt_logprobs: int | None  # None: the request asks none; VOCAB stands for -1 (vLLM stores the vocab size)
    embeds: bool = False  # a prompt given as embeddings: no prompt_token_ids


def hidden_rows(index: int, length: int) -> torch.Tensor:
    """The hidden state at each position of request `index`: the same whichever chunk the position is in."""
    gen = torch.Generator().manual_seed(100 + index)
    return torch.randint(-3, 4, (length, HIDDEN), generator=gen).float()


def prompt_ids(index: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(200 + index)
    return torch.randint(0, VOCAB, (length,), generator=gen).tolist()


def run_schedule(method, reqs: list[Req], steps: list[list[int]], mode: str, dtype: torch.dtype):
    """Call `method` (an unbound _get_prompt_logprobs_dict) once per step; steps[s][i] is request i's scheduled
    tokens at step s (0: not scheduled). Returns each step's dict, as host tensors, and the model's call sizes."""
    from vllm.v1.sample.sampler import Sampler

    model = FakeModel(dtype)
    requests = {f"r{i}": SimpleNamespace(prompt_token_ids=None if r.embeds else prompt_ids(i, r.prompt_len),
                                         num_computed_tokens=0, in_progress_prompt_logprobs_cpu=None)
                for i, r in enumerate(reqs)}
    runner = SimpleNamespace(
        num_prompt_logprobs={f"r{i}": r.num_prompt_logprobs for i, r in enumerate(reqs)
                             if r.num_prompt_logprobs is not None},
        requests=requests, device=torch.device("cpu"), model=model, sampler=Sampler(logprobs_mode=mode),
        model_config=SimpleNamespace(logprobs_mode=mode), input_batch=SimpleNamespace(req_id_to_index={}),
        query_start_loc=SimpleNamespace(np=np.zeros(len(reqs) + 1, dtype=np.int32)), _sync_device=lambda: None)
    results = []
    for step in steps:
        ids = [f"r{i}" for i, n in enumerate(step) if n]
        runner.input_batch.req_id_to_index = {rid: k for k, rid in enumerate(ids)}
        lens = [n for n in step if n]
        runner.query_start_loc.np[: len(ids) + 1] = np.concatenate([[0], np.cumsum(lens)])
        rows = []
        for rid, n in zip(ids, lens, strict=True):
            done = requests[rid].num_computed_tokens
            rows.append(hidden_rows(int(rid[1:]), reqs[int(rid[1:])].prompt_len + 64)[done : done + n])
        out = method(runner, torch.cat(rows), dict(zip(ids, lens, strict=True)))
        results.append({rid: None if t is None else tuple(x.clone() for x in t[:3]) for rid, t in out.items()})
        for rid, n in zip(ids, lens, strict=True):
            requests[rid].num_computed_tokens += n
    return results, model.calls


def identical(a, b) -> bool:
    if a.keys() != b.keys():
        return False
    for rid in a:
        if (a[rid] is None) != (b[rid] is None):
            return False
        if a[rid] is not None and not all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                                          for x, y in zip(a[rid], b[rid], strict=True)):
            return False
    return True


@pytest.fixture(scope="module")
def methods():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    pristine = load("pristine", "v1/worker/gpu_model_runner.py").GPUModelRunner
    assert pristine is not GPUModelRunner
    return pristine._get_prompt_logprobs_dict, GPUModelRunner._get_prompt_logprobs_dict


B = worker_prompt_logprobs.BLOCK_ROWS
SCHEDULES = {
    # name: (requests, steps)
    "one chunk past two blocks, no multiple": ([Req(600, 5)], [[600], [1]]),
    "one row": ([Req(2, 3)], [[2], [1]]),
    "exactly one block of logits": ([Req(B + 1, 4)], [[B + 1], [1]]),
    "a block and one row": ([Req(B + 2, 4)], [[B + 2], [1]]),
    # 300 + 512 + 188: the last chunk yields 187 rows; its slices land across three steps in one tensor
    "a prompt over three chunks": ([Req(1000, 2)], [[300], [512], [188], [1]]),
    # the chunk of 512 gives all 512 rows, and the next step (0 rows left) returns the tensor
    "the == case: the last row in the next step": ([Req(2 * B + 1, 6)], [[2 * B], [1], [1]]),
    "a batch: top-5, none asked, top-0, the whole vocabulary, embeddings": (
        [Req(300, 5), Req(200, None), Req(40, 0), Req(700, VOCAB), Req(50, 2, embeds=True)],
        [[300, 200, 40, 400, 50], [1, 1, 1, 300, 1], [0, 1, 0, 1, 1]]),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_patched_prompt_logprobs_equal_vllms_own(methods, name, mode, dtype):
    pristine, patched = methods
    reqs, steps = SCHEDULES[name]
    want, pristine_calls = run_schedule(pristine, reqs, steps, mode, dtype)
    got, patched_calls = run_schedule(patched, reqs, steps, mode, dtype)
    assert [set(step) for step in got] == [set(step) for step in want]
    returned = [t for step in want for t in step.values() if t is not None]
    assert returned, "the schedule returns some prompt logprobs"
    assert all(identical(g, w) for g, w in zip(got, want, strict=True)), name
    # the same rows went through the lm_head, in blocks of at most BLOCK_ROWS
    assert sum(patched_calls) == sum(pristine_calls) and max(patched_calls) <= B


def test_compute_logits_never_sees_more_than_a_block(methods):
    pristine, patched = methods
    reqs, steps = SCHEDULES["a batch: top-5, none asked, top-0, the whole vocabulary, embeddings"]
    _, pristine_calls = run_schedule(pristine, reqs, steps, "raw_logprobs", torch.bfloat16)
    _, patched_calls = run_schedule(patched, reqs, steps, "raw_logprobs", torch.bfloat16)
    # vLLM's own: each request's chunk in one call (299 and 39 rows, then the long prompt's 400 and 299)
    assert pristine_calls == [299, 39, 400, 299]
    assert patched_calls == [B, 299 - B, 39, B, 400 - B, B, 299 - B]


def test_small_blocks_still_identical(methods, monkeypatch):
    """Many blocks a chunk (the module constant as the patch reads it): 7 rows, so every chunk ends mid-block."""
    pristine, patched = methods
    reqs, steps = SCHEDULES["a prompt over three chunks"]
    want, _ = run_schedule(pristine, reqs, steps, "raw_logprobs", torch.bfloat16)
    monkeypatch.setattr(worker_prompt_logprobs, "BLOCK_ROWS", 7)
    got, calls = run_schedule(patched, reqs, steps, "raw_logprobs", torch.bfloat16)
    assert all(identical(g, w) for g, w in zip(got, want, strict=True))
    assert max(calls) == 7 and calls.count(7) == 300 // 7 + 512 // 7 + 187 // 7


def test_the_hook_writes_only_its_slice():
    """fill_prompt_logprobs alone: rows start_idx.. of the target, in blocks; the rows around are untouched."""
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.sample.sampler import Sampler

    model = FakeModel(torch.bfloat16)
    hidden = hidden_rows(0, 20)
    targets = torch.tensor(prompt_ids(0, 20), dtype=torch.int64)
    out = LogprobsTensors.empty_cpu(40, 4)
    for tensor in out[:3]:
        tensor.fill_(-7)
    worker_prompt_logprobs.fill_prompt_logprobs(model.compute_logits, Sampler(), "raw_logprobs", hidden, targets, 3,
                                                out, 10, block_rows=6)
    assert model.calls == [6, 6, 6, 2]
    reference = Sampler.gather_logprobs(Sampler.compute_logprobs(model.compute_logits(hidden)), 3, targets)
    for tensor, expected in zip(out[:3], reference[:3], strict=True):
        assert torch.equal(tensor[10:30], expected.to(tensor.dtype))
        assert (tensor[:10] == -7).all() and (tensor[30:] == -7).all()
    with pytest.raises(ValueError, match="at least 1"):
        worker_prompt_logprobs.fill_prompt_logprobs(model.compute_logits, Sampler(), "raw_logprobs", hidden, targets,
                                                    3, out, 10, block_rows=-1)
