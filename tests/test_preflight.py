"""qwen_serving/preflight.py: one line per check, and every FAIL says what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_serving import preflight
from tests.helpers.fake_gpu import fake_nvidia_smi

REPO = Path(__file__).resolve().parents[1]


def gpus(*rows: str):
    return lambda: "".join(f"{row}\n" for row in rows)


def test_a_3090_with_a_current_driver_passes():
    checks = preflight.gpu_checks(gpus("NVIDIA GeForce RTX 3090, 24576, 580.65.06"))
    assert [c.line() for c in checks] == ["PASS driver: 580.65.06", "PASS gpu: NVIDIA GeForce RTX 3090, 24.0 GiB"]


def test_an_old_driver_fails_with_what_to_install():
    checks = preflight.gpu_checks(gpus("NVIDIA GeForce RTX 3090, 24576, 550.54.15"))
    assert checks[0].line() == ("FAIL driver: 550.54.15 is older than 580, which the CUDA 13 wheels need: "
                                "install NVIDIA driver 580 or newer")


def test_a_small_card_warns_and_the_largest_of_several_counts():
    small = preflight.gpu_checks(gpus("NVIDIA GeForce RTX 4080, 16376, 581.10"))[1]
    assert small.level == "WARN" and "16.0 GiB" in small.message and "KV_MEM=auto" in small.message
    mixed = preflight.gpu_checks(gpus("NVIDIA T400, 2048, 590.1", "NVIDIA RTX A5000, 24564, 590.1"))[1]
    assert mixed.line() == "PASS gpu: NVIDIA RTX A5000, 24.0 GiB (largest of 2)"


def test_no_gpu_and_a_broken_driver_are_one_fail_line_each():
    def missing():
        raise FileNotFoundError("nvidia-smi")

    def broken():
        raise subprocess.CalledProcessError(9, "nvidia-smi", stderr="NVIDIA-SMI has failed because it couldn't "
                                                                    "communicate with the NVIDIA driver.\n")

    (none,) = preflight.gpu_checks(missing)
    assert none.level == "FAIL" and "no nvidia-smi on PATH" in none.message and "--dry-run" in none.message
    (bad,) = preflight.gpu_checks(broken)
    assert bad.level == "FAIL" and "couldn't communicate with the NVIDIA driver" in bad.message
    assert "install or repair the NVIDIA driver (>= 580)" in bad.message


def test_disk_is_measured_where_the_model_will_go(tmp_path):
    target = tmp_path / "not" / "yet" / "models"
    ok = preflight.disk_check(target, need=1)
    assert ok.level == "PASS" and str(tmp_path) in ok.message
    full = preflight.disk_check(target, need=10**18)
    assert full.level == "FAIL" and "make models/ a link to a folder on a larger disk" in full.message


def test_free_space_is_dfs_answer_else_the_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', free_disk=12 * 10**9)}:{os.environ['PATH']}")
    assert preflight.free_bytes(tmp_path) == 12 * 10**9
    short = preflight.disk_check(tmp_path / "models")
    assert short.level == "FAIL" and short.message.startswith("12.0 GB free at") and "need ~40 GB more" in short.message
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))  # no df at all: the kernel answers
    assert preflight.free_bytes(tmp_path) == shutil.disk_usage(tmp_path).free


def test_an_interrupted_download_needs_only_the_rest(tmp_path, monkeypatch):
    model = tmp_path / "models" / "base"
    model.mkdir(parents=True)
    (model / "model-00001.safetensors").write_bytes(b"w" * 3 * 2**20)
    have = preflight.bytes_on_disk(model)
    assert 3 * 2**20 <= have < 4 * 2**20  # blocks on disk, not the apparent size
    monkeypatch.setattr(preflight, "free_bytes", lambda where: 10**9 - have)
    check = preflight.disk_check(model, need=10**9)
    assert check.level == "PASS" and "already there" in check.message
    monkeypatch.setattr(preflight, "free_bytes", lambda where: 10**9 - have - 1)
    assert preflight.disk_check(model, need=10**9).level == "FAIL"


@pytest.mark.parametrize(("version", "level"), [((3, 10, 12), "FAIL"), ((3, 11, 0), "PASS"), ((3, 12, 3), "PASS")])
def test_python_version(version, level):
    check = preflight.python_check(version)
    assert check.level == level and (level == "PASS" or "apt-get install python3.12" in check.message)


def test_module_on_this_machine_prints_lines_and_exits_by_the_result():
    r = subprocess.run([sys.executable, "-m", "qwen_serving.preflight", "--need-disk"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    lines = r.stdout.splitlines()
    assert lines and all(line.split()[0] in ("PASS", "WARN", "FAIL") for line in lines), r.stdout + r.stderr
    assert r.returncode == (1 if any(line.startswith("FAIL") for line in lines) else 0)
