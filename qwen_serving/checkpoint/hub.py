"""Fetch checkpoints from the Hugging Face Hub and verify what arrived.

Downloads go through `huggingface_hub.snapshot_download` into a local directory (hf-xet transfers,
HF_XET_HIGH_PERFORMANCE=1; resumable: the hub keeps partial files under .cache/huggingface/ and
continues them). An existing directory is verified first and not fetched again. The fast variant
is composed as a new model directory: the base checkpoint's unchanged shards hard-linked, the
variant's modules replacing the base's, one atomic rename at the end.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
from pathlib import Path

from qwen_serving.checkpoint import ct_config, step_names, steps, transaction
from qwen_serving.checkpoint.console import say
from qwen_serving.checkpoint.model_dir import CheckpointError, ModelDir, read_json, tokenizer_present
from qwen_serving.checkpoint.rewrite import Change, apply_change
from qwen_serving.checkpoint.safetensors_io import SafetensorsError, SafetensorsFile, copied_tensor

BASE_REPO = "dbirks/Qwen3.8-27B-W4A16-AutoRound"
FAST_REPO = "syvai/qwen3.8-27b-3090-fast-variant"
DFLASH2_REPO = "syvai/Qwen3.8-27B-DFlash2-W4A16"
REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS = REPO_ROOT / "models"
DOWNLOADS = MODELS / ".downloads"
VERSION = "1"


def default_dir(repo: str) -> Path:
    return MODELS / repo.split("/")[-1]


def _hub():
    os.environ.setdefault("HF_XET_HIGH_PERFORMANCE", "1")  # read when huggingface_hub is imported
    import huggingface_hub

    return huggingface_hub


def verify_files(path: Path, expected_sizes: dict[str, int] | None = None) -> int:
    """Every safetensors file complete and every hub file at its hub size; returns total bytes."""
    problems = []
    for name, size in sorted((expected_sizes or {}).items()):
        local = path / name
        if not local.exists():
            problems.append(f"{name} is missing")
        elif local.stat().st_size != size:
            problems.append(f"{name} is {local.stat().st_size} bytes, the hub says {size}")
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        try:
            SafetensorsFile(file).check_complete()
        except SafetensorsError as e:
            problems.append(str(e))
        total += file.stat().st_size
    if problems:
        raise CheckpointError(f"{path}: download incomplete: " + "; ".join(problems[:5]))
    return total


def verify_model(path: Path, *, require_qwen35: bool = True) -> str:
    """A complete model directory (index, shards, config, tokenizer); returns a summary line."""
    model = ModelDir.open(path, require_qwen35=require_qwen35)
    if require_qwen35 and not tokenizer_present(path):
        raise CheckpointError(f"{path}: no tokenizer (tokenizer.json)")
    size = sum((path / s).stat().st_size for s in set(model.weight_map.values()))
    shards = len(set(model.weight_map.values()))
    model.close()
    return f"{shards} shard(s), {len(model.weight_map)} tensors, {size / 1e9:.2f} GB"


def download(repo: str, local_dir: Path, *, revision: str | None = None, token: str | None = None,
             require_qwen35: bool = True, model_files: bool = True) -> str:
    """Fetch `repo` into `local_dir` unless a complete copy is already there; returns a summary."""
    local_dir = Path(local_dir)
    if local_dir.exists():
        try:
            summary = verify_model(local_dir, require_qwen35=require_qwen35) if model_files else (
                f"{verify_files(local_dir) / 1e9:.2f} GB")
            say(f"download: {local_dir} is already complete ({summary}); not fetching again")
            return summary
        except CheckpointError as e:
            if (local_dir / "prepared.json").exists():
                raise CheckpointError(
                    f"{local_dir} was changed by prepare steps and is now incomplete ({e}); downloading over it "
                    "would mix two states: move it away and run the download again"
                ) from e
            say(f"download: {local_dir} is incomplete ({e}); resuming")
    hub = _hub()
    say(f"download: {repo}{'@' + revision if revision else ''} -> {local_dir}"
        f" (hf-xet, HF_XET_HIGH_PERFORMANCE={os.environ.get('HF_XET_HIGH_PERFORMANCE')},"
        f" token: {'given' if token else 'HF_TOKEN' if os.environ.get('HF_TOKEN') else 'none'})")
    expected = _expected_sizes(hub, repo, local_dir, revision, token)
    local_dir.parent.mkdir(parents=True, exist_ok=True)
    hub.snapshot_download(repo_id=repo, local_dir=str(local_dir), revision=revision, token=token)
    verify_files(local_dir, expected)
    summary = verify_model(local_dir, require_qwen35=require_qwen35) if model_files else (
        f"{verify_files(local_dir) / 1e9:.2f} GB")
    say(f"download: complete and verified ({summary})")
    return summary


def download_main(name: str, doc: str, default_repo: str, *, require_qwen35: bool = True,
                  argv: list[str] | None = None) -> int:
    """The command line of prepare/download.py and prepare/fetch_dflash2.py: fetch a repo and verify it."""
    parser = argparse.ArgumentParser(prog=name, description=doc.splitlines()[0])
    parser.add_argument("--repo", default=default_repo)
    parser.add_argument("--dir", help="target directory (default: models/<repo name>)")
    parser.add_argument("--revision")
    parser.add_argument("--token", help="Hugging Face token (default: HF_TOKEN)")
    args = parser.parse_args(argv)
    target = Path(args.dir) if args.dir else default_dir(args.repo)
    try:
        download(args.repo, target, revision=args.revision, token=args.token, require_qwen35=require_qwen35)
    except (CheckpointError, OSError) as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _expected_sizes(hub, repo: str, local_dir: Path, revision: str | None, token: str | None) -> dict[str, int] | None:
    """Hub file sizes (and a disk check) from a dry run, where this huggingface_hub supports one."""
    try:
        infos = hub.snapshot_download(repo_id=repo, local_dir=str(local_dir), revision=revision, token=token, dry_run=True)
    except TypeError:  # a huggingface_hub without dry_run: the safetensors headers still prove completeness
        return None
    sizes = {i.filename: i.file_size for i in infos if i.file_size is not None}
    need = sum(i.file_size or 0 for i in infos if i.will_download)
    parent = local_dir if local_dir.exists() else local_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if need > free:
        raise CheckpointError(f"{repo} needs {need / 1e9:.2f} GB more on {parent}; {free / 1e9:.2f} GB free")
    return sizes


# ---------------------------------------------------------------- the fast variant


def _variant_tensors(download_dir: Path) -> dict[str, SafetensorsFile]:
    """tensor name -> file holding it, over the variant's safetensors files."""
    owner: dict[str, SafetensorsFile] = {}
    for file in sorted(download_dir.glob("*.safetensors")):
        shard = SafetensorsFile(file)
        for name in shard.tensors:
            if name in owner:
                raise CheckpointError(f"the variant ships {name} twice ({owner[name].path.name}, {file.name})")
            owner[name] = shard
    if not owner:
        raise CheckpointError(f"{download_dir}: the variant download has no safetensors files")
    return owner


