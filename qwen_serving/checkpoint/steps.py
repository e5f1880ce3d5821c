"""The in-place prepare steps: int8 lm_head, int8 embed_tokens, int8 MTP module, draft head.

Each `build_*` inspects a ModelDir and returns the Change that rewrite.apply_change commits, or
raises CheckpointError for input it must not touch. The prepare/ scripts call `run(...)`.
"""

from __future__ import annotations

import argparse
import copy
import json

import numpy as np

from qwen_serving.checkpoint import ct_config, int8, step_names
from qwen_serving.checkpoint.console import say
from qwen_serving.checkpoint.int8 import Int8Matrix
from qwen_serving.checkpoint.model_dir import CheckpointError, ModelDir, find_embed_tokens, text_config
from qwen_serving.checkpoint.rewrite import Change, model_dtype, run_step
from qwen_serving.checkpoint.safetensors_io import FLOAT_DTYPES, OutTensor, array_tensor

VERSION = "1"
MAX_RELATIVE_ERROR = 0.01
DRAFT_HEAD = "mtp.draft_lm_head"
DRAFT_IDS_FILE = "draft_vocab_ids.json"


def all_modules(model: ModelDir) -> list[str]:
    return sorted({t.rsplit(".", 1)[0] for t in model.weight_map})


def packed_bits(model: ModelDir, module: str) -> int | None:
    """Bits per code of a pack-quantized module, from its tensor shapes; None if not packed."""
    packed, shape = f"{module}.weight_packed", f"{module}.weight_shape"
    if not (model.has(packed) and model.has(shape)):
        return None
    cols = int(model.shards[model.weight_map[shape]].array(shape)[1])
    return 32 * model.info(packed).shape[1] // cols


def _already_quantized(model: ModelDir, module: str) -> None:
    bits = packed_bits(model, module)
    if bits is not None:
        raise CheckpointError(f"{module} is already quantized (int{bits}, pack-quantized); nothing to requantize")


def _int8_change(model: ModelDir, step: str, script: str, modules: list[str], label: str) -> Change:
    """Replace each float `module.weight` by its int8 g128 triple; shared by the three int8 steps."""
    scale_dtype = model_dtype(model, model.info(f"{modules[0]}.weight").dtype)
    matrices = [
        Int8Matrix(model.shards[model.weight_map[f"{m}.weight"]], f"{m}.weight", m, scale_dtype) for m in modules
    ]
    config = copy.deepcopy(model.config)
    old_qc = model.quantization_config
    new_qc = ct_config.add_group(old_qc, f"int8_{label}", ct_config.with_fused(modules))
    ct_config.check_edit(old_qc, new_qc, all_modules(model), modules, int8.NUM_BITS, int8.GROUP_SIZE)
    config["quantization_config"] = new_qc
    add: list[OutTensor] = []
    place: dict[str, str] = {}
    for m, matrix in zip(modules, matrices, strict=True):
        for t in matrix.tensors():
            add.append(t)
            place[t.name] = f"{m}.weight"
    change = Change(step, script, VERSION, {f"{m}.weight" for m in modules}, add, place, config)

    def check() -> None:
        meter = int8.ErrorMeter()
        for matrix in matrices:
            meter.err_sq += matrix.meter.err_sq
            meter.ref_sq += matrix.meter.ref_sq
            meter.max_abs = max(meter.max_abs, matrix.meter.max_abs)
        say(f"{step}: round-trip error {100 * meter.relative:.3f}% (relative Frobenius), max |err| {meter.max_abs:.3g}")
        if meter.relative > MAX_RELATIVE_ERROR:
            raise CheckpointError(
                f"round-trip error {100 * meter.relative:.2f}% exceeds {100 * MAX_RELATIVE_ERROR:.0f}%; nothing written"
            )
        change.summary["relative_error"] = round(meter.relative, 6)

    change.check = check
    change.summary["format"] = f"int8 symmetric g{int8.GROUP_SIZE} pack-quantized"
    change.summary["modules"] = modules
    return change


def build_lm_head(model: ModelDir) -> Change:
    if text_config(model.config).get("tie_word_embeddings") or model.config.get("tie_word_embeddings"):
        raise CheckpointError("tie_word_embeddings is set: lm_head is the embedding table, run quant_embed.py only")
    _already_quantized(model, "lm_head")
    if not model.has("lm_head.weight"):
        raise CheckpointError(f"{model.path}: no lm_head.weight")
    return _int8_change(model, step_names.QUANT_LM_HEAD, "prepare/quant_lm_head.py", ["lm_head"], "lm_head")


def build_embed(model: ModelDir) -> Change:
    module = find_embed_tokens(model)
    _already_quantized(model, module)
    return _int8_change(model, step_names.QUANT_EMBED, "prepare/quant_embed.py", [module], "embed_tokens")


def mtp_linears(model: ModelDir) -> list[str]:
    """MTP modules with a float matrix weight (fc, attention and MLP projections)."""
    modules = []
    for name in model.weight_map:
        if name.startswith("mtp.") and name.endswith(".weight") and not name.startswith(DRAFT_HEAD + "."):
            info = model.info(name)
            if len(info.shape) == 2 and info.dtype in FLOAT_DTYPES:
                modules.append(name[: -len(".weight")])
    return sorted(modules)


