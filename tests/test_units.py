"""Launchers, systemd units, Dockerfile and docker-compose.yml: structure checks, and a simulated first start."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MODES = {"batch": "batch", "single": "single-user"}


# ---- start_qwen.sh ----
@pytest.mark.parametrize("folder", MODES.values())
def test_launcher_is_short_and_only_calls_the_plan(folder):
    text = (REPO / folder / "start_qwen.sh").read_text()
    assert len(text.splitlines()) <= 30
    mode = {"batch": "batch", "single-user": "single"}[folder]
    code = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert code == [f'exec bash "$(dirname "${{BASH_SOURCE[0]}}")/../qwen_serving/start_server.sh" {mode} "$@"']
    shared = (REPO / "qwen_serving" / "start_server.sh").read_text()
    assert len(shared.splitlines()) <= 30
    body = [line for line in shared.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert all("vllm serve" not in line for line in body)  # the command comes from the plan only
    assert body[-1].startswith('exec venv/bin/python -m qwen_serving.plan "$MODE" run')


def fake_checkout(tmp_path: Path) -> Path:
    """A copy of the launcher's world with a fake venv: python -m runs the real plan, anything else
    is a recorded first-start step; vllm records its argv and the key it was given."""
    root = tmp_path / "repo"
    for part in ("qwen_serving", "batch", "single-user"):
        shutil.copytree(REPO / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    bin_dir = root / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text('#!/usr/bin/env bash\n[ "$1" = -m ] && exec python3 "$@"\n'
                                    'echo "$*" >> "$(dirname "$0")/../../steps.log"\n')
    (bin_dir / "vllm").write_text('#!/usr/bin/env bash\necho "$* | key=$VLLM_API_KEY | '
                                  'spec_attn=${VLLM_SPEC_DECODE_ATTN:-}" > "$(dirname "$0")/../../vllm.log"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return root


def start(root: Path, folder: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(root), **env}
    return subprocess.run(["bash", f"{folder}/start_qwen.sh", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_first_start_runs_missing_steps_then_execs_vllm(tmp_path):
    root = fake_checkout(tmp_path)
    drafter = root / "models" / "Qwen3.8-27B-DFlash2-W4A16"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    (root / "api_key.txt").write_text("file-key\n")
    r = start(root, "single-user", HOST="0.0.0.0", SPEC="dflash2")
    assert r.returncode == 0, r.stderr
    steps = (root / "steps.log").read_text().splitlines()
    assert steps[0] == "prepare/download.py" and "prepare/fetch_fast_variant.py" in steps
    assert "== first start, step 1/" in r.stdout
    served = (root / "vllm.log").read_text()
    assert served.startswith("serve models/Qwen3.8-27B-W4A16-AutoRound ") and "--host 0.0.0.0" in served
    # the key came through the environment only, beside the plan's exports (the LOOKUP stub is gone: knobs branch)
    assert served.endswith("| key=file-key | spec_attn=1\n")
    assert "file-key" not in served.split("|")[0] and "file-key" not in r.stdout + r.stderr


def test_refusal_stops_before_any_step(tmp_path):
    root = fake_checkout(tmp_path)
    r = start(root, "batch", HOST="0.0.0.0")
    assert r.returncode == 2 and "VLLM_API_KEY" in r.stderr
    assert not (root / "steps.log").exists() and not (root / "vllm.log").exists()


@pytest.mark.parametrize("action", ["--dry-run", "explain"])
def test_dry_run_and_explain_pass_through(tmp_path, action):
    root = fake_checkout(tmp_path)
    r = start(root, "batch", action)
    assert r.returncode == 0, r.stderr
    assert not (root / "steps.log").exists() and not (root / "vllm.log").exists()
    assert ("vllm serve" in r.stdout) if action == "--dry-run" else ("# derived" in r.stdout)


# ---- systemd units ----
def systemd_unescape(text: str) -> str:
    return text.replace("$$", "$")


@pytest.mark.parametrize("folder", MODES.values())
def test_systemd_unit(folder, tmp_path):
    path = REPO / folder / "qwen-serving.service"
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str
    unit.read_string(path.read_text())
    assert unit.sections() == ["Unit", "Service", "Install"]
    service = unit["Service"]
    assert service["Restart"] == "on-failure" and service["ExecStart"].endswith(f"/{folder}/start_qwen.sh")
    assert service["ExecStart"].startswith("/bin/bash %h/qwen-serving/")
    assert unit["Install"]["WantedBy"] == "default.target"  # a user unit
    # the wait-for-GPU step is valid bash once systemd has turned $$ into $
    pre = service["ExecStartPre"]
    assert pre.startswith("/bin/bash -c '") and pre.endswith("'")
    script = tmp_path / "pre.sh"
    script.write_text("#!/bin/bash\n" + systemd_unescape(pre[len("/bin/bash -c '"):-1]) + "\n")
    assert "$" not in pre.replace("$$", "")  # every $ is escaped from systemd's own expansion
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout
    # with no busy GPU (or no nvidia-smi at all) the wait returns at once
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (fake / "nvidia-smi").chmod(0o755)
    r = subprocess.run(["bash", str(script)], env={"PATH": f"{fake}:/usr/bin:/bin"}, timeout=30)
    assert r.returncode == 0


def test_systemd_analyze_verify_where_it_runs(tmp_path):
    tool = shutil.which("systemd-analyze")
    if not tool:
        pytest.skip("no systemd-analyze")
    for folder in MODES.values():
        unit = tmp_path / f"qs-{folder}.service"
        unit.write_text((REPO / folder / "qwen-serving.service").read_text().replace("%h/qwen-serving", str(REPO)))
        r = subprocess.run([tool, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
        if "Failed to initialize manager" in r.stderr or "Failed to lookup RuntimeDirectory" in r.stderr:
            pytest.skip("systemd-analyze cannot start a manager here (no systemd); test_systemd_unit parses instead")
        assert r.returncode == 0, r.stderr


# ---- Dockerfile and compose ----
def test_dockerfile():
    lines = [line for line in (REPO / "Dockerfile").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[0].startswith("FROM nvidia/cuda:13.") and "runtime" in lines[0]
    text = "\n".join(lines)
    assert "python3.12-venv" in text and "RUN PYTHON=python3.12 bash install.sh" in text
    # install.sh creates the venv, installs the pins, applies the series and runs verify.sh --install
    install = (REPO / "install.sh").read_text()
    assert "patchset apply" in install and "verify.sh --install" in install
    for copied in ("install.sh", "verify.sh", "qwen_serving/", "patches/"):
        assert copied in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"models", "venv", ".env", "api_key.txt", ".git"} <= set(ignored)


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_structure():
    services = compose()["services"]
    assert set(services) == {"prepare", "single", "batch"}
    assert services["prepare"]["profiles"] == ["single", "batch"]
    for name, folder in (("single", "single-user"), ("batch", "batch")):
        s = services[name]
        assert s["profiles"] == [name] and s["command"] == ["bash", f"{folder}/start_qwen.sh"]
        assert s["depends_on"]["prepare"]["condition"] == "service_completed_successfully"
        assert "./models:/opt/qwen-serving/models" in s["volumes"]
        assert s["env_file"] == [{"path": ".env", "required": False}]
        assert s["ports"] == ["${BIND:-127.0.0.1}:${PORT:-18020}:18020"]
        assert s["environment"]["PUBLISHED_ON"] == "${BIND:-127.0.0.1}"  # the API-key rule sees the real exposure
        device = s["deploy"]["resources"]["reservations"]["devices"][0]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        health = s["healthcheck"]
        assert "http://127.0.0.1:18020/health" in " ".join(health["test"]) and health["start_period"] == "30m"


def test_compose_config_where_the_plugin_exists():
    docker = shutil.which("docker")
    if not docker or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no docker compose plugin; test_compose_structure checks the file")
    for profile in ("single", "batch"):
        r = subprocess.run([docker, "compose", "--profile", profile, "config", "--quiet"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