def _weights_args(tensors: dict[str, SafetensorsFile], module: str, variant_qc: dict | None) -> dict | None:
    """The compressed-tensors weights args of one variant module (None: not quantized)."""
    if f"{module}.weight_packed" not in tensors:
        return None
    if variant_qc:
        for name in ct_config.engine_names(module):
            args = ct_config.resolve(variant_qc, name, ct_config.engine_class(module))
            if args:
                return args
    shape = tensors[f"{module}.weight_shape"].array(f"{module}.weight_shape")
    cols = int(shape[1])
    bits = 32 * tensors[f"{module}.weight_packed"].tensors[f"{module}.weight_packed"].shape[1] // cols
    groups = tensors[f"{module}.weight_scale"].tensors[f"{module}.weight_scale"].shape[1]
    return {
        "num_bits": bits, "type": "int", "symmetric": f"{module}.weight_zero_point" not in tensors,
        "strategy": "group" if groups > 1 else "channel", "group_size": cols // groups if groups > 1 else None,
        "dynamic": False, "actorder": "group" if f"{module}.weight_g_idx" in tensors else None,
        "observer": "minmax", "observer_kwargs": {}, "block_structure": None,
    }


def build_fast_variant(base: ModelDir, download_dir: Path, repo: str) -> Change:
    tensors = _variant_tensors(download_dir)
    modules = sorted({t.rsplit(".", 1)[0] for t in tensors})
    variant_config = download_dir / "config.json"
    variant_qc = read_json(variant_config, "variant config.json").get("quantization_config") if variant_config.exists() else None
    remove = {t for m in modules for t in base.module_tensors(m)}
    config = copy.deepcopy(base.config)
    extra_note, undoes = "", ()
    if "lm_head" in modules and base.module_tensors(steps.DRAFT_HEAD):
        # the draft head holds rows of the lm_head being replaced: drop it rather than keep stale rows
        remove |= set(base.module_tensors(steps.DRAFT_HEAD))
        config.pop("draft_vocab", None)
        extra_note = "; the draft head was built from the old lm_head: run build_draft_vocab.py on the new directory"
        undoes = (step_names.DRAFT_VOCAB,)
    qc = config.get("quantization_config")
    by_args: dict[str, list[str]] = {}
    for module in modules:
        args = _weights_args(tensors, module, variant_qc)
        if args is None:
            continue
        by_args.setdefault(repr(sorted(args.items())), []).append(module)
    for n, group_modules in enumerate(by_args.values()):
        args = _weights_args(tensors, group_modules[0], variant_qc)
        qc = ct_config.add_group(qc, f"fast_variant_{n}", ct_config.with_fused(group_modules), args)
    for module in modules:
        if _weights_args(tensors, module, variant_qc) is None and any(
            ct_config.resolve(qc, name, ct_config.engine_class(module)) for name in ct_config.engine_names(module)
        ):
            raise CheckpointError(f"the variant ships {module} unquantized but the base config quantizes it")
    if qc is not None:
        config["quantization_config"] = qc
    add = [copied_tensor(tensors[name], name) for name in sorted(tensors)]
    change = Change("fast_variant", "prepare/fetch_fast_variant.py", VERSION, remove, add, {}, config, undoes=undoes)
    change.summary.update({"repo": repo, "modules": modules})
    change.summary["note"] = extra_note.lstrip("; ") if extra_note else None
    return change


