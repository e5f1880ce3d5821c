"""python -m qwen_serving.checkpoint.prepare_status: the lines verify.sh prints for the model directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from qwen_serving.checkpoint import prepare_status, transaction
from qwen_serving.checkpoint.safetensors_io import SafetensorsFile
from tests.helpers.tiny_checkpoint import EPOCH, REPO, STEPS, make_tiny, run


@pytest.fixture
def model(tmp_path_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    dest = tmp_path / "models" / "tiny"
    shutil.copytree(make_tiny(tmp_path_factory), dest)
    return dest


def status(capsys, *args) -> tuple[int, list[str]]:
    code = prepare_status.main([str(a) for a in args])
    return code, capsys.readouterr().out.strip().splitlines()


def test_unprepared_model_warns_per_step(model, capsys):
    code, lines = status(capsys, model)
    assert code == 0
    assert all(line[:4] in ("PASS", "WARN") for line in lines)
    warned = [line for line in lines if line.startswith("WARN")]
    assert len(warned) == 4 and "quant_lm_head.py" in warned[0] and "quant_embed.py" in warned[1]
    assert "quant_mtp.py" in warned[2] and "single-user/calibrate.sh" in warned[3]
    assert any("5 shard(s) complete" in line for line in lines) and "PASS model: tokenizer present" in lines
    assert status(capsys, model, "--strict")[0] == 1


def test_fully_prepared_model_passes(model, tmp_path, capsys):
    for step in STEPS:
        assert run(model, step) == 0
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(0, 4000, 7))))
    subprocess.run([sys.executable, str(REPO / "prepare" / "build_draft_vocab.py"), str(model), "--ids", str(ids)],
                   check=True, capture_output=True)
    capsys.readouterr()
    code, lines = status(capsys, model, "--deep", "--strict")
    assert code == 0, lines
    assert all(line.startswith("PASS") for line in lines)
    assert "PASS lm_head: int8 (quant_lm_head recorded in prepared.json)" in lines
    assert any(line.startswith("PASS hashes: 6 file(s)") for line in lines), lines
    # the CLI as verify.sh runs it
    proc = subprocess.run([sys.executable, "-m", "qwen_serving.checkpoint.prepare_status", str(model)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.count("PASS") == len(lines) - 1


def test_contradictions_and_damage_fail(model, tmp_path, capsys):
    prepared = tmp_path / "prepared"
    shutil.copytree(model, prepared)
    assert run(prepared, "quant_lm_head") == 0
    shutil.copy(prepared / "prepared.json", model / "prepared.json")  # a record the tensors contradict
    code, lines = status(capsys, model)
    assert code == 1 and any(line.startswith("FAIL lm_head: bf16, but prepared.json records quant_lm_head") for line in lines)

    shard = next(prepared.glob("*.quant_lm_head.safetensors"))
    data = bytearray(shard.read_bytes())
    data[SafetensorsFile(shard).tensors["lm_head.weight_packed"].start + 7] ^= 0xFF  # only the hash can tell
    shard.write_bytes(bytes(data))
    assert status(capsys, prepared)[0] == 0
    code, lines = status(capsys, prepared, "--deep")
    assert code == 1 and any(line.startswith("FAIL hashes: 1 file(s) differ") for line in lines)

    transaction.staging_path(prepared).mkdir()
    shard.write_bytes(bytes(data[:-100]))
    code, lines = status(capsys, prepared)
    assert code == 1 and lines[0].startswith("WARN model: leftover") and "truncated" in lines[1]
