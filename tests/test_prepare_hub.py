"""download.py / fetch_*.py offline: snapshot_download is replaced by a local copy of a fixture."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import numpy as np
import pytest
import torch

from qwen_serving.checkpoint import hub, step_names, steps
from qwen_serving.checkpoint.int4 import pack_int4, quantize_int4_groups
from qwen_serving.checkpoint.model_dir import CheckpointError, ModelDir
from qwen_serving.checkpoint.safetensors_io import array_tensor, to_f32, write_file
from tests.helpers.tiny_checkpoint import EPOCH, REPO, load_check, make_tiny, run, tree_state

sys.path.insert(0, str(REPO / "prepare"))


class FakeHub:
    """Serves the files of `source` as a repo; can drop bytes from one file to fake a broken transfer."""

    def __init__(self, source: Path):
        self.source, self.calls, self.truncate = source, [], None

    def files(self) -> list[Path]:
        return sorted(p for p in self.source.rglob("*") if p.is_file())

    def __call__(self, repo_id, local_dir, revision=None, token=None, dry_run=False, **_kw):
        self.calls.append({"repo": repo_id, "dry_run": dry_run, "token": token, "revision": revision})
        local = Path(local_dir)
        if dry_run:
            return [SimpleNamespace(filename=p.relative_to(self.source).as_posix(), file_size=p.stat().st_size,
                                    will_download=not (local / p.relative_to(self.source)).exists()) for p in self.files()]
        for p in self.files():
            dest = local / p.relative_to(self.source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = p.read_bytes()
            if self.truncate and p.name == self.truncate:
                data = data[:-100]
            dest.write_bytes(data)
        return str(local)

    @property
    def fetches(self) -> int:
        return sum(not c["dry_run"] for c in self.calls)


@pytest.fixture
def tiny(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory)


@pytest.fixture
def fake(tiny, monkeypatch) -> FakeHub:
    fake = FakeHub(tiny)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.delenv("HF_XET_HIGH_PERFORMANCE", raising=False)
    return fake


def test_download_then_verified_not_refetched(fake, tmp_path, capsys):
    import download

    target = tmp_path / "models" / "tiny"
    assert download.main(["--repo", "org/tiny", "--dir", str(target), "--token", "hf_x"]) == 0
    assert os.environ["HF_XET_HIGH_PERFORMANCE"] == "1"
    assert fake.fetches == 1 and fake.calls[-1]["token"] == "hf_x" and fake.calls[-1]["repo"] == "org/tiny"
    assert "complete and verified (5 shard(s)" in capsys.readouterr().out
    assert tree_state(target) == tree_state(fake.source)
    assert download.main(["--repo", "org/tiny", "--dir", str(target)]) == 0
    assert fake.fetches == 1 and "already complete" in capsys.readouterr().out


def test_interrupted_download_is_resumed(fake, tmp_path):
    target = tmp_path / "tiny"
    shutil.copytree(fake.source, target)
    shard = target / "model-00002-of-00005.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    (target / "model-00004-of-00005.safetensors").unlink()
    hub.download("org/tiny", target)
    assert fake.fetches == 1 and tree_state(target) == tree_state(fake.source)


def test_broken_transfer_is_reported(fake, tmp_path, capsys):
    import download

    fake.truncate = "model-00003-of-00005.safetensors"
    assert download.main(["--repo", "org/tiny", "--dir", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "model-00003-of-00005.safetensors is" in err and "the hub says" in err


def test_a_prepared_directory_is_never_downloaded_over(fake, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    target = tmp_path / "tiny"
    shutil.copytree(tiny, target)
    assert run(target, "quant_lm_head") == 0
    assert hub.download("org/tiny", target) and fake.fetches == 0  # prepared and complete: fine
    victim = next(target.glob("*.quant_lm_head.safetensors"))
    victim.write_bytes(victim.read_bytes()[:-10])
    state = tree_state(target)
    with pytest.raises(CheckpointError, match="changed by prepare steps"):
        hub.download("org/tiny", target)
    assert fake.fetches == 0 and tree_state(target) == state


def test_dflash2_drafter_is_checked_as_files(fake, tmp_path, capsys):
    import fetch_dflash2

    drafter = tmp_path / "drafter-src"
    drafter.mkdir()
    write_file(drafter / "model.safetensors", [array_tensor("fc.weight", "F16", np.ones((4, 8), np.float16))])
    (drafter / "config.json").write_text(json.dumps({"architectures": ["DFlash2DraftModel"], "model_type": "qwen3"}))
    fake.source = drafter
    target = tmp_path / "models" / "drafter"
    assert fetch_dflash2.main(["--dir", str(target)]) == 0
    assert fake.calls[-1]["repo"] == hub.DFLASH2_REPO
    assert "complete and verified (1 shard(s), 1 tensors" in capsys.readouterr().out
    assert fetch_dflash2.main(["--dir", str(target)]) == 0 and fake.fetches == 1


def _make_variant(base: Path, dest: Path) -> None:
    """A fast-variant repo built from the tiny model: int4 g128 lm_head and MTP projections."""
    model = ModelDir.open(base)
    modules = ["lm_head", *steps.mtp_linears(model)]
    tensors = []
    for module in modules:
        weight = to_f32(np.asarray(model.shards[model.weight_map[f"{module}.weight"]].array(f"{module}.weight")), "BF16")
        codes, scales = quantize_int4_groups(torch.from_numpy(weight))
        tensors += [
            array_tensor(f"{module}.weight_packed", "I32", pack_int4(codes).numpy()),
            array_tensor(f"{module}.weight_scale", "F16", scales.numpy()),
            array_tensor(f"{module}.weight_shape", "I64", np.array(weight.shape, np.int64)),
        ]
    dest.mkdir(parents=True)
    write_file(dest / "model-fast.safetensors", tensors)
    (dest / "README.md").write_text("variant")


def test_fast_variant_is_composed_over_the_base(fake, tiny, tmp_path, monkeypatch, capsys):
    import fetch_fast_variant

    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    base = tmp_path / "models" / "base"
    shutil.copytree(tiny, base)
    assert run(base, "quant_embed") == 0
    _make_variant(base, tmp_path / "variant-src")
    fake.source = tmp_path / "variant-src"
    base_state = tree_state(base)
    out = tmp_path / "models" / "base-fast"
    args = ["--base", str(base), "--out", str(out), "--downloads", str(tmp_path / "dl")]
    assert fetch_fast_variant.main(args) == 0, capsys.readouterr().err
    assert fake.calls[-1]["repo"] == hub.FAST_REPO
    assert tree_state(base) == base_state  # the base is untouched
    load_check(out)
    fast = ModelDir.open(out)
    assert steps.packed_bits(fast, "lm_head") == 4
    assert all(steps.packed_bits(fast, m) == 4 for m in steps.mtp_linears(ModelDir.open(tiny)))
    assert steps.packed_bits(fast, "model.language_model.embed_tokens") == 8  # the base's prepared embed
    assert steps.quant_problems(fast) == []
    shared = [s for s in set(fast.weight_map.values()) if (base / s).exists()]
    assert shared and all(os.stat(out / s).st_ino == os.stat(base / s).st_ino for s in shared)
    manifest = fast.manifest()["steps"]
    assert set(manifest) == {"quant_embed", "fast_variant"} and manifest["fast_variant"]["repo"] == hub.FAST_REPO
    state = tree_state(out)
    capsys.readouterr()
    assert fetch_fast_variant.main(args) == 0
    assert "already done" in capsys.readouterr().out and tree_state(out) == state and fake.fetches == 1


def test_fast_variant_refuses_a_foreign_target(fake, tiny, tmp_path, capsys):
    import fetch_fast_variant

    out = tmp_path / "fast"
    shutil.copytree(tiny, out)
    assert fetch_fast_variant.main(["--base", str(tiny), "--out", str(out), "--downloads", str(tmp_path / "dl")]) == 2
    assert "not a fast variant built by this script" in capsys.readouterr().err and fake.fetches == 0


def test_fast_variant_over_a_base_with_a_draft_head_lets_the_head_be_built_again(fake, tiny, tmp_path, monkeypatch,
                                                                                  capsys):
    """The variant replaces the lm_head the draft head's rows came from: the head goes, and so does its
    step's record, so build_draft_vocab.py on the variant builds a head from the new lm_head."""
    import fetch_fast_variant

    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    base = tmp_path / "models" / "base"
    shutil.copytree(tiny, base)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(0, 4096, 16))))
    build = [sys.executable, str(REPO / "prepare" / "build_draft_vocab.py")]
    assert subprocess.run([*build, str(base), "--ids", str(ids)], capture_output=True).returncode == 0
    assert step_names.DRAFT_VOCAB in ModelDir.open(base).manifest()["steps"]
    _make_variant(base, tmp_path / "variant-src")
    fake.source = tmp_path / "variant-src"
    out = tmp_path / "models" / "base-fast"
    assert fetch_fast_variant.main(["--base", str(base), "--out", str(out), "--downloads", str(tmp_path / "dl")]) == 0
    fast = ModelDir.open(out)
    assert not fast.module_tensors(steps.DRAFT_HEAD) and "draft_vocab" not in fast.config
    assert step_names.DRAFT_VOCAB not in fast.manifest()["steps"]
    capsys.readouterr()
    assert subprocess.run([*build, str(out), "--ids", str(ids)], capture_output=True).returncode == 0
    assert ModelDir.open(out).module_tensors(steps.DRAFT_HEAD)
