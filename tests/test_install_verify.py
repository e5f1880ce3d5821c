"""verify.sh and install.sh against the CPU venv: PASS/WARN/FAIL lines, exit codes, idempotent install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv_link(tmp_path_factory) -> Path:
    """A venv folder whose python is the test interpreter (the CPU venv with pinned vllm).

    Its `python -m pip` is blocked: a test must never install into the shared CPU venv.
    """
    venv = tmp_path_factory.mktemp("venv")
    (venv / "bin").mkdir()
    wrapper = venv / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then echo "pip blocked in tests" >&2; exit 97; fi\n'
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return venv


def run(script: str, *args: str, pythonpath: str, venv: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": pythonpath, "QS_VENV": str(venv), **env}
    return subprocess.run(["bash", str(REPO / script), *args], capture_output=True, text=True, env=full_env,
                          cwd=REPO, timeout=300)


def patched_path() -> str:
    patched = os.environ.get("QS_PATCHED_VLLM")
    if not patched:
        pytest.skip("needs the patched vllm copy made by tests/run.sh")
    return f"{Path(patched).parent}:{REPO}"


def test_verify_passes_on_patched_tree_and_warns_without_gpu(venv_link):
    result = run("verify.sh", pythonpath=patched_path(), venv=venv_link, MODEL="/nonexistent/model")
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(line.split()[0] in ("PASS", "WARN", "FAIL") for line in lines)
    assert any(line.startswith("PASS vllm: 0.28.0") for line in lines)
    assert any(line.startswith("PASS patches:") for line in lines)
    assert any(line.startswith("WARN gpu: no GPU") for line in lines)
    assert any(line.startswith("WARN model:") for line in lines)


def test_verify_require_gpu_fails_without_gpu(venv_link):
    result = run("verify.sh", "--require-gpu", pythonpath=patched_path(), venv=venv_link)
    assert result.returncode == 1
    assert "FAIL gpu: no CUDA GPU visible" in result.stdout


def test_verify_fails_on_pristine_vllm_when_series_has_patches(venv_link, pristine_vllm):
    from qwen_serving import patchset

    if not patchset.read_series(patchset.DEFAULT_SERIES):
        pytest.skip("empty series")
    result = run("verify.sh", "--install", pythonpath=f"{pristine_vllm.parent}:{REPO}", venv=venv_link)
    assert result.returncode == 1
    assert "FAIL patches:" in result.stdout and "patchset apply" in result.stdout


def test_verify_rejects_unknown_option(venv_link):
    result = run("verify.sh", "--bogus", pythonpath=str(REPO), venv=venv_link)
    assert result.returncode == 2 and "unknown option --bogus" in result.stderr


def test_install_on_complete_install_changes_nothing_and_says_so(venv_link):
    result = run("install.sh", pythonpath=patched_path(), venv=venv_link)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines() == [
        f"[install] already installed: {venv_link} has vllm 0.28.0 with the patch series applied; nothing changed"]


def test_install_names_the_step_when_python_is_too_old(tmp_path):
    fake_python = tmp_path / "python3"
    fake_python.write_text("#!/bin/sh\n[ \"$1\" = -V ] && echo 'Python 3.8.10' && exit 0\nexit 1\n")
    fake_python.chmod(0o755)
    result = run("install.sh", pythonpath=str(REPO), venv=tmp_path / "newvenv", PYTHON=str(fake_python))
    assert result.returncode == 1
    assert 'FAILED at step "create venv"' in result.stderr and "Python >= 3.11" in result.stderr
    assert not (tmp_path / "newvenv").exists()
