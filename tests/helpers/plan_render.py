"""The plan's rendering of a fixed set of configurations, for the snapshot test.

`python -m tests.helpers.plan_render > tests/fixtures/plan-render.json` writes the snapshot that
tests/test_plan_render.py renders the same configurations against.
Every configuration runs `python -m qwen_serving.plan MODE --dry-run` and `MODE explain` on a probe
that sees no GPU, vLLM as installed (so no install step) and an empty checkout: the output depends on the plan alone.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

# The README's examples, then one configuration per knob rule and per refusal.
CONFIGS: tuple[tuple[str, dict[str, str]], ...] = (
    ("batch", {}),
    ("single", {}),
    ("single", {"SPEC": "dflash2"}),
    ("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15"}),
    ("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15", "MAX_SEQS": "8"}),
    ("single", {"SPEC": "dflash2", "CTX": "long"}),
    ("single", {"SPEC": "dflash2", "CTX": "huge"}),
    ("single", {"SPEC": "dflash2", "ASYNC_SCHED": "1"}),
    ("single", {"SPEC": "dflash2", "LOOKUP": "0"}),
    ("single", {"SPEC": "dflash2", "VLLM_DFLASH2_LOOKUP_NMIN": "20"}),
    ("single", {"SPEC": "off"}),
    ("single", {"CTX": "long"}),
    ("single", {"CTX": "long", "DRAFT_TOKENS": "4"}),
    ("single", {"CTX": "huge"}),
    ("single", {"CTX": "huge", "CUDAGRAPH_MODE": "FULL"}),
    ("single", {"MTP_DRAFT_VOCAB": "0", "DRAFT_SAMPLE": "greedy", "DRAFT_TOKENS": "2"}),
    ("single", {"PREFILL_ATTN": "int8"}),
    ("single", {"PREFILL_ATTN": "int8", "INT8_ACT": "int8"}),
    ("single", {"INT8_ACT": "int8", "INT8_LAYERS": "mlp|linear_attn"}),
    ("single", {"INT8_LAYERS": "mlp"}),
    ("single", {"SPEC_ATTN": "0", "PREFIX_CACHE": "0"}),
    ("single", {"VISION": "1"}),
    ("single", {"VISION": "1", "VISION_OFFLOAD": "0"}),
    ("single", {"KV_MEM": "6GiB", "MAX_SEQS": "4"}),
    ("single", {"KV_MEM": "300M"}),
    ("single", {"KV_MEM": "auto"}),
    ("single", {"MODEL": "/no/such/dir"}),
    ("single", {"KV": "int4pth"}),
    ("batch", {"INT8_LAYERS": "."}),
    ("batch", {"INT8_LAYERS": ".", "GPU_UTIL": "0.97"}),
    ("batch", {"INT8_ACT": "off", "INT8_LAYERS": "mlp"}),
    ("batch", {"KV": "int4pth"}),
    ("batch", {"KV": "kvarn"}),
    ("batch", {"PREFIX_CACHE": "0", "STATE_DTYPE": "float32"}),
    ("batch", {"KV_MEM": "5583457484"}),
    ("batch", {"KV_MEM": "1GiB", "MAX_SEQS": "64"}),
    ("batch", {"HOST": "0.0.0.0"}),
    ("batch", {"HOST": "0.0.0.0", "VLLM_API_KEY": "k"}),
    ("batch", {"HOST": "0.0.0.0", "PUBLISHED_ON": "127.0.0.1"}),
    ("batch", {"PUBLISHED_ON": "192.0.2.1", "VLLM_API_KEY": "k"}),
    ("batch", {"PORT": "8000", "MAX_SEQS": "16", "MAX_LEN": "32768"}),
    ("batch", {"PORT": "0"}),
    ("batch", {"TOOLS": "0"}),
    ("batch", {"TOOL_PARSER": "hermes"}),
    ("batch", {"REQ_METRICS": "1"}),
    ("batch", {"REQ_METRICS": "1", "EXTRA_ARGS": "--disable-log-stats"}),
    ("batch", {"EXTRA_ARGS": "--api-key secret"}),
    ("batch", {"EXTRA_ARGS": "--tensor-parallel-size 2 --seed 1"}),
    ("batch", {"EXTRA_ARGS": "'unbalanced"}),
    ("batch", {"API_SERVERS": "2", "ASYNC_SCHED": "0", "CUDAGRAPH_MODE": "PIECEWISE", "GDN_PREFILL": "triton"}),
    ("batch", {"VISION": "1"}),
    ("batch", {"SPEC": "dflash2"}),
    ("batch", {"VLLM_MARLN_INPUT_DTYPE": "int8"}),
    ("batch", {"MAX_SEQS": "abc"}),
)


def render(mode: str, env: dict[str, str]) -> dict[str, object]:
    """stdout, stderr and exit code of `--dry-run` and `explain` for one configuration."""
    from qwen_serving import plan

    out: dict[str, object] = {"mode": mode, "env": env}
    with tempfile.TemporaryDirectory() as tmp:
        probe = plan.Probe(repo=Path(tmp), vllm_installed=True)
        detect = plan.Probe.detect
        plan.Probe.detect = classmethod(lambda cls, *a, **k: probe)  # type: ignore[method-assign]
        try:
            for action in ("--dry-run", "explain"):
                stdout, stderr = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                    rc = plan.main([mode, action], env=dict(env))
                out[action] = {"rc": rc, "stdout": stdout.getvalue().replace(tmp, "<repo>"),
                               "stderr": stderr.getvalue().replace(tmp, "<repo>")}
        finally:
            plan.Probe.detect = detect  # type: ignore[method-assign]
    return out


def render_all() -> list[dict[str, object]]:
    return [render(mode, env) for mode, env in CONFIGS]


if __name__ == "__main__":
    json.dump(render_all(), sys.stdout, indent=1)
    sys.stdout.write("\n")
