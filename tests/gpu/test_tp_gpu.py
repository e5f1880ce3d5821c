"""TP=2 on a two-GPU host (issue 24): both modes' plans boot with `TP=2` on the `shape` checkpoint (every real
27B matrix shape, 4 layers: the real head counts, so the real per-card splits), Marlin forced as on an RTX 3090,
and answer a greedy completion; the same plan at TP=1 answers the same prompt for comparison. Skipped on fewer
than two GPUs. Not run yet (this session had no two-GPU kind).

    pytest -m gpu tests/gpu/test_tp_gpu.py      # on the device, after run_on_device.sh has staged the stack

Writes tp-gpu.json into $QS_GPU_RESULTS: per configuration the argv, the boot seconds, vLLM's "GPU KV cache
size" line, the plan's per-card pool figure and the greedy text; server logs beside it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import smoke_lib as lib  # noqa: E402

from bench import serving  # noqa: E402
from qwen_serving import knobs, plan  # noqa: E402

BOOT_TIMEOUT_S = 1200  # first starts JIT the GDN kernels on every rank
KV_MEM = str(2 << 30)  # per card, pinned: vLLM skips its profiling
MAX_LEN = 4096
CONFIGS = (("batch", "1"), ("batch", "2"), ("single", "1"), ("single", "2"))


def _shape_checkpoint(work: Path) -> Path:
    given = os.environ.get("QS_GPU_SHAPE_CKPT")
    if given:
        return Path(given)
    out = work / "shape-4"
    if not (out / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "qwen_serving.checkpoint.synth", "--size", "shape", "--layers", "4",
                        "--out", str(out), "--seed", "0"], cwd=REPO, env=lib.child_env(os.environ), check=True,
                       timeout=1800)
    return out


@pytest.mark.gpu
def test_both_modes_boot_and_answer_with_tp_2(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (tests/gpu/README.md)")
    results = Path(os.environ.get("QS_GPU_RESULTS", "/tmp/gpu-results"))
    shape = _shape_checkpoint(results / "work")
    record: dict[str, dict] = {}
    for mode, tp in CONFIGS:
        env = {"TP": tp, "MODEL": str(shape), "KV_MEM": KV_MEM, "MAX_LEN": str(lib.model_max_len(shape, MAX_LEN)),
               "GDN_PREFILL": "triton"}
        p = plan.build(mode, env, plan.Probe(repo=REPO))
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", *p.argv[1:]]
        port = serving.free_port()
        argv[argv.index("--port") + 1] = str(port)
        name = f"{mode}-tp{tp}"
        server = serving.ServerProcess(name, argv, port, results / f"server-tp-{name}.log",
                                       env={**lib.child_env(os.environ), **p.env,
                                            "VLLM_DISABLED_KERNELS": "MacheteLinearKernel"})
        server.launch()
        try:
            server.wait_healthy(BOOT_TIMEOUT_S)
            answer = serving.post_json(server.url + "/v1/completions", {
                "model": knobs.SERVED_NAME, "prompt": "The capital of Denmark is", "max_tokens": 16,
                "temperature": 0, "ignore_eos": True})
        finally:
            server.stop()
        log = server.log_text()
        pool = re.findall(r"GPU KV cache size: ([\d,]+) tokens", log)
        record[name] = {"argv": p.argv, "env": dict(p.env), "boot_s": server.start_seconds,
                        "vllm_pool_line": pool[-1] if pool else None, "marlin": "MarlinLinearKernel" in log,
                        "plan_per_card": {d.name: str(d.value) for d in p.derived},
                        "text": answer["choices"][0]["text"], "tokens": answer["usage"]["completion_tokens"]}
        assert answer["usage"]["completion_tokens"] == 16 and "MarlinLinearKernel" in log, name
        assert ("--tensor-parallel-size" in p.argv) is (tp != "1")
    serving.write_json_atomic(results / "tp-gpu.json", {"gpu": lib.gpu_description(), "configs": record})