def build_mtp(model: ModelDir) -> Change:
    if not any(t.startswith("mtp.") for t in model.weight_map):
        raise CheckpointError(f"{model.path} has no MTP module (mtp.* tensors)")
    modules = mtp_linears(model)
    if not modules:
        raise CheckpointError("the MTP module has no float linear weights left: already quantized")
    odd = [m for m in modules if model.info(f"{m}.weight").shape[1] % int8.GROUP_SIZE]
    if odd:
        raise CheckpointError(f"{odd[0]}: input size not a multiple of {int8.GROUP_SIZE}")
    return _int8_change(model, step_names.QUANT_MTP, "prepare/quant_mtp.py", modules, "mtp")


def build_draft_head(model: ModelDir, ids: list[int], source_note: str, coverage: dict | None = None) -> Change:
    """Rows `ids` of the current lm_head (whatever its format) as the MTP draft head."""
    vocab = int(text_config(model.config).get("vocab_size") or model.info(_lm_head_rows(model)[0]).shape[0])
    if not ids:
        raise CheckpointError("the draft vocabulary is empty")
    if len(set(ids)) != len(ids):
        raise CheckpointError("the draft vocabulary lists a token id twice")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise CheckpointError(f"token id {bad[0]} is outside the vocabulary (size {vocab})")
    if any(t.startswith(DRAFT_HEAD + ".") for t in model.weight_map):
        raise CheckpointError(f"{model.path} already has a draft head ({DRAFT_HEAD}) not recorded in prepared.json")
    ids = sorted(ids)
    rows = np.array(ids, dtype=np.int64)
    add: list[OutTensor] = []
    for name in _lm_head_rows(model):
        info = model.info(name)
        data = np.asarray(model.shards[model.weight_map[name]].array(name))[rows]
        add.append(array_tensor(DRAFT_HEAD + name[len("lm_head") :], info.dtype, data))
    if model.has("lm_head.weight_shape"):
        cols = int(model.shards[model.weight_map["lm_head.weight_shape"]].array("lm_head.weight_shape")[1])
        add.append(array_tensor(f"{DRAFT_HEAD}.weight_shape", "I64", np.array([len(ids), cols], dtype=np.int64)))
    config = copy.deepcopy(model.config)
    old_qc = model.quantization_config
    head_args = ct_config.resolve(old_qc, "lm_head", "ParallelLMHead") if model.has("lm_head.weight_packed") else None
    if head_args is not None:
        config["quantization_config"] = ct_config.add_group(old_qc, "draft_lm_head", [DRAFT_HEAD], head_args)
    config["draft_vocab"] = {"size": len(ids), "ids_file": DRAFT_IDS_FILE, "head": DRAFT_HEAD}
    record = {"k": len(ids), "source": source_note, "ids": ids}
    if coverage:
        record["coverage"] = coverage
    change = Change(
        step_names.DRAFT_VOCAB,  # the name plan.py looks for in prepared.json
        "prepare/build_draft_vocab.py",
        VERSION,
        set(),
        add,
        {},
        config,
        extra_files={DRAFT_IDS_FILE: (json.dumps(record) + "\n").encode()},
    )
    change.summary.update({"k": len(ids), "head_format": "lm_head format" if head_args else "float", "source": source_note})
    if coverage:
        change.summary["coverage"] = coverage
    return change


def _lm_head_rows(model: ModelDir) -> list[str]:
    """lm_head tensors with one row per vocabulary entry (weight, or weight_packed + weight_scale)."""
    if model.has("lm_head.weight_zero_point"):
        raise CheckpointError("lm_head has zero points (asymmetric): draft head rows cannot be gathered")
    names = [n for n in ("lm_head.weight", "lm_head.weight_packed", "lm_head.weight_scale") if model.has(n)]
    if not names:
        raise CheckpointError(f"{model.path}: no lm_head tensors")
    return names


def quant_problems(model: ModelDir) -> list[str]:
    """Packed modules the quantization_config would not load at their own bit width."""
    problems = []
    qc = model.quantization_config
    for module in all_modules(model):
        bits = packed_bits(model, module)
        if bits is None:
            continue
        cols = int(model.shards[model.weight_map[f"{module}.weight_shape"]].array(f"{module}.weight_shape")[1])
        groups = model.info(f"{module}.weight_scale").shape[1]
        group = cols // groups if groups > 1 else None
        for name in ct_config.engine_names(module):
            args = ct_config.resolve(qc, name, ct_config.engine_class(module))
            if not args or args.get("num_bits") != bits or (group and args.get("group_size") != group):
                problems.append(f"{module} is int{bits} g{group} on disk but quantization_config gives {name} {args}")
                break
    return problems


def run(model_path: str, step: str) -> int:
    builders = {"quant_lm_head": build_lm_head, "quant_embed": build_embed, "quant_mtp": build_mtp}
    return run_step(model_path, step, builders[step])


def main(step: str, doc: str, argv: list[str] | None = None) -> int:
    """The whole command line of a one-step prepare script (prepare/quant_{lm_head,embed,mtp}.py)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("model_dir", help="checkpoint directory (changed in place, atomically)")
    return run(parser.parse_args(argv).model_dir, step)
