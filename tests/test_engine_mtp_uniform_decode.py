"""qwen_serving.engine.mtp_uniform_decode (mtp-uniform-decode-guard.patch): a batch of the verify step's shape is a uniform
decode only when each of its requests carries its k drafts; vLLM 0.28.0's own shape test calls a 1 + k-token
prompt one; the patched execute_model hands the override to the dispatch."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest

from qwen_serving.engine.mtp_uniform_decode import uniform_decode_override

K = 4
DRAFTS = [11, 12, 13, 14]


def vllm_is_uniform(num_scheduled: list[int], force: bool | None) -> bool:
    """vLLM 0.28.0's own classification, as execute_model calls it, with `force` as the patch passes it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner._is_uniform_decode(max_num_scheduled_tokens=max(num_scheduled), uniform_decode_query_len=1 + K,
                                             num_tokens=sum(num_scheduled), num_reqs=len(num_scheduled),
                                             force_uniform_decode=force)


@pytest.mark.parametrize("name, scheduled, spec, want", [
    ("a prompt of 1 + k tokens", {"p": 5}, {}, False),
    ("two such prompts", {"p": 5, "q": 5}, {}, False),
    ("a last chunk of 1 + k tokens beside a decode", {"d": 5, "p": 5}, {"d": DRAFTS}, False),
    ("a decode whose drafts were cut to fewer than k", {"d": 5}, {"d": DRAFTS[:3]}, False),
    ("decodes with their k drafts", {"d": 5, "e": 5}, {"d": DRAFTS, "e": DRAFTS}, None),
    ("a prefill of another length", {"p": 7}, {}, None),
    ("a mixed batch", {"d": 5, "p": 2048}, {"d": DRAFTS}, None),
])
def test_the_override(name, scheduled, spec, want):
    ids = list(scheduled)
    got = uniform_decode_override(K, ids, np.array([scheduled[i] for i in ids], dtype=np.int32), spec)
    assert got is want, name
    # what vLLM's dispatch then sees: a uniform decode only for true decodes of the verify shape
    shape_says = vllm_is_uniform(list(scheduled.values()), None)
    assert vllm_is_uniform(list(scheduled.values()), got) == (shape_says and want is None)


def test_vllm_alone_calls_a_five_token_prompt_a_uniform_decode():
    assert vllm_is_uniform([5], None)  # the fault the patch closes: shape only


def test_without_speculation_vllm_decides():
    assert uniform_decode_override(0, ["p"], [1], {}) is None
    assert uniform_decode_override(K, [], [], {}) is None


def test_the_patched_execute_model_passes_the_override():
    patched = Path(os.environ["QS_PATCHED_VLLM"]) / "v1" / "worker" / "gpu_model_runner.py"
    tree = ast.parse(patched.read_text())
    runner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPUModelRunner")
    execute = next(n for n in runner.body if isinstance(n, ast.FunctionDef) and n.name == "execute_model")
    calls = [n for n in ast.walk(execute) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "_determine_batch_execution_and_padding"]
    assert len(calls) == 1
    force = next(k.value for k in calls[0].keywords if k.arg == "force_uniform_decode")
    assert isinstance(force, ast.Call) and ast.unparse(force.func) == "uniform_decode_override"
    assert [ast.unparse(a) for a in force.args] == ["self.num_spec_tokens", "req_ids", "num_scheduled_tokens_np",
                                                    "scheduler_output.scheduled_spec_decode_tokens"]
    pristine = Path(os.environ["QS_PRISTINE_VLLM"]) / "v1" / "worker" / "gpu_model_runner.py"
    assert "uniform_decode_override" not in pristine.read_text()