def fetch_fast_variant(base_dir: Path, out_dir: Path, repo: str = FAST_REPO, *, revision: str | None = None,
                       token: str | None = None, downloads: Path = DOWNLOADS) -> int:
    base_dir, out_dir = Path(base_dir).resolve(), Path(out_dir).resolve()
    try:
        with transaction.locked(out_dir):
            for line in transaction.recover(out_dir):
                say(f"fast_variant: {line}")
            if out_dir.exists():
                done = ModelDir.open(out_dir).manifest().get("steps", {}).get("fast_variant")
                if not done:
                    raise CheckpointError(f"{out_dir} exists and is not a fast variant built by this script")
                say(f"fast_variant: already done ({verify_model(out_dir)}), nothing to do")
                return 0
            base = ModelDir.open(base_dir)
            cache = Path(downloads) / repo.split("/")[-1]
            download(repo, cache, revision=revision, token=token, require_qwen35=False, model_files=False)
            change = build_fast_variant(base, cache, repo)
            record = apply_change(base, change, target=out_dir)
            problems = steps.quant_problems(ModelDir.open(out_dir))
            if problems:
                raise CheckpointError(f"{out_dir} does not verify: {problems[0]}")
            say(f"fast_variant: {out_dir} ready ({verify_model(out_dir)}); base shards hard-linked, "
                f"{len(record['outputs'])} new file(s)" + (f"; {record['note']}" if record.get("note") else ""))
            return 0
    except (CheckpointError, RuntimeError, ValueError, OSError) as e:
        print(f"fast_variant: error: {e}", file=sys.stderr, flush=True)
        return 2
