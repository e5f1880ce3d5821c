"""bench/gpu/scripted_layers.py (the GPU diagnostic: where vLLM's forward parts from the reference) on the CPU:
its fused-module mapping, comparison maths and per-layer hooks on vLLM 0.28.0's own qwen3_5 model built on the
CPU over the tiny scripted checkpoint (tests/helpers/scripted_layers_cpu.py), and `Reference.layer_states`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import scripted_layers as sl
from qwen_serving.checkpoint import scripted, synth
from qwen_serving.checkpoint.scripted_reference import LM, Reference

REPO = Path(__file__).resolve().parents[1]
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"],
          "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"], "in_proj_ba": ["in_proj_b", "in_proj_a"]}


def run_cpu_helper(*argv: str, **env: str) -> str:
    """tests/helpers/scripted_layers_cpu.py in a fresh process (it installs vLLM's CPU stand-ins); its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])),
           "OMP_NUM_THREADS": "1", **env}
    script = REPO / "tests" / "helpers" / "scripted_layers_cpu.py"
    proc = subprocess.run([sys.executable, str(script), *argv], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scripted-layers") / "tiny"
    assert synth.main(["--size", "tiny", "--out", str(out), "--seed", "0", "--behaviour", "scripted"]) == 0
    return out


@pytest.fixture(scope="module")
def ref(tiny) -> Reference:
    return Reference(tiny)


@pytest.fixture(scope="module")
def ids(tiny) -> list[int]:
    design = scripted.Design.read(tiny)
    return design.walk(design.active[7], 23)


@pytest.fixture(scope="module")
def cpu_run(tiny, ids) -> dict:
    out = tiny.parent / "layers.json"
    run_cpu_helper(str(tiny), str(out), *map(str, ids))
    return json.loads(out.read_text())


def test_fused_modules_map_to_the_checkpoint_matrices_in_order():
    assert sl.checkpoint_components("language_model.model.layers.3.self_attn.qkv_proj", PACKED) == [
        f"{LM}layers.3.self_attn.q_proj", f"{LM}layers.3.self_attn.k_proj", f"{LM}layers.3.self_attn.v_proj"]
    assert sl.checkpoint_components("language_model.model.layers.12.linear_attn.in_proj_qkvz", PACKED) == [
        f"{LM}layers.12.linear_attn.in_proj_qkv", f"{LM}layers.12.linear_attn.in_proj_z"]
    assert sl.checkpoint_components("language_model.model.layers.0.mlp.down_proj", PACKED) == [
        f"{LM}layers.0.mlp.down_proj"]
    with pytest.raises(ValueError):
        sl.checkpoint_components("language_model.lm_head", PACKED)


def test_compare_measures_error_and_scale():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    same = sl.compare(x, x)
    assert same["rel_err"] == 0 and same["ratio"] == pytest.approx(1.0)
    scaled = sl.compare(100 * x, x)
    assert scaled["ratio"] == pytest.approx(100.0) and scaled["rel_err"] == pytest.approx(99.0)
    assert sl.compare(-x, x)["rel_err"] == pytest.approx(2.0)


def test_layer_states_are_the_reference_forward(ref, ids):
    states = ref.layer_states(ids)
    assert len(states["layers"]) == len(ref.layer_types)
    assert torch.allclose(states["final"], ref.hidden(ids), atol=1e-6)
    stream = states["embedding"]
    for layer in states["layers"]:  # each layer adds its two branches to the stream
        stream = stream + layer["mixer"] + layer["mlp"]
        assert torch.allclose(layer["stream"], stream, atol=1e-6)
    # the branches are small by design: 0.01 of the stream or less
    assert max(sl.rms(layer[part]) for layer in states["layers"] for part in ("mixer", "mlp")) < 0.05
    partial = ref.layer_states(ids, layers=2)
    assert len(partial["layers"]) == 2 and partial["final"] is None
    assert torch.equal(partial["layers"][1]["stream"], states["layers"][1]["stream"])


def test_every_vllm_linear_computes_the_reference_weights(cpu_run, ref):
    rows = {row["module"]: row for row in cpu_run["linears"]}
    assert {"embed_tokens", "lm_head"} <= set(rows)
    decoder = [row for row in cpu_run["linears"] if row["module"] not in ("embed_tokens", "lm_head")]
    kinds = {row["module"].split(".")[-1] for row in decoder}
    assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"} <= kinds
    layers = {int(row["module"].split("layers.")[1].split(".")[0]) for row in decoder}
    assert layers == set(range(len(ref.layer_types)))
    for row in cpu_run["linears"]:
        assert row["rel_err"] < 1e-5, row
        assert row.get("out_cols", 0) == row.get("ref_cols", 0)
    # the siblings read off the checks: each designed branch matrix is 0.1 of its unscaled twin
    ratios = sl.sibling_ratios(cpu_run["linears"])
    assert {r["branch"].rsplit(".", 1)[-1] for r in ratios} == {"v_proj", "up_proj", "in_proj_z"}
    assert all(0.07 < r["weight_rms_ratio"] < 0.14 for r in ratios), ratios


def test_the_mapping_check_fails_on_a_wrong_component_order(cpu_run):
    # reversing a fused module's components must show (in_proj_ba's two halves can be alike: not required)
    off = {row["module"].split(".")[-1] for row in cpu_run["reversed"] if row["rel_err"] > 0.5}
    assert {"qkv_proj", "gate_up_proj", "in_proj_qkvz"} <= off


def test_hooks_follow_vllms_forward_layer_by_layer(cpu_run, ref):
    rows = cpu_run["layers"]
    assert [row["kind"] for row in rows] == ref.layer_types
    for row in rows:
        for part in ("stream", "mixer", "mlp"):
            assert row[part] is not None, (row["layer"], part)
            # float32 both sides; a branch is ~0.005 rms, so its relative error carries the attention op's rounding
            assert row[part]["rel_err"] < (1e-5 if part == "stream" else 1e-3), (row["layer"], part, row[part])
    assert cpu_run["final"]["rel_err"] < 1e-5
    assert sl.first_parted(rows) is None
    # split at the output GEMMs (every layer of the tiny checkpoint): both halves agree
    assert [row["layer"] for row in cpu_run["in_situ"]] == list(range(len(ref.layer_types)))
    for row in cpu_run["in_situ"]:
        for part in ("mixer", "mlp"):
            assert row[part]["input"]["rel_err"] < 1e-5, (row["layer"], part, row[part])
            assert row[part]["output_gemm"]["rel_err"] < 1e-5, (row["layer"], part, row[part])
            assert row[part]["before_gemm"]["rel_err"] < 1e-3, (row["layer"], part, row[part])


def test_a_full_scale_branch_is_found_where_it_is(cpu_run):
    scaled_row = cpu_run["scaled_linear"]
    assert scaled_row["ratio"] == pytest.approx(100.0, rel=1e-3) and scaled_row["rel_err"] > 50
    rows = cpu_run["scaled"]
    assert rows[0]["stream"]["rel_err"] < 1e-4  # before the scaled matrix: unchanged
    assert rows[1]["mlp"]["ratio"] == pytest.approx(100.0, rel=0.05)
    parted = sl.first_parted(rows)
    assert parted is not None and parted["layer"] == 1 and parted["mlp_ratio"] > 50
    # split at its output GEMM, the blame falls on the GEMM, not on what feeds it
    split = cpu_run["scaled_in_situ"][1]["mlp"]
    assert split["output_gemm"]["rel_err"] > 50 and split["before_gemm"]["rel_err"] < 1e-3
    assert split["input"]["rel_err"] < 1e-5  # the layer's own MLP input is still right
    assert cpu_run["scaled_in_situ"][2]["mixer"]["input"]["rel_err"] > sl.PARTED  # the next one's is not
    report = {"linears": [scaled_row], "layers": rows, "in_situ": cpu_run["scaled_in_situ"]}
    summary = sl.summarize(report)
    assert summary["in_situ_off"][0][:3] == [1, "mlp", "output_gemm"]
    assert summary["linears_off"] == [scaled_row["module"]]
    assert summary["first_parted_layer"]["layer"] == 1
    assert summary["largest_branch_ratio"][:2] == [1, "mlp"] or summary["largest_branch_ratio"][:2] == (1, "mlp")


def test_the_scripts_main_on_the_cpu_model(tiny, tmp_path):
    """main() end to end with vllm.LLM replaced by the CPU-built model (tests/helpers/scripted_layers_cpu.py):
    the engine arguments, every phase in OUT.json, and a verdict of agreement on a forward that agrees."""
    out, record = tmp_path / "layers.json", tmp_path / "llm.json"
    stdout = run_cpu_helper("--main", str(tiny), "--out", str(out), "--tokens", "12", "--budget-s", "600",
                            QS_CPU_LLM_RECORD=str(record))
    assert "summary" in stdout
    llm = json.loads(record.read_text())
    assert llm["kwargs"]["enforce_eager"] and llm["kwargs"]["gdn_prefill_backend"] == "triton"
    assert llm["env"] == sl.ENGINE_ENV
    report = json.loads(out.read_text())
    assert set(report["phases_s"]) == {"boot", "linears", "engine", "layers", "logits"}
    assert report["skipped"] == [] and report["errors"] == {}
    summary = report["summary"]
    assert summary["linears_off"] == [] and summary["linears_checked"] > 2
    assert summary["first_parted_layer"] is None and summary["answer_is_chain"]
    assert summary["hooks_captured"] > 0 and "in_situ_off" not in summary and len(report["in_situ"]) == 4
    assert summary["logits"]["argmax_agrees"] == summary["logits"]["positions"] == 12
    assert summary["logits"]["reference_argmax_is_chain"] == 12
    assert report["logits"]["rel_err"] < 1e-4
