"""drafter/: the capture (Hessian statistics, held-out rows, resume), the error table, the fast-variant writer
(prepare_status, hard links, vLLM's CPU load), and GPTQ against round-to-nearest when the quant venv exists."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen_serving import knobs
from qwen_serving.checkpoint import drafter_capture, drafter_quantize, int4, prepare_status
from qwen_serving.checkpoint.drafter_capture import Stats
from qwen_serving.checkpoint.model_dir import CheckpointError, ModelDir
from qwen_serving.checkpoint.scripted_reference import Reference
from tests.helpers.prepared_vllm_load import load_report
from tests.helpers.tiny_checkpoint import REPO, make_tiny, tree_state

PROMPTS, TOKENS, EVERY = 6, 24, 3
MTP_LINEARS = ["mtp.fc", *(f"mtp.layers.0.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")),
               *(f"mtp.layers.0.self_attn.{p}" for p in ("k_proj", "o_proj", "q_proj", "v_proj"))]


def _capture(model: Path, out: Path, **kwargs) -> Stats:
    return drafter_capture.capture(model, out, max_prompts=PROMPTS, max_tokens=TOKENS, held_out_every=EVERY,
                                   **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def captured(tiny, tmp_path_factory) -> tuple[Path, Stats]:
    out = tmp_path_factory.mktemp("capture") / "tiny.capture.safetensors"
    return out, _capture(tiny, out)


def test_capture_covers_the_lm_head_and_every_mtp_linear(tiny):
    index = json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"]
    assert drafter_capture.fast_variant_modules(index) == ["lm_head", *sorted(MTP_LINEARS)]


def test_hessians_are_the_sums_of_the_calibration_rows(tiny, captured):
    out, stats = captured
    prompts = drafter_capture.tokenize(tiny, drafter_capture.load_prompt_items(None)[:PROMPTS], TOKENS)
    calib = [ids for n, ids in enumerate(prompts) if n % EVERY != EVERY - 1]
    held = [ids for n, ids in enumerate(prompts) if n % EVERY == EVERY - 1]
    assert held and calib
    ref = Reference(tiny)
    with torch.no_grad():
        rows = [ref.hidden(ids) for ids in calib]
        mtp_in = [torch.cat([ref._norm(ref.embed(ids[1:]), "mtp.pre_fc_norm_embedding.weight"),
                             ref._norm(h[:-1], "mtp.pre_fc_norm_hidden.weight")], -1) for ids, h in zip(calib, rows, strict=True)]
        mtp_out = [ref.mtp_step(ids[1:], h[:-1], torch.arange(1, len(ids))) for ids, h in zip(calib, rows, strict=True)]
    head = torch.cat(rows + mtp_out).double()
    fc = torch.cat(mtp_in).double()
    assert stats.rows["lm_head"] == len(head) == sum(2 * len(ids) - 1 for ids in calib)
    assert stats.rows["mtp.fc"] == len(fc) == sum(len(ids) - 1 for ids in calib)
    assert torch.allclose(stats.hessian["lm_head"], head.T @ head, rtol=1e-5, atol=1e-6)
    assert torch.allclose(stats.hessian["mtp.fc"], fc.T @ fc, rtol=1e-5, atol=1e-6)
    # held-out prompts are kept raw and never enter the Hessian
    assert len(stats.held_out_rows("mtp.fc")) == sum(len(ids) - 1 for ids in held)
    loaded = Stats.load(out)
    assert loaded.meta["done"] == loaded.meta["prompts"] == len(prompts)
    assert all(torch.equal(loaded.hessian[m], stats.hessian[m]) for m in stats.modules)
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".tmp")]


def test_an_interrupted_capture_resumes_to_the_same_statistics(tiny, captured, tmp_path, monkeypatch):
    out = tmp_path / "resumed.safetensors"
    real = drafter_capture.observe_prompt
    calls = []

    def dies_on_the_fourth(ref, ids, stats, held_out):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        real(ref, ids, stats, held_out)

    monkeypatch.setattr(drafter_capture, "observe_prompt", dies_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        _capture(tiny, out)
    assert Stats.load(out).meta["done"] == 3
    monkeypatch.setattr(drafter_capture, "observe_prompt", real)
    resumed = _capture(tiny, out)
    full = captured[1]
    assert resumed.rows == full.rows
    # equal up to float64 rounding (the CPU GEMM's blocking may differ between two runs of the same sum)
    assert all(torch.allclose(resumed.hessian[m], full.hessian[m], rtol=1e-12, atol=1e-12) for m in full.modules)
    assert all(torch.allclose(resumed.held_out_rows(m), full.held_out_rows(m), rtol=1e-6, atol=1e-6)
               for m in full.modules)


def test_a_capture_of_another_prompt_set_is_refused(tiny, captured, tmp_path):
    out = tmp_path / "c.safetensors"
    shutil.copy(captured[0], out)
    before = out.read_bytes()
    with pytest.raises(CheckpointError, match="another prompt set"):
        drafter_capture.capture(tiny, out, max_prompts=PROMPTS - 1, max_tokens=TOKENS, held_out_every=EVERY)
    assert out.read_bytes() == before


def test_output_error_and_grid_rounding():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=gen)
    x = torch.randn(50, 256, generator=gen)
    assert drafter_quantize.output_error(x, weight, weight) == 0.0
    assert drafter_quantize.output_error(x, weight, torch.zeros_like(weight)) == pytest.approx(1.0)
    assert drafter_quantize.output_error(x, weight, 1.1 * weight) == pytest.approx(0.1)
    codes, scales = drafter_quantize.rtn(weight)
    assert scales.dtype == torch.float16 and torch.equal(scales.float(), scales.float().bfloat16().float())
    restored = drafter_quantize.dequantize(codes, scales)
    # round-to-nearest: inside the code range no weight moves further than half a step of its group; a
    # group's extreme sits at 7.5 steps and clamps to code 7 (half a step, plus the bf16 rounding of the scale, < 2^-8 of it)
    step = scales.float().repeat_interleave(int4.GROUP_SIZE, dim=1)
    error = (weight - restored).abs()
    inner = codes.abs() < int4.CODE_MAX
    assert bool((error[inner] <= step[inner] / 2 + 1e-6).all()) and bool((error <= 0.53 * step).all())
    # a weight already on the grid comes back exactly
    assert torch.equal(drafter_quantize.codes_on_grid(restored, scales.float()), codes)


def test_the_table_flags_a_matrix_where_gptq_does_not_win():
    def row(module, rtn_int4py, rtn, gptq):
        return {"module": module, "shape": [64, 128], "calibration_rows": 10, "held_out_rows": 5,
                "rtn_int4py": rtn_int4py, "rtn": rtn, "gptq": gptq, "grid": "minmax/7.5"}

    rows = [row("a", 0.12, 0.11, 0.07), row("b", 0.10, 0.11, 0.105), row("tie", 0.002, 0.002, 0.002),
            row("zero", 0.0, 0.0, 0.0)]
    assert drafter_quantize.gptq_beats_rtn(rows) == ["b", "tie"]  # an all-zero matrix is exact for every method
    table = drafter_quantize.table_markdown(rows)
    assert "| `a` | 64 x 128 | 10 | 5 | 0.12000 | 0.11000 | 0.07000 | minmax/7.5 | 0.636 |" in table
    assert "| `b` |" in table and "1.050 |" in table and "exact (zero matrix) |" in table


def test_gptq_keeps_the_grid_with_the_lower_calibration_error():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 256, generator=gen)
    x = torch.randn(300, 256, generator=gen)
    codes, scales = drafter_quantize.rtn(weight)
    approx = drafter_quantize.dequantize(codes, scales)
    hessian = x.double().T @ x.double()
    expected = float(((x.double() @ (weight - approx).double().T) ** 2).sum())
    assert drafter_quantize.calibration_error(weight, approx, hessian) == pytest.approx(expected, rel=1e-9)


def _variant(tiny: Path, capture: Path, root: Path, method: str, python: str = sys.executable) -> tuple[Path, Path]:
    base = root / "Qwen3.8-27B-W4A16-AutoRound"
    shutil.copytree(tiny, base)
    proc = subprocess.run([python, "drafter/quantize.py", str(base), "--capture", str(capture), "--method", method,
                           "--table", str(root / "table.md")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return base, root / "Qwen3.8-27B-W4A16-AutoRound-fast"


def _check_variant(base: Path, fast: Path, before: dict[str, str], method: str) -> None:
    assert tree_state(base) == before  # the base is left as it was
    assert fast.name == Path(knobs.FAST_MODEL).name  # the name MODEL=auto looks for
    assert prepare_status.status(fast, deep=True) == 0
    model = ModelDir.open(fast)
    record = model.manifest()["steps"]["fast_variant"]
    assert record["script"] == "drafter/quantize.py" and record["method"] == method
    assert sorted(r["module"] for r in record["held_out_error"]) == ["lm_head", *sorted(MTP_LINEARS)]
    unchanged = [s for s in set(model.weight_map.values()) if (base / s).exists()]
    assert unchanged and all((fast / s).stat().st_ino == (base / s).stat().st_ino for s in unchanged)
    report = load_report(fast)
    assert report["lm_head_bits"] == report["drafter_lm_head_bits"] == 4, report
    assert report["mtp_qkv_bits"] == report["mtp_fc_bits"] == 4, report
    assert report["lm_head_bytes_equal"] and report["mtp_qkv_bytes_equal"], report


def test_the_rtn_variant_passes_prepare_status_and_loads_in_vllm(tiny, captured, tmp_path):
    """The variant writer, on round-to-nearest codes (the baseline any venv can make)."""
    base, fast = _variant(tiny, captured[0], tmp_path, "rtn")
    _check_variant(base, fast, tree_state(tiny), "rtn")
    proc = subprocess.run([sys.executable, "drafter/quantize.py", str(base), "--capture", str(captured[0]),
                           "--method", "rtn"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "exists" in proc.stderr


QUANT_PYTHON = Path(os.environ.get("QS_QUANT_VENV", REPO / "drafter" / ".venv-quant")) / "bin" / "python"


@pytest.mark.skipif(not QUANT_PYTHON.exists(),
                    reason=f"no quant venv at {QUANT_PYTHON.parent.parent} (bash drafter/install.sh makes it; "
                           "llmcompressor cannot live in the test venv beside vLLM 0.28.0)")
def test_gptq_beats_round_to_nearest_on_every_matrix_and_the_variant_loads(tiny, tmp_path):
    # GPTQ needs several calibration rows per input column (the MTP's widest input is 2 x 256 here): a
    # Hessian from fewer rows is rank-poor, GPTQ then fits the calibration set and loses on held-out rows
    capture = tmp_path / "gptq.capture.safetensors"
    drafter_capture.capture(tiny, capture, max_prompts=30, max_tokens=160, held_out_every=5, save_every=10)
    base, fast = _variant(tiny, capture, tmp_path, "gptq", str(QUANT_PYTHON))
    table = ModelDir.open(fast).manifest()["steps"]["fast_variant"]["held_out_error"]
    assert drafter_quantize.gptq_beats_rtn(table) == [], table
    _check_variant(base, fast, tree_state(tiny), "gptq")
