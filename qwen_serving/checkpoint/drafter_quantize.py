"""The calibrated int4 drafter matrices: GPTQ (llmcompressor) on captured Hessians, the error table, the variant.

Each matrix becomes W4A16 group-128 symmetric compressed-tensors (`int4.py`'s pack-quantized
layout, what vLLM loads with Marlin). GPTQ proper is llmcompressor's `quantize_weight` on the
captured 2 sum(x^T x) / rows (its own Hessian normalisation), dampening 0.01, block 128, no act-order
(Marlin W4A16 without g_idx); it needs the quant venv (drafter/install.sh). The scale grid is fixed
before GPTQ runs, and two are tried: llmcompressor's memoryless min-max observer (max|w| / 7.5 per
group of 128) and int4.py's max|w| / 7 (the group's extreme exactly on code +-7, which represents a
weight already on that grid); the one with the lower error on the *calibration* rows, tr(D H D^T),
is kept. Scales are rounded to bf16 before the codes are chosen, because vLLM holds them as bf16
parameters, then stored as fp16 like every int4 scale here (a bf16 value is an fp16 value at these
magnitudes). `rtn` is round-to-nearest on the min-max grid (any venv, no llmcompressor). The error
table compares GPTQ with round-to-nearest on its own grid and with `int4.quantize_int4_groups` (the
repo's RTN) on the held-out rows: relative output error ||X (W - Q)^T|| / ||X W^T|| (Frobenius).

The fast variant is written as `hub.build_fast_variant` composes the fetched one (a new model
directory beside the base: unchanged shards hard-linked, the new modules' tensors in a new shard,
the quantization_config extended, prepared.json's `fast_variant` step), so the launcher's
MODEL=auto and prepare_status treat it as they treat the fetched variant.

The DFlash2 drafter (`build_dflash2`): the same GPTQ on its captured matrices, written as a new drafter
directory in the layout the patched vLLM 0.28.0 loads (dflash2_format.py: all 36 matrices int4, or q/k/v
bf16 when asked), step `dflash2_w4a16` in its prepared.json.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from qwen_serving.checkpoint import dflash2_format, hub, int4, steps, transaction
from qwen_serving.checkpoint.console import say
from qwen_serving.checkpoint.drafter_capture import Stats, model_digest
from qwen_serving.checkpoint.model_dir import CheckpointError, ModelDir
from qwen_serving.checkpoint.rewrite import apply_change

METHODS = ("gptq", "rtn")
DAMPENING = 0.01  # llmcompressor's default dampening_frac
SCRIPT = "drafter/quantize.py"


def engine_scales(scales: torch.Tensor) -> torch.Tensor:
    """float32 scales as vLLM multiplies by them: rounded to its bf16 parameters."""
    return scales.to(torch.bfloat16).float()


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight the engine computes with, from int8 codes and stored (fp16) scales."""
    return int4.dequantize_int4_groups(codes, engine_scales(scales))


