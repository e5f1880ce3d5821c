"""drafter/ for the DFlash2 drafter: the float32 forward against vLLM's, the capture's Hessians, resume, the
W4A16 writer (prepare_status, vLLM's CPU load, both layouts), int4 q/k/v before and after
patches/dflash2-quantized-kv.patch (stock vLLM 0.28.0 refuses them; patched, the context-KV precompute equals the
unquantized path on the dequantized weights, and a bf16 drafter's is unchanged), clear errors, and GPTQ against
round-to-nearest when the quant venv exists.

The drafter is the scripted tiny one with `--live-body` (random o_proj / down_proj and norm weights), so
every layer acts on the residual stream and every norm weight matters to the comparison with vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_serving.checkpoint import dflash2_format, drafter_capture, drafter_quantize, prepare_status, synth
from qwen_serving.checkpoint import scripted_dflash2 as sd2
from qwen_serving.checkpoint.dflash2_reference import Dflash2Forward
from qwen_serving.checkpoint.drafter_capture import Stats
from qwen_serving.checkpoint.model_dir import ModelDir
from qwen_serving.checkpoint.scripted_reference import Reference
from tests.helpers.engine_trees import tree
from tests.helpers.tiny_checkpoint import REPO, tree_state

PROMPTS, TOKENS, EVERY, ANCHOR_EVERY = 6, 24, 3, 4
QUANT_PYTHON = Path(os.environ.get("QS_QUANT_VENV", REPO / "drafter" / ".venv-quant")) / "bin" / "python"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])),
       "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dflash2-gptq") / "tiny8"
    assert synth.main(["--size", "tiny", "--layers", "8", "--out", str(out), "--seed", "0", "--behaviour", "scripted"]) == 0
    return out


@pytest.fixture(scope="module")
def drafter(target) -> Path:
    path = target.parent / "dflash2-live"
    assert sd2.main([str(target), "--out", str(path), "--agree", "0.7", "--seed", "0", "--live-body"]) == 0
    return path


def _capture(target: Path, drafter: Path, out: Path, **kwargs) -> Stats:
    return drafter_capture.capture_dflash2(target, drafter, out, max_prompts=PROMPTS, max_tokens=TOKENS,
                                           held_out_every=EVERY, anchor_every=ANCHOR_EVERY, **kwargs)


@pytest.fixture(scope="module")
def captured(target, drafter) -> tuple[Path, Stats]:
    out = target.parent / "dflash2.capture.safetensors"
    return out, _capture(target, drafter, out)


def _aux(ref: Reference, fwd: Dflash2Forward, ids: list[int]) -> torch.Tensor:
    states = ref.layer_states(ids, max(fwd.target_layer_ids) + 1)
    return torch.cat([states["layers"][t]["stream"] for t in fwd.target_layer_ids], -1)


def test_the_forward_is_vllms_dflash2_model(target, drafter, tmp_path):
    """vLLM 0.28.0's DFlash2Qwen3ForCausalLM on the CPU (tests/helpers/dflash2_vllm_forward.py), one block over
    a 20-token context: its final hidden states, the normed context rows its precompute projects, and the input
    of every fc / qkv / o / gate_up / down layer equal this forward's observed inputs. vLLM holds its RoPE
    cos/sin cache in the model dtype (bf16), the one approximation here: 2e-3 relative."""
    ref, fwd = Reference(target), Dflash2Forward(drafter)
    ids = list(range(10, 40))
    anchor = 20
    aux = _aux(ref, fwd, ids)[:anchor]
    block = [ids[anchor]] + [fwd.mask_token_id] * (fwd.block - 1)
    save_file({"aux": aux.contiguous(), "ids": torch.tensor(block)}, str(tmp_path / "in.safetensors"))
    proc = subprocess.run([sys.executable, "tests/helpers/dflash2_vllm_forward.py", str(target), str(drafter),
                           str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")],
                          env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    vllm = load_file(str(tmp_path / "out.safetensors"))
    seen: dict[str, list[torch.Tensor]] = {}
    fwd.observe = lambda module, x: seen.setdefault(module, []).append(x.reshape(-1, x.shape[-1]).clone())
    with torch.no_grad():
        states = fwd.context_states(aux)
        hidden = fwd.blocks(fwd.block_inputs(ref.embed, ids, [anchor]), torch.tensor([anchor]),
                            fwd.context_kv(states, torch.arange(anchor)))[0]

    def close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
        return ours.shape == theirs.shape and float((ours - theirs).abs().max()) <= 2e-3 * float(theirs.abs().max())

    assert close(hidden, vllm["hidden"])
    assert close(seen["fc"][0], vllm["in/model.fc"]) and close(states, vllm["in/context_kv"])
    for i in range(fwd.layers):
        # the context rows reach k_proj / v_proj first (the precompute), the block rows after
        assert torch.equal(seen[f"layers.{i}.self_attn.k_proj"][0], states)
        for ours, theirs in (("self_attn.q_proj", "self_attn.qkv_proj"), ("self_attn.o_proj", "self_attn.o_proj"),
                             ("mlp.gate_proj", "mlp.gate_up_proj"), ("mlp.down_proj", "mlp.down_proj")):
            assert close(seen[f"layers.{i}.{ours}"][-1], vllm[f"in/model.layers.{i}.{theirs}"]), (i, ours)
        assert close(seen[f"layers.{i}.self_attn.k_proj"][1], vllm[f"in/model.layers.{i}.self_attn.qkv_proj"])


def test_the_capture_covers_the_36_matrices(drafter, captured):
    config = json.loads((drafter / "config.json").read_text())
    assert captured[1].modules == dflash2_format.quantizable_modules(config)
    assert len(captured[1].modules) == 36


def test_hessians_are_the_sums_of_the_observed_inputs(target, drafter, captured):
    out, stats = captured
    prompts = drafter_capture.tokenize(target, drafter_capture.load_prompt_items(None)[:PROMPTS], TOKENS)
    calib = [ids for n, ids in enumerate(prompts) if n % EVERY != EVERY - 1]
    held = [ids for n, ids in enumerate(prompts) if n % EVERY == EVERY - 1]
    assert calib and held
    ref, fwd = Reference(target), Dflash2Forward(drafter)
    rows: dict[str, list[torch.Tensor]] = {}
    aux_rows, context_rows = [], []
    fwd.observe = lambda module, x: rows.setdefault(module, []).append(x.reshape(-1, x.shape[-1]).double())
    with torch.no_grad():
        for ids in calib:
            aux = _aux(ref, fwd, ids)
            aux_rows.append(aux.double())
            states = fwd.context_states(aux)
            context_rows.append(states.double())
            anchors = list(range(1, len(ids), ANCHOR_EVERY))
            fwd.blocks(fwd.block_inputs(ref.embed, ids, anchors), torch.tensor(anchors),
                       fwd.context_kv(states, torch.arange(len(ids))))
    for module in stats.modules:
        x = torch.cat(rows[module])
        assert stats.rows[module] == len(x), module
        assert torch.allclose(stats.hessian[module], x.T @ x, rtol=1e-6, atol=1e-6), module
    # fc reads the target's states at target_layer_ids, one row per token ...
    aux = torch.cat(aux_rows)
    assert stats.rows["fc"] == sum(len(ids) for ids in calib)
    assert torch.allclose(stats.hessian["fc"], aux.T @ aux, rtol=1e-6, atol=1e-6)
    # ... and k_proj = q_proj's block rows plus every token's normed context row (the precompute's input)
    blocks = sum(8 * len(range(1, len(ids), ANCHOR_EVERY)) for ids in calib)
    context = torch.cat(context_rows)
    for i in range(fwd.layers):
        q, k = f"layers.{i}.self_attn.q_proj", f"layers.{i}.self_attn.k_proj"
        assert stats.rows[q] == blocks and stats.rows[k] == blocks + len(context)
        assert torch.allclose(stats.hessian[k] - stats.hessian[q], context.T @ context, rtol=1e-5, atol=1e-5)
    # held-out prompts are kept raw, never in a Hessian
    assert len(stats.held_out_rows("fc")) == sum(len(ids) for ids in held)
    loaded = Stats.load(out)
    assert loaded.meta["done"] == loaded.meta["prompts"] == len(prompts) and loaded.meta["anchor_every"] == ANCHOR_EVERY


def test_an_interrupted_capture_resumes_to_the_same_statistics(target, drafter, captured, tmp_path, monkeypatch):
    out = tmp_path / "resumed.safetensors"
    real = drafter_capture.observe_dflash2_prompt
    calls = []

    def dies_on_the_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(drafter_capture, "observe_dflash2_prompt", dies_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        _capture(target, drafter, out)
    assert Stats.load(out).meta["done"] == 2
    monkeypatch.setattr(drafter_capture, "observe_dflash2_prompt", real)
    resumed, full = _capture(target, drafter, out), captured[1]
    assert resumed.rows == full.rows
    assert all(torch.allclose(resumed.hessian[m], full.hessian[m], rtol=1e-12, atol=1e-12) for m in full.modules)
    with pytest.raises(drafter_capture.CheckpointError, match="another target or --anchor-every"):
        drafter_capture.capture_dflash2(target, drafter, out, max_prompts=PROMPTS, max_tokens=TOKENS,
                                        held_out_every=EVERY, anchor_every=ANCHOR_EVERY + 1)


def _quantize(drafter: Path, capture: Path, out: Path, *extra: str, python: str = sys.executable):
    return subprocess.run([python, "drafter/quantize.py", str(drafter), "--dflash2", "--capture", str(capture),
                           "--out", str(out), *extra], cwd=REPO, capture_output=True, text=True, timeout=900)


def _tree_env(name: str) -> dict[str, str]:
    """ENV with one vLLM tree first on the path: "pristine" (the venv's copy) or "patched" (tests/run.sh's)."""
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(tree(name).parent), str(REPO)])}


def _vllm_loads(target: Path, drafters: list[Path], vllm: str = "patched") -> list[dict]:
    """tests/helpers/dflash2_vllm_load.py's report for each drafter, all loaded in one child of the `vllm` tree."""
    reports = [drafter.parent / f"{drafter.name}-{vllm}-load.json" for drafter in drafters]
    pairs = [str(x) for drafter, report in zip(drafters, reports, strict=True) for x in (drafter, report)]
    proc = subprocess.run([sys.executable, "tests/helpers/dflash2_vllm_load.py", str(target), *pairs],
                          env=_tree_env(vllm), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(report.read_text()) for report in reports]


