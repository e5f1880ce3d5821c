"""Split-KV verify attention (Triton, interpreted on CPU) against an fp32 reference over a paged KV cache.

Tolerance: max |error| <= 2e-2 for bf16 (inputs, P and output are bf16-rounded).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qwen_serving.engine.kernels.spec_attn import SpecAttention
from tests.helpers.paged_kv import make_paged, run_and_compare

REPO = Path(__file__).resolve().parents[1]


def test_ragged_batch_gqa_and_splits():
    # GQA 6:1 like 24/4, q lengths 1..16, context lengths off page and tile boundaries, one context shorter
    # than its split count and one equal to its query length (the first verify after a prefill)
    for splits in (1, 3, 8):
        run_and_compare([37, 100, 16, 5], [5, 16, 1, 5], hq=12, hkv=2, d=32, page=16, splits=splits)


def test_head_dim_256_and_split_layout():
    run_and_compare([50, 21], [3, 7], hq=6, hkv=1, d=256, page=16, splits=2, packed=False)


def test_causal_inside_the_verify_block():
    # the first query token of a 4-token block must not see the three after it: perturbing them changes
    # only the later queries' outputs
    q, kc, vc, bt, sl, qsl = make_paged([40], [4], 6, 1, 32, 16, seed=3)
    attn = SpecAttention(6, 1, 32, max_batch=1, max_query_len=4, max_splits=2, device="cpu", block_n=16)
    before = attn(q, kc, vc, bt, sl, qsl, 4, 0.2).clone()
    last_pages = bt[0, 2].long()  # positions 32..39 live in the third page
    kc[last_pages, 37 - 32 :] += 3.0
    after = attn(q, kc, vc, bt, sl, qsl, 4, 0.2)
    assert torch.equal(before[0], after[0])  # query 0 sees positions < 37
    assert not torch.equal(before[1], after[1])


def test_bad_arguments_raise():
    attn = SpecAttention(12, 2, 32, max_batch=2, max_query_len=4, max_splits=2, device="cpu")
    q, kc, vc, bt, sl, qsl = make_paged([20], [2], 12, 2, 32, 16)
    with pytest.raises(ValueError, match="max_query_len"):
        attn(q, kc, vc, bt, sl, qsl, 5, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        attn(q, kc, vc, bt, sl, qsl, 2, 1.0, num_splits=3)
    with pytest.raises(ValueError, match="KV dtype"):
        attn(q, kc.half(), vc.half(), bt, sl, qsl, 2, 1.0)
    with pytest.raises(ValueError, match="KV dtype"):  # no fp8 cache (see the kernel's docstring)
        attn(q, kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), bt, sl, qsl, 2, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        SpecAttention(10, 4, 32, max_batch=1, device="cpu")


def test_junk_block_table_entries_past_the_context_are_never_read():
    # entries past a request's pages hold 10**6 (far outside the cache); a stray read would crash the process
    script = textwrap.dedent(
        """
        import torch
        from tests.helpers.paged_kv import run_and_compare
        run_and_compare([17, 64], [2, 3], hq=6, hkv=1, d=16, page=16, splits=4)
        print("ok")
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