def codes_on_grid(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The int4 codes of `weight` (fake-quantized or float) on the grid of `scales` (float32, engine-held)."""
    rows, cols = weight.shape
    grouped = weight.float().view(rows, -1, int4.GROUP_SIZE) / scales.unsqueeze(-1)
    return torch.round(grouped).clamp(int4.CODE_MIN, int4.CODE_MAX).to(torch.int8).view(rows, cols)


def _quant_args():
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=int4.GROUP_SIZE,
                            observer="memoryless_minmax")


def _usable(scales: torch.Tensor) -> torch.Tensor:
    # an all-zero group has scale 0; any scale gives it code 0, and 1 keeps the division finite
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def library_grid(weight: torch.Tensor) -> torch.Tensor:
    """llmcompressor's min-max observer scales [rows, groups] (max|w| / 7.5), as the engine holds them."""
    from llmcompressor.observers import Observer

    observer = Observer.load_from_registry("memoryless_minmax", base_name="weight", args=_quant_args())
    observer(weight)
    return _usable(engine_scales(observer.get_qparams()["scale"].float()))


def absmax_grid(weight: torch.Tensor) -> torch.Tensor:
    """int4.py's scales (max|w| / 7: the group's extreme lands on code +-7 exactly), as the engine holds them."""
    return engine_scales(int4.quantize_int4_groups(weight)[1].float())


ROW_CHUNK = 16384  # output rows per GPTQ call: rows are independent given H, so chunks only bound memory


def gptq_on_grid(weight: torch.Tensor, h: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """llmcompressor's quantize_weight on one fixed grid: int8 codes [out, in]."""
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight

    codes = torch.empty(weight.shape, dtype=torch.int8)
    for r0 in range(0, weight.shape[0], ROW_CHUNK):
        w, s = weight[r0 : r0 + ROW_CHUNK], scales[r0 : r0 + ROW_CHUNK]
        quantized, _loss, fell_back = quantize_weight(w[None].clone(), h[None].clone(), s[None],
                                                      torch.zeros_like(s)[None], None, _quant_args(),
                                                      percdamp=DAMPENING)
        if bool(fell_back[0]):
            raise CheckpointError("GPTQ fell back to round-to-nearest (the Hessian is not positive definite): "
                                  "capture more prompts")
        chunk = codes_on_grid(quantized[0], s)
        if not torch.allclose(int4.dequantize_int4_groups(chunk, s), quantized[0], rtol=0, atol=1e-6):
            raise CheckpointError("llmcompressor's GPTQ output is not on its own int4 grid")
        codes[r0 : r0 + ROW_CHUNK] = chunk
    return codes


def calibration_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """sum over the calibration rows of ||x (W - Q)^T||^2 = tr(D H D^T), from the captured H = sum x^T x."""
    total = 0.0
    for r0 in range(0, weight.shape[0], ROW_CHUNK):
        d = (weight[r0 : r0 + ROW_CHUNK] - approx[r0 : r0 + ROW_CHUNK]).double()
        total += float(((d @ hessian) * d).sum())
    return total


def gptq(weight: torch.Tensor, hessian: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """GPTQ of one matrix on each candidate grid; the one with the lower error on the *calibration* rows
    (the held-out rows are only for the table). Returns (codes int8, scales fp16, grid name)."""
    weight = weight.float()
    # llmcompressor's own Hessian is 2 x^T x / samples (helpers.accumulate_hessian, prepare_batch)
    h = (2.0 * hessian / max(rows, 1)).float()
    best = None
    for name, grid in (("minmax/7.5", library_grid), ("absmax/7", absmax_grid)):
        scales = grid(weight)
        codes = gptq_on_grid(weight, h, scales)
        error = calibration_error(weight, int4.dequantize_int4_groups(codes, scales), hessian)
        if best is None or error < best[0]:
            best = (error, codes, scales, name)
    return best[1], best[2].half(), best[3]


def rtn(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest on llmcompressor's grid (its observer's max|w| / 7.5 rule, no error feedback):
    the variant any venv can write, without llmcompressor."""
    scales = _usable(engine_scales(weight.float().view(weight.shape[0], -1, int4.GROUP_SIZE).abs().amax(-1) / 7.5))
    return codes_on_grid(weight, scales), scales.half()


def output_error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> float:
    """||x (W - Q)^T|| / ||x W^T|| on held-out rows x."""
    x = x.double()
    ref = x @ weight.double().T
    return float((x @ (weight.double() - approx.double()).T).norm() / ref.norm().clamp(min=1e-30))


def error_row(module: str, weight: torch.Tensor, stats: Stats, result: tuple[torch.Tensor, torch.Tensor],
              method: str) -> dict:
    """One line of the table: the chosen method against RTN on the same grid and the repo's own RTN."""
    x = stats.held_out_rows(module)
    if not len(x):
        raise CheckpointError(f"{module}: the capture holds no held-out rows")
    repo_codes, repo_scales = int4.quantize_int4_groups(weight)
    row = {
        "module": module, "shape": list(weight.shape), "calibration_rows": stats.rows.get(module, 0),
        "held_out_rows": len(x),
        "rtn_int4py": output_error(x, weight, dequantize(repo_codes, repo_scales)),
    }
    # round-to-nearest on the very grid the method chose (GPTQ's scales), so only the rounding differs
    grid = engine_scales(result[1].float())
    row["rtn"] = output_error(x, weight, dequantize(codes_on_grid(weight, grid), result[1]))
    if method != "rtn":
        row[method] = output_error(x, weight, dequantize(*result))
    return row


def table_markdown(rows: list[dict]) -> str:
    """The held-out error table (relative output error; lower is better)."""
    gptq_col = any("gptq" in r for r in rows)
    head = "| matrix | shape | calib rows | held-out rows | RTN, int4.py grid (max/7) | RTN, GPTQ's grid |"
    head += " GPTQ | GPTQ's grid | GPTQ / best RTN |\n" if gptq_col else "\n"
    lines = [head, "|" + "---|" * (9 if gptq_col else 6) + "\n"]
    for r in rows:
        line = (f"| `{r['module']}` | {r['shape'][0]} x {r['shape'][1]} | {r['calibration_rows']} | "
                f"{r['held_out_rows']} | {r['rtn_int4py']:.5f} | {r['rtn']:.5f} |")
        if gptq_col:
            best_rtn = min(r["rtn"], r["rtn_int4py"])
            ratio = f"{r['gptq'] / best_rtn:.3f}" if best_rtn > 0 else "exact (zero matrix)"
            line += f" {r['gptq']:.5f} | {r['grid']} | {ratio} |"
        lines.append(line + "\n")
    return "".join(lines)


def gptq_beats_rtn(rows: list[dict]) -> list[str]:
    """Matrices where GPTQ's held-out error is not below both RTN baselines (empty: it wins everywhere).
    A matrix every method reproduces exactly (an all-zero one) has nothing to beat and is not listed."""
    return [r["module"] for r in rows
            if not (r["gptq"] < min(r["rtn"], r["rtn_int4py"]) or r["gptq"] == r["rtn"] == r["rtn_int4py"] == 0.0)]


# ---------------------------------------------------------------- the variant


def _finished_capture(stats_path: str | Path, model_dir: Path) -> Stats:
    stats = Stats.load(Path(stats_path))
    if stats.meta.get("done", 0) < stats.meta.get("prompts", 0):
        raise CheckpointError(f"{stats_path} is a partial capture ({stats.meta['done']} of "
                              f"{stats.meta['prompts']} prompts): run drafter/capture.py again to finish it")
    if stats.meta.get("model_digest") != model_digest(model_dir):
        raise CheckpointError(f"{stats_path} was captured from another checkpoint ({stats.meta.get('model')})")
    return stats


def _report(table: list[dict], method: str) -> str:
    if method == "gptq":
        losing = gptq_beats_rtn(table)
        if losing:
            say(f"quantize: warning: GPTQ is not below round-to-nearest on {', '.join(losing)}")
    return table_markdown(table)


def quantize_all(weight_of, stats: Stats, method: str, modules: list[str] | None = None) -> tuple[dict[str, tuple], list[dict]]:
    """module -> (codes, scales), and the error table, for `modules` (default: every captured module);
    weight_of(module) gives the source matrix, float [out, in]."""
    results, table = {}, []
    for module in stats.modules if modules is None else modules:
        start = time.monotonic()
        weight = weight_of(module)
        if weight.shape[1] % int4.GROUP_SIZE or weight.shape[0] % 64:
            raise CheckpointError(f"{module} {tuple(weight.shape)}: Marlin needs out % 64 and in % 128")
        if method == "gptq":
            if module not in stats.hessian:
                raise CheckpointError(f"{module}: the capture has no Hessian for it")
            codes, scales, grid = gptq(weight, stats.hessian[module], stats.rows[module])
            result = (codes, scales)
        else:
            result, grid = rtn(weight), "minmax/7.5"
        results[module] = result
        table.append({**error_row(module, weight, stats, result, method), "grid": grid})
        say(f"quantize: {module} {tuple(weight.shape)} {method} in {time.monotonic() - start:.1f} s")
    return results, table


def write_module_tensors(results: dict[str, tuple], folder: Path) -> None:
    """The new modules' weight_packed / weight_scale / weight_shape, one safetensors file."""
    from safetensors.torch import save_file

    tensors = {}
    for module, (codes, scales) in results.items():
        tensors[f"{module}.weight_packed"] = int4.pack_int4(codes).contiguous()
        tensors[f"{module}.weight_scale"] = scales.half().contiguous()
        tensors[f"{module}.weight_shape"] = torch.tensor(list(codes.shape), dtype=torch.int64)
    save_file(tensors, str(folder / "model.safetensors"))


@contextlib.contextmanager
def _new_output(out_dir: Path, what: str) -> Iterator[None]:
    """Hold out_dir's lock, finish or roll back a transaction a killed run left there, and refuse an existing
    out_dir (nothing is written over)."""
    with transaction.locked(out_dir):
        for line in transaction.recover(out_dir):
            say(f"quantize: {line}")
        if out_dir.exists():
            raise CheckpointError(f"{out_dir} exists; move it away to build {what} again")
        yield


@contextlib.contextmanager
def _tensor_folder(out_dir: Path, results) -> Iterator[Path]:
    """The quantized modules written to a scratch folder beside out_dir, removed afterwards whatever happens."""
    folder = out_dir.parent / f".{out_dir.name}.drafter-tensors-{os.getpid()}"
    folder.mkdir()
    try:
        write_module_tensors(results, folder)
        yield folder
    finally:
        transaction.remove_tree(folder)


def _print_table(markdown: str, table_path: str | Path | None) -> None:
    print(markdown, end="")
    if table_path:
        Path(table_path).write_text(markdown)


def build_variant(base_dir: str | Path, stats_path: str | Path, out_dir: str | Path, method: str = "gptq",
                  table_path: str | Path | None = None) -> int:
    """Quantize the captured modules and write `out_dir` as a fast variant of `base_dir`; an exit status."""
    base_dir, out_dir = Path(base_dir).resolve(), Path(out_dir).resolve()
    if method not in METHODS:
        raise ValueError(f"method {method!r}: one of {', '.join(METHODS)}")
    try:
        with _new_output(out_dir, "the variant"):
            if dflash2_format.is_dflash2_drafter(base_dir):
                raise CheckpointError(f"{base_dir} is a DFlash2 drafter: pass --dflash2 to quantize it")
            stats = _finished_capture(stats_path, base_dir)
            base = ModelDir.open(base_dir)
            from qwen_serving.checkpoint.scripted_reference import Weights

            results, table = quantize_all(Weights(base.path).linear, stats, method)
            markdown = _report(table, method)  # before anything is written
            with _tensor_folder(out_dir, results) as folder:
                change = hub.build_fast_variant(base, folder, f"local {method} ({SCRIPT})")
                change.script = SCRIPT
                change.summary.update({"method": method, "capture": stats.meta, "held_out_error": table})
                apply_change(base, change, target=out_dir)
            problems = steps.quant_problems(ModelDir.open(out_dir))
            if problems:
                raise CheckpointError(f"{out_dir} does not verify: {problems[0]}")
            _print_table(markdown, table_path)
            say(f"quantize: {out_dir} ready ({hub.verify_model(out_dir)}); base shards hard-linked")
            return 0
    except (CheckpointError, RuntimeError, ValueError, OSError) as e:
        print(f"quantize: error: {e}", file=sys.stderr, flush=True)
        return 2



# ---------------------------------------------------------------- the DFlash2 drafter


def build_dflash2(drafter_dir: str | Path, stats_path: str | Path, out_dir: str | Path, method: str = "gptq",
                  table_path: str | Path | None = None, bf16_qkv: bool = False) -> int:
    """Quantize the bf16 DFlash2 drafter's captured matrices to W4A16 g128 and write `out_dir`; an exit status.

    Every matrix vLLM builds with the drafter's quant config (fc and each layer's q/k/v, o_proj, gate/up,
    down_proj: 36 at 5 layers) becomes int4; `bf16_qkv` keeps q/k/v bf16 (21 int4), the layout stock vLLM
    0.28.0 loads (dflash2_format's docstring). Norms, conv kernels, the candidate selector stay as they are."""
    drafter_dir, out_dir = Path(drafter_dir).resolve(), Path(out_dir).resolve()
    if method not in METHODS:
        raise ValueError(f"method {method!r}: one of {', '.join(METHODS)}")
    try:
        with _new_output(out_dir, "the drafter"):
            if not dflash2_format.is_dflash2_drafter(drafter_dir):
                raise CheckpointError(f"{drafter_dir}: not a DFlash2 drafter directory (config.json with architectures "
                                      f"[\"{dflash2_format.ARCHITECTURE}\"]): --dflash2 takes the bf16 drafter")
            drafter = ModelDir.open(drafter_dir, require_qwen35=False)
            packed = sorted(t for t in drafter.weight_map if t.endswith(".weight_packed"))
            if packed:
                raise CheckpointError(f"{drafter_dir} is already quantized ({packed[0]}): start from the bf16 drafter")
            stats = _finished_capture(stats_path, drafter_dir)
            expected = dflash2_format.quantizable_modules(drafter.config)
            if sorted(stats.modules) != expected:
                raise CheckpointError(f"{stats_path} is not a DFlash2 capture of this drafter "
                                      "(drafter/capture.py MODEL_DIR --dflash2 DRAFTER_DIR makes one)")
            modules = [m for m in expected if not (bf16_qkv and dflash2_format.is_qkv(m))]
            from safetensors import safe_open

            def weight_of(module: str) -> torch.Tensor:
                name = f"{module}.weight"
                with safe_open(str(drafter_dir / drafter.weight_map[name]), framework="pt") as f:
                    return f.get_tensor(name).float()

            results, table = quantize_all(weight_of, stats, method, modules)
            markdown = _report(table, method)
            config = dict(drafter.config, quantization_config=dflash2_format.quant_config(bf16_qkv))
            with _tensor_folder(out_dir, results) as folder:
                from qwen_serving.checkpoint.rewrite import Change
                from qwen_serving.checkpoint.safetensors_io import SafetensorsFile, copied_tensor

                new = SafetensorsFile(folder / "model.safetensors")
                add = [copied_tensor(new, name) for name in sorted(new.tensors)]
                change = Change(dflash2_format.STEP, SCRIPT, steps.VERSION, {f"{m}.weight" for m in modules}, add,
                                {t.name: f"{t.name.rsplit('.', 1)[0]}.weight" for t in add}, config)
                kept = [m for m in expected if m not in modules]
                change.summary.update({"method": method, "format": "W4A16 int4 symmetric g128 pack-quantized",
                                       "modules": modules, "kept_bf16": kept, "capture": stats.meta,
                                       "held_out_error": table,
                                       "note": None if bf16_qkv else dflash2_format.QKV_NOTE})
                apply_change(drafter, change, target=out_dir)
            written = ModelDir.open(out_dir, require_qwen35=False)
            problems = steps.quant_problems(written) + dflash2_format.layout_problems(written)[0]
            if problems:
                raise CheckpointError(f"{out_dir} does not verify: {problems[0]}")
            _print_table(markdown, table_path)
            size = sum((out_dir / s).stat().st_size for s in set(written.weight_map.values()))
            say(f"quantize: {out_dir} ready: {len(modules)} int4 matrices, {len(kept)} kept bf16, {size / 1e6:.1f} MB")
            return 0
    except (CheckpointError, RuntimeError, ValueError, OSError) as e:
        print(f"quantize: error: {e}", file=sys.stderr, flush=True)
        return 2
