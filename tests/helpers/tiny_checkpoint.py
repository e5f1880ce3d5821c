"""The tiny synthetic checkpoint and what the prepare-step tests do with it: build it once per session,
run a step, hash a tree, check that a checkpoint loads."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from qwen_serving.checkpoint import ct_config, steps
from qwen_serving.checkpoint.model_dir import ModelDir

REPO = Path(__file__).resolve().parents[2]
STEPS = ("quant_lm_head", "quant_embed", "quant_mtp")
EPOCH = "1700000000"


def make_tiny(tmp_path_factory) -> Path:
    """The tiny synthetic checkpoint (qwen_serving.checkpoint.synth), generated once per test session."""
    path = tmp_path_factory.getbasetemp() / "synth-tiny-seed0"
    if not (path / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "qwen_serving.checkpoint.synth", "--size", "tiny", "--out", str(path), "--seed", "0"],
            check=True, cwd=REPO, capture_output=True,
        )
    return path


def make_scripted_with_drafter(root: Path) -> tuple[Path, Path]:
    """A tiny scripted checkpoint deep enough for a DFlash2 drafter (8 layers: its 5 taps), with the design's draft
    ids, and its scripted drafter, under `root`: what the GPU visits generate at full size."""
    from qwen_serving.checkpoint import scripted_dflash2, synth

    ckpt, drafter = root / "scripted", root / "scripted-dflash2"
    assert synth.main(["--size", "tiny", "--layers", "8", "--out", str(ckpt), "--seed", "0", "--behaviour", "scripted",
                       "--draft-coverage", "0.975"]) == 0
    assert scripted_dflash2.main([str(ckpt), "--out", str(drafter), "--agree", "0.7", "--seed", "0"]) == 0
    return ckpt, drafter


def tree_state(path: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under path."""
    state = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        state[file.relative_to(path).as_posix()] = hashlib.sha256(file.read_bytes()).hexdigest()
    return state


def load_check(path: Path) -> None:
    """The checkpoint loads: strict completeness, the safetensors library reads every indexed
    tensor, and every packed module resolves to a config group of its own bit width."""
    from safetensors import safe_open

    model = ModelDir.open(path)
    for shard in sorted(set(model.weight_map.values())):
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():
                f.get_tensor(name)
    qc = model.quantization_config
    for module in sorted({t.rsplit(".", 1)[0] for t in model.weight_map}):
        bits = steps.packed_bits(model, module)
        if bits is None:
            continue
        for name in ct_config.engine_names(module):
            assert ct_config.describes(ct_config.resolve(qc, name, ct_config.engine_class(module)), bits, 128), name


def run(path: Path, step: str) -> int:
    return steps.run(str(path), step)
