"""Report what prepare/ has done to a model directory: one PASS/WARN/FAIL line per check.

    python -m qwen_serving.checkpoint.prepare_status models/Qwen3.8-27B-W4A16-AutoRound [--deep] [--strict]

A DFlash2 drafter directory (SPEC=dflash2's DRAFT) gets the drafter's checks instead: complete shards,
its W4A16 layout against its quantization_config and the dflash2_w4a16 step; int4 q/k/v (which stock
vLLM 0.28.0 cannot load, the patched one can: patches/dflash2-quantized-kv.patch) are named.

Each prepare step is judged from the tensors themselves (dtype and packing) and cross-checked
with prepared.json: a step the manifest records but the tensors contradict is a FAIL, a step not
done yet is a WARN (the model still serves, with more memory) unless --strict. --deep re-hashes
the files the manifest recorded. Exit status 1 if any line is FAIL. Reads only; never writes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qwen_serving.checkpoint import dflash2_format, step_names, steps, transaction
from qwen_serving.checkpoint.model_dir import CheckpointError, ModelDir, find_embed_tokens, tokenizer_present
from qwen_serving.checkpoint.safetensors_io import file_sha256


class Report:
    def __init__(self, strict: bool):
        self.strict, self.failures = strict, 0

    def line(self, level: str, message: str) -> None:
        if level == "WARN" and self.strict:
            level = "FAIL"
        self.failures += level == "FAIL"
        print(f"{level:<4} {message}", flush=True)


def _module_state(model: ModelDir, module: str) -> str:
    bits = steps.packed_bits(model, module)
    if bits is not None:
        return f"int{bits}"
    return model.info(f"{module}.weight").dtype.lower() if model.has(f"{module}.weight") else "absent"


def check_step(report: Report, model: ModelDir, step: str, what: str, state: str, done: bool, script: str) -> None:
    recorded = step in model.manifest().get("steps", {})
    if done and recorded:
        report.line("PASS", f"{what}: {state} ({step} recorded in prepared.json)")
    elif done:
        report.line("PASS", f"{what}: {state} (not by this repo's prepare/, no prepared.json record)")
    elif recorded:
        report.line("FAIL", f"{what}: {state}, but prepared.json records {step}: the directory was changed since")
    else:
        report.line("WARN", f"{what}: {state}; run: python {script} {model.path}")


def status(path: Path, *, deep: bool = False, strict: bool = False) -> int:
    report = Report(strict)
    for leftover in transaction.leftovers(path):
        report.line("WARN", f"model: leftover {leftover.name} from an interrupted prepare step; re-running any "
                    "prepare script removes it")
    if dflash2_format.is_dflash2_drafter(path):
        return _drafter_status(report, path, deep)
    try:
        model = ModelDir.open(path)
    except CheckpointError as e:
        report.line("FAIL", f"model: {e}")
        return 1
    shards = set(model.weight_map.values())
    size = sum((path / s).stat().st_size for s in shards)
    report.line("PASS", f"model: {path} qwen3_5, {len(shards)} shard(s) complete, {len(model.weight_map)} tensors, "
                f"{size / 1e9:.2f} GB")
    if tokenizer_present(path):
        report.line("PASS", "model: tokenizer present")
    else:
        report.line("FAIL", "model: no tokenizer.json; re-run prepare/download.py")
    problems = steps.quant_problems(model)
    if problems:
        report.line("FAIL", f"model: quantization_config does not match the tensors: {problems[0]}")
    else:
        report.line("PASS", "model: quantization_config matches every quantized tensor")

    lm = _module_state(model, "lm_head")
    check_step(report, model, "quant_lm_head", "lm_head", lm, lm in ("int8", "int4"), "prepare/quant_lm_head.py")
    embed = _module_state(model, find_embed_tokens(model))
    check_step(report, model, "quant_embed", "embed_tokens", embed, embed == "int8", "prepare/quant_embed.py")
    if any(t.startswith("mtp.") for t in model.weight_map):
        left = steps.mtp_linears(model)
        mtp = f"{len(left)} float linear(s) left" if left else "quantized"
        check_step(report, model, "quant_mtp", "MTP module", mtp, not left, "prepare/quant_mtp.py")
        _check_draft_head(report, model)
    else:
        report.line("WARN", "MTP module: none in this checkpoint (SPEC=mtp will not work)")
    if "fast_variant" in model.manifest().get("steps", {}):
        report.line("PASS", f"fast variant: {model.manifest()['steps']['fast_variant'].get('repo')}")
    if deep:
        _check_hashes(report, model)
    return 1 if report.failures else 0


def _drafter_status(report: Report, path: Path, deep: bool) -> int:
    """A DFlash2 drafter directory (SPEC=dflash2's DRAFT): complete shards, the W4A16 layout the patched vLLM loads."""
    try:
        model = ModelDir.open(path, require_qwen35=False)
    except CheckpointError as e:
        report.line("FAIL", f"drafter: {e}")
        return 1
    shards = set(model.weight_map.values())
    size = sum((path / s).stat().st_size for s in shards)
    report.line("PASS", f"drafter: {path} DFlash2, {len(shards)} shard(s) complete, {len(model.weight_map)} tensors, "
                f"{size / 1e9:.2f} GB")
    layout, int4 = dflash2_format.layout_problems(model)
    problems = steps.quant_problems(model) + layout
    if problems:
        report.line("FAIL", f"drafter: quantization_config does not match the tensors: {problems[0]}")
    else:
        report.line("PASS", "drafter: quantization_config matches every linear (int4 ones and bf16 ones)")
    total = len(dflash2_format.quantizable_modules(model.config))
    check_step(report, model, dflash2_format.STEP, "DFlash2 drafter", f"{int4} of {total} linears int4 (W4A16 g128)",
               int4 > 0, "drafter/capture.py MODEL_DIR --dflash2 DRAFTER_DIR, then drafter/quantize.py --dflash2")
    if dflash2_format.qkv_int4(model):
        report.line("PASS", f"drafter: {dflash2_format.QKV_NOTE}")
    if deep:
        _check_hashes(report, model)
    return 1 if report.failures else 0


def _check_draft_head(report: Report, model: ModelDir) -> None:
    tensors = model.module_tensors(steps.DRAFT_HEAD)
    recorded = step_names.DRAFT_VOCAB in model.manifest().get("steps", {})
    if not tensors:
        level = "FAIL" if recorded else "WARN"
        report.line(level, "draft head: absent (MTP drafts over the full lm_head); with the server running, "
                    "bash single-user/calibrate.sh builds one from its own outputs")
        return
    ids_path = model.path / steps.DRAFT_IDS_FILE
    try:
        ids = json.loads(ids_path.read_text())["ids"]
    except (OSError, ValueError, KeyError):
        report.line("FAIL", f"draft head: {steps.DRAFT_IDS_FILE} missing or unreadable")
        return
    rows = model.info(tensors[0]).shape[0]
    if rows != len(ids):
        report.line("FAIL", f"draft head: {rows} rows but {len(ids)} ids in {steps.DRAFT_IDS_FILE}")
        return
    check_step(report, model, "draft_vocab", "draft head", f"{rows} tokens, {_module_state(model, steps.DRAFT_HEAD)}",
               True, "prepare/build_draft_vocab.py")


def _check_hashes(report: Report, model: ModelDir) -> None:
    """Files a step wrote that are still part of the model must hash as recorded."""
    current: dict[str, str] = {}
    for record in model.manifest().get("steps", {}).values():
        current.update(record.get("outputs", {}))  # later steps supersede earlier ones
    bad, checked = [], 0
    for name, digest in sorted(current.items()):
        if (model.path / name).exists() and (name in model.weight_map.values() or not name.endswith(".safetensors")):
            checked += 1
            if file_sha256(model.path / name) != digest:
                bad.append(name)
    if bad:
        report.line("FAIL", f"hashes: {len(bad)} file(s) differ from prepared.json, e.g. {bad[0]}")
    else:
        report.line("PASS", f"hashes: {checked} file(s) written by prepare steps match prepared.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--deep", action="store_true", help="also re-hash the files prepared.json records")
    parser.add_argument("--strict", action="store_true", help="a prepare step not done yet is a FAIL")
    args = parser.parse_args(argv)
    try:
        return status(Path(args.model_dir), deep=args.deep, strict=args.strict)
    except CheckpointError as e:  # e.g. an unreadable prepared.json
        print(f"FAIL model: {e}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
