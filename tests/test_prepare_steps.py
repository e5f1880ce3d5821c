"""prepare/quant_*.py on the tiny synthetic checkpoint: what they write, idempotence, wrong input."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from qwen_serving.checkpoint import int8, rewrite, steps, transaction
from qwen_serving.checkpoint.model_dir import ModelDir
from qwen_serving.checkpoint.safetensors_io import SafetensorsFile, array_tensor, to_f32, write_file
from tests.helpers.tiny_checkpoint import EPOCH, STEPS, load_check, make_tiny, run, tree_state


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory)


@pytest.fixture
def model(tiny_source, tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    dest = tmp_path / "models" / "tiny"
    dest.parent.mkdir()
    shutil.copytree(tiny_source, dest)
    return dest


def test_round_trip_error_bounds():
    rng = np.random.default_rng(0)
    for weight in (
        rng.normal(0, 0.02, size=(256, 1024)),
        rng.normal(0, 1.0, size=(64, 512)),
        rng.standard_t(5, size=(128, 512)) * 0.01,  # heavier tails than a Gaussian
    ):
        weight = weight.astype(np.float32)
        for dtype in ("BF16", "F16"):
            codes, scales = int8.quantize_rows(weight, dtype)
            meter = int8.ErrorMeter()
            meter.add(weight, int8.dequantize_rows(codes, scales, dtype))
            assert 0.002 < meter.relative < 0.01, (dtype, meter.relative)
    exact = np.concatenate([np.arange(-127, 1), np.arange(0, 128)]).astype(np.float32)[None, :] * 0.5  # scale 0.5
    codes, scales = int8.quantize_rows(exact, "BF16")
    assert np.array_equal(int8.dequantize_rows(codes, scales, "BF16"), exact)
    zeros = np.zeros((2, 128), np.float32)
    codes, scales = int8.quantize_rows(zeros, "BF16")
    assert not codes.any() and not int8.dequantize_rows(codes, scales, "BF16").any()


def test_error_meter_equals_float64_sums_over_chunks():
    rng = np.random.default_rng(1)
    weight = (rng.normal(0, 0.02, size=(300, 1024)) * rng.lognormal(size=(300, 1))).astype(np.float32)
    meter = int8.ErrorMeter()
    for r0 in range(0, 300, 64):  # as a matrix streams, the last chunk short
        block = weight[r0:r0 + 64]
        meter.add(block, int8.dequantize_rows(*int8.quantize_rows(block, "BF16"), "BF16"))
    restored = int8.dequantize_rows(*int8.quantize_rows(weight, "BF16"), "BF16").astype(np.float64)
    want = np.sqrt(((weight - restored) ** 2).sum() / (weight.astype(np.float64) ** 2).sum())
    assert meter.relative == pytest.approx(want, rel=1e-6)
    assert meter.max_abs == np.abs(weight - restored).max()
    huge = np.zeros((2, 128), np.float32)
    huge[0, 0], huge[1] = 3e19, 1.0  # its float32 square overflows
    big = int8.ErrorMeter()
    big.add(huge, np.zeros_like(huge))
    assert big.relative == 1.0 and big.ref_sq == pytest.approx(9e38 + 128)


def test_quant_lm_head_changes_only_lm_head(model, capsys):
    before = ModelDir.open(model)
    original = {t: bytes(before.shards[s].array(t).tobytes()) for t, s in before.weight_map.items()}
    lm = to_f32(np.asarray(before.shards[before.weight_map["lm_head.weight"]].array("lm_head.weight")), "BF16")
    assert run(model, "quant_lm_head") == 0
    out = capsys.readouterr().out
    assert "round-trip error 0.6" in out and "GB freed" in out

    after = ModelDir.open(model)
    assert not after.has("lm_head.weight")
    for name, data in original.items():
        if name != "lm_head.weight":
            assert bytes(after.shards[after.weight_map[name]].array(name).tobytes()) == data, name
    shard = after.shards[after.weight_map["lm_head.weight_packed"]]
    vocab, hidden = lm.shape
    assert shard.tensors["lm_head.weight_packed"].dtype == "I32"
    assert shard.tensors["lm_head.weight_packed"].shape == (vocab, hidden // 4)
    assert shard.tensors["lm_head.weight_scale"].shape == (vocab, hidden // 128)
    assert shard.array("lm_head.weight_shape").tolist() == [vocab, hidden]
    restored = int8.dequantize_rows(int8.unpack(np.asarray(shard.array("lm_head.weight_packed"))),
                                    np.asarray(shard.array("lm_head.weight_scale")), "BF16")
    assert np.linalg.norm(restored - lm) / np.linalg.norm(lm) < 0.01
    record = json.loads((model / "prepared.json").read_text())["steps"]["quant_lm_head"]
    assert record["bytes_before"] == vocab * hidden * 2 and record["bytes_before"] > record["bytes_after"]
    assert record["done"] == "2023-11-14T22:13:20Z" and 0.004 < record["relative_error"] < 0.01
    assert set(record["inputs"]) == {before.weight_map["lm_head.weight"]}
    load_check(model)


def test_every_step_then_rerun_is_a_noop(model, capsys):
    for step in STEPS:
        assert run(model, step) == 0
    load_check(model)
    state = tree_state(model)
    capsys.readouterr()
    for step in STEPS:
        assert run(model, step) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 1 and "already done" in lines[0], lines
    assert tree_state(model) == state
    assert not transaction.leftovers(model)
    model_dir = ModelDir.open(model)
    assert steps.mtp_linears(model_dir) == []
    assert steps.packed_bits(model_dir, "model.language_model.embed_tokens") == 8


def test_steps_are_deterministic(tiny_source, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    states = []
    for name in ("a", "b"):
        dest = tmp_path / name / "tiny"
        shutil.copytree(tiny_source, dest)
        for step in STEPS:
            assert run(dest, step) == 0
        states.append(tree_state(dest))
    assert states[0] == states[1]


def test_error_above_limit_aborts_with_no_write(model, monkeypatch, capsys):
    state = tree_state(model)
    monkeypatch.setattr(steps, "MAX_RELATIVE_ERROR", 1e-4)
    assert run(model, "quant_lm_head") == 2
    assert "exceeds" in capsys.readouterr().err
    assert tree_state(model) == state and not transaction.leftovers(model)


def _drop_shard(path: Path) -> None:
    (path / "model-00002-of-00005.safetensors").unlink()


def _truncate_shard(path: Path) -> None:
    shard = path / "model-00003-of-00005.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])


def _not_qwen(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["model_type"], config["text_config"]["model_type"] = "llama", "llama"
    (path / "config.json").write_text(json.dumps(config))


def _gptq(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "gptq"
    (path / "config.json").write_text(json.dumps(config))


def _tied(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(config))


def _int8_without_manifest(path: Path) -> None:
    assert run(path, "quant_lm_head") == 0
    (path / "prepared.json").unlink()


@pytest.mark.parametrize(
    ("spoil", "step", "message"),
    [
        (_drop_shard, "quant_lm_head", "model-00002-of-00005.safetensors is missing"),
        (_truncate_shard, "quant_embed", "truncated"),
        (_not_qwen, "quant_lm_head", "not a qwen3_5 checkpoint"),
        (_gptq, "quant_lm_head", "only compressed-tensors"),
        (_tied, "quant_lm_head", "tie_word_embeddings"),
        (_int8_without_manifest, "quant_lm_head", "already quantized (int8"),
    ],
)
def test_wrong_input_is_refused_without_write(model, capsys, spoil, step, message):
    spoil(model)
    state = tree_state(model)
    capsys.readouterr()
    assert run(model, step) == 2
    assert message in capsys.readouterr().err
    assert tree_state(model) == state and not transaction.leftovers(model)


def test_missing_directory(tmp_path, capsys):
    assert run(tmp_path / "nowhere" / "model", "quant_lm_head") == 2
    assert "not found" in capsys.readouterr().err


def test_disk_too_small(model, monkeypatch, capsys):
    state = tree_state(model)
    monkeypatch.setattr(rewrite.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    assert run(model, "quant_mtp") == 2
    assert "not enough disk space" in capsys.readouterr().err
    assert tree_state(model) == state and not transaction.leftovers(model)


def test_concurrent_step_is_refused(model, capsys):
    with transaction.locked(model.resolve()):
        assert run(model, "quant_lm_head") == 2
    assert "another prepare step is running" in capsys.readouterr().err
    assert run(model, "quant_lm_head") == 0


def test_commit_without_rename_exchange(model, tiny_source, tmp_path, monkeypatch):
    reference = tmp_path / "ref" / "tiny"
    shutil.copytree(tiny_source, reference)
    assert run(reference, "quant_embed") == 0
    monkeypatch.setattr(transaction, "exchange_paths", lambda a, b: False)
    assert run(model, "quant_embed") == 0
    assert tree_state(model) == tree_state(reference)
    assert not transaction.leftovers(model)


@pytest.mark.parametrize("decided", [True, False])
def test_recover_an_interrupted_two_rename_commit(model, tiny_source, tmp_path, decided):
    """The fallback commit killed between its two renames: finish it if decided, else roll back."""
    new_state = tmp_path / "new" / "tiny"
    shutil.copytree(tiny_source, new_state)
    assert run(new_state, "quant_lm_head") == 0
    staging, old = transaction.staging_path(model), transaction.old_path(model)
    shutil.copytree(new_state, staging)
    if decided:
        (staging / transaction.COMMIT_MARKER).touch()
    before = tree_state(model)
    os.rename(model, old)
    assert run(model, "quant_lm_head") == 0  # recovers first, then runs (or finds it done)
    expected = tree_state(new_state)
    assert tree_state(model) == expected
    if not decided:
        assert before != expected  # it rolled back and then did the step itself
    assert not transaction.leftovers(model)


def test_single_file_checkpoint_gets_an_index(model):
    source = ModelDir.open(model)
    tensors = [array_tensor(t, source.info(t).dtype, np.asarray(source.shards[s].array(t)))
               for t, s in sorted(source.weight_map.items())]
    single = model.parent / "single"
    single.mkdir()
    write_file(single / "model.safetensors", tensors)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, single / name)
    assert run(single, "quant_lm_head") == 0
    assert (single / "model.safetensors.index.json").exists() and not (single / "model.safetensors").exists()
    load_check(single)
    assert SafetensorsFile(single / "model.quant_lm_head.safetensors").tensors["lm_head.weight_packed"].dtype == "I32"
