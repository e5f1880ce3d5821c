"""Apply one prepare step to a model directory: new shards, index, config and manifest, atomically.

A step describes its change as tensors to drop, tensors to add (streamed), the new config and any
extra files; `apply_change` lays out the shards (a shard that lost a tensor is rewritten under a
new name, with the step's replacement tensors placed beside the other tensors), checks the disk,
builds the staged tree and commits it (transaction.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from qwen_serving.checkpoint import transaction
from qwen_serving.checkpoint.console import say
from qwen_serving.checkpoint.model_dir import (
    CONFIG_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    CheckpointError,
    ModelDir,
    text_config,
)
from qwen_serving.checkpoint.safetensors_io import (
    OutTensor,
    SafetensorsFile,
    copied_tensor,
    file_sha256,
    planned_size,
    write_file,
)

MANIFEST_FORMAT = 1
DISK_MARGIN = 256 * 1024 * 1024


def model_dtype(model: ModelDir, fallback: str) -> str:
    """Scale storage dtype: the dtype the engine will hold scales in (the model's torch_dtype)."""
    name = model.config.get("torch_dtype") or model.config.get("dtype") or text_config(model.config).get("torch_dtype")
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(str(name), fallback)


@dataclass
class Change:
    step: str
    script: str
    version: str
    remove: set[str]
    add: list[OutTensor]
    # new tensor name -> removed tensor whose shard it joins (else: a new shard for the step)
    place_with: dict[str, str]
    config: dict
    extra_files: dict[str, bytes] = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    check: object = None  # callable run after the tensors are written, before the commit
    undoes: tuple[str, ...] = ()  # earlier steps whose output this change removes: their records go too


def _timestamp() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = time.gmtime(int(epoch)) if epoch else time.gmtime()
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", moment)


def _new_shard_name(old: str, step: str, taken: set[str]) -> str:
    stem = old[: -len(".safetensors")] if old.endswith(".safetensors") else old
    stem = stem.split(".")[0]
    name, n = f"{stem}.{step}.safetensors", 1
    while name in taken:
        n += 1
        name = f"{stem}.{step}-{n}.safetensors"
    return name


def layout(model: ModelDir, change: Change) -> tuple[dict[str, list[OutTensor]], dict[str, str]]:
    """New shard name -> tensors to write, and the new weight map."""
    missing = sorted(change.remove - set(model.weight_map))
    if missing:
        raise CheckpointError(f"{model.path}: no tensor {missing[0]}")
    affected = sorted({model.weight_map[t] for t in change.remove})
    taken = set(model.weight_map.values())
    renamed: dict[str, str] = {}
    for old in affected:
        renamed[old] = _new_shard_name(old, change.step, taken | set(renamed.values()))
    shards: dict[str, list[OutTensor]] = {}
    for old in affected:
        source = model.shards[old]
        kept = [copied_tensor(source, t) for t in source.tensors if t not in change.remove]
        shards[renamed[old]] = kept
    fresh = f"model-{change.step}.safetensors"
    for tensor in change.add:
        anchor = change.place_with.get(tensor.name)
        target = renamed[model.weight_map[anchor]] if anchor in change.remove else fresh
        if target == fresh and fresh in taken:
            raise CheckpointError(f"{model.path}: {fresh} already exists; the step looks half-applied by another tool")
        shards.setdefault(target, []).append(tensor)
    shards = {name: tensors for name, tensors in shards.items() if tensors}
    weight_map = {t: s for t, s in model.weight_map.items() if t not in change.remove}
    for name, tensors in shards.items():
        for t in tensors:
            weight_map[t.name] = name
    return shards, weight_map


def check_disk(model: ModelDir, shards: dict[str, list[OutTensor]]) -> int:
    need = sum(planned_size(ts) for ts in shards.values()) + DISK_MARGIN
    free = shutil.disk_usage(model.path.parent).free
    if free < need:
        raise CheckpointError(
            f"not enough disk space on {model.path.parent}: the step writes {need / 1e9:.2f} GB "
            f"(new shards + margin) before it can free anything; {free / 1e9:.2f} GB free"
        )
    return need


def apply_change(model: ModelDir, change: Change, target: Path | None = None) -> dict:
    """Stage and commit `change` (in place, or as the new directory `target`); returns the step record."""
    shards, weight_map = layout(model, change)
    check_disk(model, shards)
    affected = sorted({model.weight_map[t] for t in change.remove})
    say(f"{change.step}: hashing {len(affected)} input shard(s)")
    inputs = {name: file_sha256(model.path / name) for name in affected}
    old_bytes = sum(model.info(t).nbytes for t in change.remove)
    new_bytes = sum(t.nbytes for t in change.add)

    staging = transaction.staging_path(target or model.path)
    replaced = set(affected) | {INDEX_NAME, CONFIG_NAME, MANIFEST_NAME} | set(change.extra_files)
    transaction.stage_tree(model.path, staging, replaced)
    try:
        outputs: dict[str, str] = {}
        for name, tensors in shards.items():
            say(f"{change.step}: writing {name} ({len(tensors)} tensors)")
            outputs[name] = write_file(staging / name, tensors, {"format": "pt"})
        if change.check is not None:
            change.check()
        index = {"metadata": {"total_size": _total_size(staging, weight_map)}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(staging / INDEX_NAME, index)
        _write_json(staging / CONFIG_NAME, change.config)
        for name, data in change.extra_files.items():
            _write_bytes(staging / name, data)
            outputs[name] = file_sha256(staging / name)
        record = {
            "script": change.script,
            "version": change.version,
            "done": _timestamp(),
            "inputs": inputs,
            "outputs": outputs,
            "bytes_before": old_bytes,
            "bytes_after": new_bytes,
            **change.summary,
        }
        manifest = model.manifest()
        manifest["format"] = MANIFEST_FORMAT
        steps = manifest.setdefault("steps", {})
        for undone in change.undoes:  # else that step reads as done and never runs again
            steps.pop(undone, None)
        steps[change.step] = record
        _write_json(staging / MANIFEST_NAME, manifest)
    except BaseException:
        transaction.remove_tree(staging)
        raise
    say(f"{change.step}: committing")
    if target is None:
        transaction.commit(model.path, staging)
    else:
        transaction.create(target, staging)
    return record


def _total_size(staging: Path, weight_map: dict[str, str]) -> int:
    total = 0
    for name in sorted(set(weight_map.values())):
        shard = SafetensorsFile(staging / name)
        total += sum(t.nbytes for t in shard.tensors.values())
    return total


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, data: dict) -> None:
    _write_bytes(path, (json.dumps(data, indent=2) + "\n").encode())


def run_step(model_path: str | Path, step: str, build) -> int:
    """Shared CLI body: lock, recover, open, no-op if done, else build the change and apply it.

    `build(model)` returns a Change, or raises CheckpointError for wrong input.
    Returns a process exit code.
    """
    path = Path(model_path).resolve()
    try:
        if not (path.is_dir() or transaction.old_path(path).is_dir()):  # the latter: an interrupted commit
            raise CheckpointError(f"model directory not found: {model_path}")
        with transaction.locked(path):
            for line in transaction.recover(path):
                say(f"{step}: {line}")
            model = ModelDir.open(path)
            done = model.manifest().get("steps", {}).get(step)
            if done:
                say(f"{step}: already done ({done.get('done', '?')}, version {done.get('version', '?')}), nothing to do")
                return 0
            change = build(model)
            say(f"{step}: {model.path}")
            record = apply_change(model, change)
            model.close()
            freed = record["bytes_before"] - record["bytes_after"]
            size = f"{freed / 1e9:.3f} GB freed" if freed >= 0 else f"{-freed / 1e9:.3f} GB added"
            say(f"{step}: done; {size}")
            return 0
    except (CheckpointError, RuntimeError, ValueError) as e:
        print(f"{step}: error: {e}", file=sys.stderr, flush=True)
        return 2
