"""Engine patches on a GPU: Marlin W4A8 with negative group scales (patches/marlin-int8-*.patch).

The synthetic `shape` checkpoint (every real 27B matrix shape, 4 layers) stores about half of its
group scales negative, as AutoRound exports do. Four offline engines start at the same time, each in
its own process (tests/gpu/engine_w4a8_child.py), Marlin forced as on an RTX 3090:
W4A16, W4A8 on every linear, W4A8 on the default `mlp` set, and W4A8 on every linear with the sign
fold disabled. Plus one Marlin W4A8 layer run directly in this process. Numbers go to
$QS_GPU_RESULTS/engine-h200.json (for bench/results/engine-h200.json).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import smoke_lib as lib

from bench import serving

pytestmark = pytest.mark.gpu

RESULTS, WORK = lib.RESULTS, lib.WORK
CHILD = Path(__file__).with_name("engine_w4a8_child.py")
ENGINE_TIMEOUT_S = 900
# One criterion for "not garbage": perplexity within 5% of W4A16 (the bar) and prompt
# logprobs within 0.25 nats of W4A16 on average (int8 activation rounding moves them by far less).
PPL_TOLERANCE = 0.05
LOGPROB_TOLERANCE = 0.25
RUNS = {
    "w4a16": ("w4a16",),
    "w4a8-all": ("w4a8", "."),
    "w4a8-mlp": ("w4a8", "mlp"),
    "w4a8-all-nofold": ("w4a8-nofold", "."),
}


@pytest.fixture(scope="module")
def engines() -> dict[str, dict]:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    work = WORK / "engine"
    work.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    model = work / "shape"
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "qwen_serving.checkpoint.synth", "--size", "shape", "--layers", "4",
                        "--out", str(model), "--seed", "0", "--force"],
                       cwd=lib.REPO, env=lib.child_env(os.environ), check=True, timeout=900)
    children = {}
    for name, args in RUNS.items():
        out = work / f"{name}.json"
        children[name] = ([sys.executable, str(CHILD), str(model), str(out), *args], out, RESULTS / f"engine-{name}.log")
    runs: dict[str, dict] = {}
    for name, child in lib.run_json_children(children, lib.child_env(os.environ), ENGINE_TIMEOUT_S).items():
        runs[name] = {**child.record, "rc": child.rc,
                      "marlin": "Using MarlinLinearKernel for CompressedTensorsWNA16" in child.log,
                      "log_tail": child.log[-2000:] if child.rc != 0 else ""}
    reference = runs["w4a16"].get("prompt_logprobs")
    for run in runs.values():
        if reference and run.get("prompt_logprobs"):
            deltas = [abs(a - b) for a, b in zip(run["prompt_logprobs"], reference, strict=True)]
            run["mean_abs_logprob_delta"] = sum(deltas) / len(deltas)
            run["perplexity_vs_w4a16"] = run["perplexity"] / runs["w4a16"]["perplexity"] - 1
            run["greedy_agreement"] = sum(a == b for a, b in zip(run["greedy"], runs["w4a16"]["greedy"], strict=True))
    serving.write_json_atomic(RESULTS / "engine-h200.json", {"w4a8_runs": {k: {f: v for f, v in r.items() if f != "prompt_logprobs"}
                                                             for k, r in runs.items()}})
    return runs


def _ok(run: dict) -> dict:
    assert run.get("rc") == 0, f"engine failed (rc {run.get('rc')}):\n{run.get('log_tail')}"
    assert run["marlin"], "Marlin was not the W4A16/W4A8 kernel"
    return run


def _not_garbage(run: dict) -> bool:
    return abs(run["perplexity_vs_w4a16"]) < PPL_TOLERANCE and run["mean_abs_logprob_delta"] < LOGPROB_TOLERANCE


@pytest.mark.parametrize("name", ["w4a8-all", "w4a8-mlp"])
def test_w4a8_tracks_w4a16(engines, name):
    _ok(engines["w4a16"])
    run = _ok(engines[name])
    assert _not_garbage(run), {k: run[k] for k in ("perplexity_vs_w4a16", "mean_abs_logprob_delta")}


def test_negative_scales_garbage_without_the_fold(engines):
    _ok(engines["w4a16"])
    run = _ok(engines["w4a8-all-nofold"])
    assert not _not_garbage(run), {k: run[k] for k in ("perplexity_vs_w4a16", "mean_abs_logprob_delta")}


def test_marlin_w4a8_layer(monkeypatch):
    """One Marlin layer, negative scales, int8 activations: the CUDA kernel against x @ W in fp32."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import vllm.model_executor.parameter as parameter
    from vllm.model_executor.kernels.linear.mixed_precision.marlin import MarlinLinearKernel
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    import qwen_serving.engine.marlin_int8 as marlin_int8
    from qwen_serving.checkpoint.int4 import dequantize_int4_groups, negate_groups, pack_int4, quantize_int4_groups

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    n, k, group = 1024, 2048, 128
    gen = torch.Generator().manual_seed(0)
    codes, scales = quantize_int4_groups(torch.randn(n, k, generator=gen), group)
    codes, scales = negate_groups(codes, scales, torch.rand(scales.shape, generator=gen) < 0.5, group)
    weight = dequantize_int4_groups(codes, scales, group).cuda()  # [n, k]
    x = torch.randn(64, k, generator=gen).to(torch.bfloat16).cuda()
    reference = x.float() @ weight.t()

    def run(act_type, fold: bool) -> float:
        with monkeypatch.context() as patch:
            if not fold:  # the hook's fold becomes a no-op: the stock behaviour
                patch.setattr(marlin_int8, "fold_layer_scales", lambda *args, **kwargs: None)
            layer = torch.nn.Module()
            layer.weight_packed = parameter.PackedvLLMParameter(
                data=pack_int4(codes).cuda(), input_dim=1, output_dim=0, packed_dim=1, packed_factor=8,
                weight_loader=None)
            layer.weight_scale = parameter.GroupQuantScaleParameter(
                data=scales.to(torch.bfloat16).cuda(), input_dim=1, output_dim=0, weight_loader=None)
            config = MPLinearLayerConfig(full_weight_shape=(k, n), partition_weight_shape=(k, n),
                                         weight_type=scalar_types.uint4b8, act_type=act_type, group_size=group,
                                         zero_points=False, has_g_idx=False)
            kernel = MarlinLinearKernel(config, "weight_packed", "weight_scale")
            kernel.process_weights_after_loading(layer)
            out = kernel.apply_weights(layer, x).float()
        return float((out - reference).norm() / reference.norm())

    errors = {"w4a16": run(torch.bfloat16, True), "w4a8": run(torch.int8, True),
              "w4a8_nofold": run(torch.int8, False)}
    serving.write_json_atomic(RESULTS / "engine-marlin-layer-h200.json", errors)
    assert errors["w4a16"] < 0.01, errors
    assert errors["w4a8"] < 0.05, errors
    assert errors["w4a8_nofold"] > 0.5, errors
