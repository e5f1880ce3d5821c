"""The split-KV verify kernel fits the shared memory of the cards it serves, at every verify block length.

Compiled by Triton for sm86 (RTX 3090) and sm89 (RTX 4090) without a GPU (tests/helpers/triton_smem.py), at
the serving geometry (24 query heads, 4 KV heads, head_dim 256) and the tiles the kernel launches with, for
every block length the routing hands it (1-16 queries; longer blocks stay on FlashAttention). Per-block
opt-in shared memory, from NVIDIA's tuning guides (Ampere: 8.0 up to 163 KB per block, 8.6 up to 99 KB; Ada
8.9: 99 KB; Hopper 9.0: 227 KB): the kernel is launched with dynamic shared memory above the static 48 KB.
Before the tile rule, 11-16 queries (128 rows) with 64-key tiles needed 114,688 B on sm86, over its limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_serving.engine.attn_routing import MAX_VERIFY_QUERY

REPO = Path(__file__).resolve().parents[1]
SHARED_PER_BLOCK = {86: 99 * 1024, 89: 99 * 1024}  # 101,376 B (sm80: 166,912; sm90: 232,448)
CAPABILITIES = tuple(SHARED_PER_BLOCK)


@pytest.fixture(scope="module")
def measured():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    procs = {cap: subprocess.Popen([sys.executable, "-m", "tests.helpers.triton_smem", str(cap)], cwd=REPO, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cap in CAPABILITIES}  # one compiler process per card, side by side
    result = {}
    for cap, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        result[cap] = {int(n): v for n, v in json.loads(out).items()}
    return result


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_every_block_length_fits(measured, capability):
    per_length = measured[capability]
    assert sorted(per_length) == list(range(1, MAX_VERIFY_QUERY + 1))
    over = {n: v for n, v in per_length.items() if v["shared"] > SHARED_PER_BLOCK[capability]}
    assert not over, f"sm{capability}: shared memory over {SHARED_PER_BLOCK[capability]} B: {over}"
    # the rule keeps the wide key tile wherever it fits (up to 10 queries: 60 rows)
    assert {v["block_n"] for n, v in per_length.items() if n <= 10} == {64}
