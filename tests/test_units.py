"""Launchers, systemd units, Dockerfile and docker-compose.yml: structure checks, and a simulated first start."""

from __future__ import annotations

import configparser
import fnmatch
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.compose_bin import compose_binary
from tests.helpers.fake_gpu import fake_nvidia_smi

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
    assert len(shared.splitlines()) <= 40
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
    fake_nvidia_smi(root / "fake-gpu")  # on PATH in start(): the preflight sees a 3090 (start(..., gpu=False): none)
    return root


def start(root: Path, folder: str, *args: str, gpu: bool = True, **env: str) -> subprocess.CompletedProcess:
    path = f"{root / 'fake-gpu'}:{os.environ['PATH']}" if gpu else os.environ["PATH"]
    env = {"PATH": path, "HOME": str(root), **env}
    return subprocess.run(["bash", f"{folder}/start_qwen.sh", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_serving_without_a_gpu_stops_before_any_step(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has an NVIDIA GPU")
    root = fake_checkout(tmp_path)
    r = start(root, "batch", gpu=False)
    assert r.returncode == 2 and not (root / "steps.log").exists() and not (root / "vllm.log").exists()
    assert "FAIL gpu: no NVIDIA GPU found" in r.stdout and "--dry-run and explain work without one" in r.stdout


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


def test_no_room_for_the_download_stops_before_any_step(tmp_path):
    root = fake_checkout(tmp_path)
    fake_nvidia_smi(root / "fake-gpu", free_disk=9 * 10**9)
    r = start(root, "single-user")
    assert r.returncode == 2 and not (root / "steps.log").exists() and not (root / "vllm.log").exists()
    assert "FAIL disk: 9.0 GB free at" in r.stdout and "make models/ a link to a folder on a larger disk" in r.stdout


def test_refusal_stops_before_any_step(tmp_path):
    root = fake_checkout(tmp_path)
    r = start(root, "batch", HOST="0.0.0.0")
    assert r.returncode == 2 and "VLLM_API_KEY" in r.stderr and ".env" not in r.stderr
    assert not (root / "steps.log").exists() and not (root / "vllm.log").exists()


@pytest.mark.parametrize("args", [(), ("--prepare",), ("--dry-run",)])
def test_refusal_in_the_image_says_what_to_put_in_dotenv(tmp_path, args):
    root = fake_checkout(tmp_path)
    r = subprocess.run(["bash", "qwen_serving/start_server.sh", "single", *args], cwd=root, capture_output=True,
                       text=True, timeout=120, env={"PATH": os.environ["PATH"], "HOME": str(root), "QS_CONTAINER": "1",
                                                    "HOST": "0.0.0.0", "PUBLISHED_ON": "0.0.0.0"})
    assert r.returncode == 2 and "VLLM_API_KEY" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "qwen-serving: in Docker, knobs go in .env beside docker-compose.yml (a key: VLLM_API_KEY=...); "
        "then run again: docker compose --profile single up -d")
    assert not (root / "steps.log").exists()


@pytest.mark.parametrize("mode", MODES)
def test_prepare_runs_the_modes_own_steps_and_stops(tmp_path, mode):
    root = fake_checkout(tmp_path)
    (root / "prepare").mkdir()
    (root / "prepare" / "draft_vocab_ids.json").write_text("[0, 1, 2]")  # a list the user has: the head is built
    r = subprocess.run(["bash", "qwen_serving/start_server.sh", mode, "--prepare"], cwd=root, capture_output=True,
                       text=True, timeout=120, env={"PATH": os.environ["PATH"], "HOME": str(root)})
    assert r.returncode == 0, r.stderr
    steps = (root / "steps.log").read_text().splitlines()
    missing = subprocess.run(["python3", "-m", "qwen_serving.plan", mode, "--missing"], cwd=root, capture_output=True,
                             text=True, timeout=120, env={"PATH": os.environ["PATH"], "HOME": str(root)}).stdout
    # the fake venv's python records `prepare/x.py ARGS` for `venv/bin/python prepare/x.py ARGS`
    assert steps == [line.split(" ", 1)[1] for line in missing.splitlines() if line.startswith("venv/bin/python ")]
    assert any("build_draft_vocab" in step for step in steps) == (mode == "single")
    assert not (root / "vllm.log").exists()  # --prepare never serves


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
    assert service["WorkingDirectory"] == "%h/qwen-serving"
    # the launcher reads .env with Compose's rules; systemd's reading would differ, and win
    assert "EnvironmentFile" not in service
    # where it is installed, the assumed checkout path is said
    readme = (REPO / folder / "README.md").read_text()
    assert f"cp {folder}/qwen-serving.service" in readme and "checkout is at `~/qwen-serving`" in readme
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


def compose_config(profile: str) -> dict:
    """docker-compose.yml as the real Compose v2 binary resolves it for one profile (no .env, no shell vars)."""
    r = subprocess.run([str(compose_binary()), "--project-directory", str(REPO), "-f", str(REPO / "docker-compose.yml"),
                        "--profile", profile, "config", "--format", "json"], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(REPO)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def image_files() -> set[str]:
    """Tracked files the build context keeps after .dockerignore (its patterns are plain names and globs)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    ignored = [p for p in (REPO / ".dockerignore").read_text().split() if not p.startswith("#")]
    def kept(name: str) -> bool:
        parts = name.split("/")
        return not any(fnmatch.fnmatch(name, pat) or fnmatch.fnmatch(parts[0], pat) or
                       (pat.startswith("**/") and any(fnmatch.fnmatch(part, pat[3:]) for part in parts))
                       for pat in ignored)
    return {name for name in tracked if kept(name)}


@pytest.mark.parametrize(("profile", "folder"), [("single", "single-user"), ("batch", "batch")])
def test_compose_profile_runs_its_own_mode_with_commands_the_image_has(profile, folder):
    services = compose_config(profile)["services"]
    assert set(services) == {profile, f"prepare-{profile}"}
    prepare, server = services[f"prepare-{profile}"], services[profile]
    assert prepare["command"] == ["bash", "qwen_serving/start_server.sh", profile, "--prepare"]
    assert server["command"] == ["bash", f"{folder}/start_qwen.sh"]
    assert server["depends_on"] == {f"prepare-{profile}": {"condition": "service_completed_successfully",
                                                           "required": True}}
    assert server["environment"] == {"HOST": "0.0.0.0", "PORT": "18020", "PUBLISHED_ON": "127.0.0.1"}
    assert server["ports"][0]["host_ip"] == "127.0.0.1" and server["ports"][0]["published"] == "18020"
    assert "deploy" not in prepare and not prepare.get("environment")  # no GPU; no .env here, and none needed
    device = server["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert server["healthcheck"]["start_period"] == "30m0s"
    # every command a service runs is in the image: scripts under WORKDIR (COPY . .), python3 on PATH
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "WORKDIR /opt/qwen-serving" in dockerfile and "\nCOPY . .\n" in dockerfile
    assert "ENV PATH=/opt/qwen-serving/venv/bin:$PATH" in dockerfile  # the healthcheck's python3
    files = image_files()
    for service in (prepare, server):
        assert service["command"][0] == "bash" and service["command"][1] in files
        assert service["volumes"][0]["target"] == "/opt/qwen-serving/models"
    # and what those scripts call: the launchers' target, the plan, the .env reader
    assert {"qwen_serving/start_server.sh", "qwen_serving/plan.py", "qwen_serving/dotenv.py", "install.sh",
            "verify.sh", "prepare/download.py"} <= files


def test_compose_with_a_dotenv_bind_and_key(tmp_path):
    """BIND publishes elsewhere; the key rule then sees PUBLISHED_ON (the env_file is passed, not interpolated)."""
    project = tmp_path / "p"
    project.mkdir()
    shutil.copy(REPO / "docker-compose.yml", project)
    (project / ".env").write_text("BIND=0.0.0.0\nPORT=18099\nVLLM_API_KEY='k e y'\n")
    r = subprocess.run([str(compose_binary()), "--profile", "batch", "config", "--format", "json"], cwd=project,
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    batch = services["batch"]
    assert services["prepare-batch"]["environment"]["VLLM_API_KEY"] == "k e y"  # .env reaches both services
    assert batch["environment"]["PUBLISHED_ON"] == "0.0.0.0" and batch["environment"]["VLLM_API_KEY"] == "k e y"
    assert batch["ports"][0]["host_ip"] == "0.0.0.0" and batch["ports"][0]["published"] == "18099"