def _context_kvs(target: Path, states: Path, vllm: str, runs: dict[str, tuple[Path, str]]) -> dict[str, dict]:
    """tests/helpers/dflash2_context_kv.py in one child of the `vllm` tree: per run name, the K/V vLLM's precompute
    caches for `states` and its buffers, for that run's (drafter, dtype)."""
    outs = {name: states.parent / f"{name}-{vllm}.safetensors" for name in runs}
    jobs = [str(x) for name, (drafter, dtype) in runs.items() for x in (drafter, outs[name], dtype)]
    proc = subprocess.run([sys.executable, "tests/helpers/dflash2_context_kv.py", str(target), str(states), *jobs],
                          env=_tree_env(vllm), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {name: load_file(str(out)) for name, out in outs.items()}


def _check_drafter(target: Path, drafter: Path, quantized: Path, method: str, before: dict[str, str],
                   bf16_qkv: bool = False, report: dict | None = None) -> list[dict]:
    """prepare_status passes, the record says what became int4, and the patched vLLM loads every linear as
    written (int4 ones as CompressedTensorsWNA16, bytes equal to the checkpoint's)."""
    assert tree_state(drafter) == before  # the bf16 drafter is left as it was
    assert prepare_status.status(quantized, deep=True) == 0
    model = ModelDir.open(quantized, require_qwen35=False)
    record = model.manifest()["steps"][dflash2_format.STEP]
    qkv = [m for m in dflash2_format.quantizable_modules(model.config) if dflash2_format.is_qkv(m)]
    assert record["script"] == "drafter/quantize.py" and record["method"] == method
    assert len(record["modules"]) == (21 if bf16_qkv else 36) and record["kept_bf16"] == (qkv if bf16_qkv else [])
    assert not [p for p in quantized.parent.iterdir() if p.name.startswith(f".{quantized.name}.")
                and not p.name.endswith(".lock")]  # nothing half-written beside it
    report = report or _vllm_loads(target, [quantized])[0]
    assert report["loaded"], report
    layers = report["layers"]
    assert len(layers) == 1 + 4 * 5 and all(layer["bytes_equal"] for layer in layers.values()), layers
    for name, layer in layers.items():
        expected = None if bf16_qkv and name.endswith("qkv_proj") else 4
        assert layer["bits"] == expected and (layer["scheme"] == "CompressedTensorsWNA16") == bool(expected), name
    return record["held_out_error"]


@pytest.fixture(scope="module")
def rtn36(drafter, captured, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The default layout, all 36 matrices int4 (round-to-nearest: any venv), and the bf16 drafter's state before."""
    before = tree_state(drafter)
    out = tmp_path_factory.mktemp("rtn36") / "dflash2-W4A16"
    proc = _quantize(drafter, captured[0], out, "--method", "rtn")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, before


@pytest.fixture(scope="module")
def bf16qkv(drafter, captured, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The --bf16-qkv layout (21 matrices int4, round-to-nearest), and the bf16 drafter's state before."""
    before = tree_state(drafter)
    out = tmp_path_factory.mktemp("bf16qkv") / "dflash2-W4A16-bf16qkv"
    proc = _quantize(drafter, captured[0], out, "--method", "rtn", "--bf16-qkv")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, before


@pytest.fixture(scope="module")
def loads(target, rtn36, bf16qkv) -> dict[tuple[str, str], dict]:
    """(tree, layout) -> load report: each tree loads both layouts in one child, the 36-matrix one last (stock
    vLLM fails it, so a failed load is the last thing that child does)."""
    layouts = {"bf16qkv": bf16qkv[0], "rtn36": rtn36[0]}
    return {(vllm, layout): report for vllm in ("patched", "pristine")
            for layout, report in zip(layouts, _vllm_loads(target, list(layouts.values()), vllm), strict=True)}


def test_the_rtn_drafter_passes_prepare_status_and_loads_in_vllm(target, drafter, captured, rtn36, loads, capsys):
    out, before = rtn36
    capsys.readouterr()
    _check_drafter(target, drafter, out, "rtn", before, report=loads["patched", "rtn36"])
    assert "dflash2-quantized-kv.patch" in capsys.readouterr().out  # the int4 q/k/v line names what loads them
    again = _quantize(drafter, captured[0], out, "--method", "rtn")
    assert again.returncode == 2 and "exists" in again.stderr


def test_int4_qkv_loads_in_the_patched_vllm_only(loads):
    """Before / after dflash2-quantized-kv.patch: stock vLLM 0.28.0 fails the 36-matrix drafter at the end of
    load_weights (upstream vllm#51581), the patched tree loads it with every qkv_proj int4."""
    pristine, patched_load = loads["pristine", "rtn36"], loads["patched", "rtn36"]
    assert not pristine["loaded"], pristine
    assert "AttributeError" in pristine["error"] and "'weight'" in pristine["error"], pristine
    assert "_build_context_kv_buffers" in pristine["traceback"], pristine
    assert patched_load["loaded"], patched_load
    qkv = {name: layer for name, layer in patched_load["layers"].items() if name.endswith("qkv_proj")}
    assert len(qkv) == 5 and all(layer["bits"] == 4 and layer["bytes_equal"] for layer in qkv.values()), qkv


def test_bf16_qkv_keeps_q_k_v_bf16_and_loads_in_stock_vllm(target, drafter, bf16qkv, loads):
    out, before = bf16qkv
    _check_drafter(target, drafter, out, "rtn", before, bf16_qkv=True, report=loads["patched", "bf16qkv"])
    assert loads["pristine", "bf16qkv"]["loaded"]  # the layout a vLLM without the patch takes


def _states(drafter: Path, path: Path) -> torch.Tensor:
    """Context rows as the precompute receives them (after fc), saved for the helper."""
    hidden = json.loads((drafter / "config.json").read_text())["hidden_size"]
    states = torch.randn(20, hidden, generator=torch.Generator().manual_seed(0))
    save_file({"states": states}, str(path))
    return states


def _dequantized_drafter(drafter: Path, quantized: Path, out: Path) -> None:
    """The bf16 drafter with every q/k/v weight replaced by the int4 drafter's, dequantized (float32): the
    drafter whose unquantized path computes what the int4 weights hold."""
    from safetensors import safe_open

    from qwen_serving.checkpoint import int4

    model = ModelDir.open(quantized, require_qwen35=False)
    tensors = load_file(str(drafter / "model.safetensors"))
    for module in dflash2_format.quantizable_modules(model.config):
        if not dflash2_format.is_qkv(module):
            continue
        with safe_open(str(quantized / model.weight_map[f"{module}.weight_packed"]), framework="pt") as f:
            packed, scales = f.get_tensor(f"{module}.weight_packed"), f.get_tensor(f"{module}.weight_scale")
            rows, cols = f.get_tensor(f"{module}.weight_shape").tolist()
        assert tensors[f"{module}.weight"].shape == (rows, cols)
        tensors[f"{module}.weight"] = int4.dequantize_int4_groups(int4.unpack_int4(packed, cols), scales.float())
    out.mkdir()
    (out / "config.json").write_text((drafter / "config.json").read_text())
    save_file(tensors, str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def context_kvs(target, drafter, rtn36, tmp_path_factory) -> tuple[torch.Tensor, dict[tuple[str, str], dict]]:
    """The states, and (tree, run) -> what dflash2_context_kv.py wrote, one child per tree: "bf16", the bf16
    drafter at its dtype (first, as a fresh process would), then "float32": the 36-matrix int4 drafter (patched)
    or the bf16 drafter with its q/k/v dequantized from it (pristine)."""
    root = tmp_path_factory.mktemp("context-kv")
    states_path, reference = root / "states.safetensors", root / "dequantized"
    states = _states(drafter, states_path)
    _dequantized_drafter(drafter, rtn36[0], reference)
    runs = {"pristine": {"bf16": (drafter, "auto"), "float32": (reference, "float32")},
            "patched": {"bf16": (drafter, "auto"), "float32": (rtn36[0], "float32")}}
    return states, {(vllm, name): kv for vllm, jobs in runs.items()
                    for name, kv in _context_kvs(target, states_path, vllm, jobs).items()}


def _relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    assert ours.shape == theirs.shape
    return float((ours - theirs).abs().max() / theirs.abs().max())


def test_int4_context_kv_is_the_unquantized_path_on_the_dequantized_weights(drafter, context_kvs):
    """The patched precompute of the 36-matrix drafter (each layer's int4 qkv_proj through vLLM's quant method
    down to MarlinLinearKernel.apply_weights, whose CUDA GEMM a CPU stand-in replaces) caches the K/V that stock
    vLLM's fused bf16-path GEMM computes from the dequantized q/k/v. Both in float32, so only summation order
    differs; on a GPU in bf16 the difference is bf16 rounding (not run)."""
    states, kv = context_kvs
    quantized, unquantized = kv["patched", "float32"], kv["pristine", "float32"]
    layers = len(unquantized["k_norm_weights"])
    # the per-layer path: one Marlin GEMM per layer's qkv_proj, in layer order, and no fused weight
    assert quantized["marlin_calls"].tolist() == list(range(layers)) and "fused_kv_weight" not in quantized
    assert unquantized["marlin_calls"].numel() == 0 and "fused_kv_weight" in unquantized  # vLLM's fused GEMM
    for i in range(layers):
        for kind in ("k", "v"):
            assert _relative_error(quantized[f"{kind}.{i}"], unquantized[f"{kind}.{i}"]) < 1e-5, (kind, i)
    # the comparison can tell weights apart: the bf16 drafter's own (unquantized) q/k/v give other K/V
    fwd = Dflash2Forward(drafter)
    normed = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + fwd.eps) * fwd.w["hidden_norm.weight"]
    with torch.no_grad():
        original = fwd.context_kv(normed, torch.arange(len(states)))
    assert all(_relative_error(quantized[f"v.{i}"], original[i][1]) > 1e-2 for i in range(layers))


def test_the_bf16_drafter_s_buffers_and_context_kv_are_unchanged_by_the_patch(context_kvs):
    """The hook declines a bf16 qkv_proj: pristine and patched vLLM build the same fused K/V weight and K-norm
    weights at load and cache the same K/V, byte for byte (bf16, the drafter's dtype)."""
    pristine, patched = context_kvs[1]["pristine", "bf16"], context_kvs[1]["patched", "bf16"]
    assert pristine["fused_kv_weight"].dtype == torch.bfloat16 and patched["marlin_calls"].numel() == 0
    assert sorted(pristine) == sorted(patched)
    for name in pristine:
        assert torch.equal(pristine[name], patched[name]), name


def test_a_wrong_directory_is_a_clear_error(target, drafter, captured, rtn36, tmp_path):
    proc = _quantize(target, captured[0], tmp_path / "x", "--method", "rtn")
    assert proc.returncode == 2 and "not a DFlash2 drafter" in proc.stderr and not (tmp_path / "x").exists()
    plain = subprocess.run([sys.executable, "drafter/quantize.py", str(drafter), "--method", "rtn", "--capture",
                            str(captured[0]), "--out", str(tmp_path / "y")], cwd=REPO, capture_output=True, text=True)
    assert plain.returncode == 2 and "pass --dflash2" in plain.stderr and not (tmp_path / "y").exists()
    capture = subprocess.run([sys.executable, "drafter/capture.py", str(target), "--dflash2", str(target), "--out",
                              str(tmp_path / "c.safetensors")], cwd=REPO, capture_output=True, text=True)
    assert capture.returncode == 2 and "not a DFlash2 drafter" in capture.stderr
    again = _quantize(rtn36[0], captured[0], tmp_path / "z", "--method", "rtn")  # a quantized drafter as input
    assert again.returncode == 2 and "already quantized" in again.stderr


@pytest.mark.skipif(not QUANT_PYTHON.exists(),
                    reason=f"no quant venv at {QUANT_PYTHON.parent.parent} (bash drafter/install.sh makes it; "
                           "llmcompressor cannot live in the test venv beside vLLM 0.28.0)")
def test_gptq_beats_round_to_nearest_on_every_matrix_and_the_drafter_loads(target, drafter, tmp_path):
    # enough calibration rows per input column: fc's input is 5 x 256 wide here, one row per token
    capture = tmp_path / "gptq.capture.safetensors"
    drafter_capture.capture_dflash2(target, drafter, capture, max_prompts=30, max_tokens=160, held_out_every=5,
                                    save_every=10)
    before = tree_state(drafter)
    out = tmp_path / "dflash2-W4A16"
    proc = _quantize(drafter, capture, out, python=str(QUANT_PYTHON))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = _check_drafter(target, drafter, out, "gptq", before)
    assert len(table) == 36 and drafter_quantize.gptq_beats_rtn(table) == [], table
    # q/k/v kept bf16 (--bf16-qkv): the other 21
    kept = _quantize(drafter, capture, tmp_path / "dflash2-W4A16-bf16qkv", "--bf16-qkv", python=str(QUANT_PYTHON))
    assert kept.returncode == 0, kept.stdout[-3000:] + kept.stderr[-3000:]
    record = ModelDir.open(tmp_path / "dflash2-W4A16-bf16qkv", require_qwen35=False).manifest()["steps"][dflash2_format.STEP]
    assert len(record["held_out_error"]) == 21 and drafter_quantize.gptq_beats_rtn(record["held_out_error"]) == []
