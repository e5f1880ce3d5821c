"""verify.sh and install.sh against the CPU venv: PASS/WARN/FAIL lines, exit codes, idempotent install."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
    result = run("verify.sh", "--no-server", pythonpath=patched_path(), venv=venv_link, MODEL="/nonexistent/model")
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(line.split()[0] in ("PASS", "WARN", "FAIL") for line in lines)
    assert any(line.startswith("PASS vllm: 0.28.0") for line in lines)
    assert any(line.startswith("PASS patches:") for line in lines)
    assert any(line.startswith("WARN gpu: no GPU") for line in lines)
    assert any(line.startswith("WARN model:") for line in lines)


def test_verify_require_gpu_fails_without_gpu(venv_link):
    result = run("verify.sh", "--require-gpu", "--no-server", pythonpath=patched_path(), venv=venv_link)
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


def fake_python(bin_dir: Path, name: str, kind: str) -> Path:
    """A `name` on PATH that behaves like one kind of interpreter install.sh may meet.

    shim: a pyenv shim for a version pyenv lacks; old: Python 3.10; novenv: Debian's python without
    python3.X-venv; good: this interpreter, whose `-m venv` makes a venv whose pip is blocked."""
    bin_dir.mkdir(exist_ok=True)
    site = bin_dir / f"site-{name}"
    site.mkdir()
    if kind == "old":
        (site / "sitecustomize.py").write_text("import sys\nsys.version_info = (3, 10, 12, 'final', 0)\n")
    if kind == "novenv":
        (site / "ensurepip.py").write_text("raise ModuleNotFoundError(\"No module named 'ensurepip'\")\n")
    body = {
        "shim": f'echo "pyenv: {name}: command not found" >&2\nexit 127\n',
        "good": 'if [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin"\n'
                '  printf \'#!/bin/sh\\necho "pip blocked in tests" >&2\\nexit 97\\n\' > "$3/bin/python"\n'
                '  chmod +x "$3/bin/python"; exit 0; fi\n'
                f'exec {sys.executable} "$@"\n',
    }.get(kind, f'PYTHONPATH={site} exec {sys.executable} "$@"\n')
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def install_with(tmp_path: Path, **pythons: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    for name, kind in pythons.items():
        fake_python(bin_dir, name.replace("_", "."), kind)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", QS_VENV=str(tmp_path / "newvenv"), PYTHONPATH=str(REPO))
    return subprocess.run(["bash", str(REPO / "install.sh")], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


def test_install_skips_a_broken_shim_and_takes_the_next_good_python(tmp_path):
    result = install_with(tmp_path, python3_12="shim", python3_11="good")
    shim, good = tmp_path / "bin" / "python3.12", tmp_path / "bin" / "python3.11"
    assert f"[install] skipping python3.12 ({shim}): does not run (exit 127: pyenv: python3.12: command not found)" \
        in result.stderr
    assert f"[install] 1/4 create {tmp_path / 'newvenv'} with {good} (Python 3." in result.stdout
    # it got past the venv: the fake venv's blocked pip is what stops it
    assert result.returncode == 1 and 'FAILED at step "pip install"' in result.stderr, result.stderr


def test_install_names_every_unusable_python(tmp_path):
    result = install_with(tmp_path, python3_12="shim", python3_11="novenv", python3="old")
    assert result.returncode == 1
    notes = [line for line in result.stderr.splitlines() if line.startswith("[install] skipping")]
    assert [n.split(": ", 1)[1] for n in notes] == [
        "does not run (exit 127: pyenv: python3.12: command not found)",
        f"Python {sys.version.split()[0]} has no venv module: apt-get install python{sys.version_info[0]}."
        f"{sys.version_info[1]}-venv",
        "Python 3.10.12, need >= 3.11"]
    assert 'FAILED at step "create venv": no usable Python >= 3.11' in result.stderr
    assert not (tmp_path / "newvenv").exists()


def test_install_refuses_an_unusable_python_named_by_python(tmp_path):
    old = fake_python(tmp_path / "bin", "python3", "old")
    result = run("install.sh", pythonpath=str(REPO), venv=tmp_path / "newvenv", PYTHON=str(old))
    assert result.returncode == 1
    assert f'FAILED at step "create venv": PYTHON={old}: Python 3.10.12, need >= 3.11' in result.stderr
    assert not (tmp_path / "newvenv").exists()


# ---- the live-server probe, against a fake vLLM on loopback ----
BOOT_LOG = """INFO 12-01 10:00:01 [core.py:123] Initializing a V1 LLM engine (v0.28.0) with config: model='models/x', \
speculative_config=SpeculativeConfig(method='mtp', model='models/x', num_spec_tokens=3), tokenizer='models/x'
INFO 12-01 10:00:09 [cuda.py:487] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'TRITON_ATTN'].
INFO 12-01 10:01:30 [kv_cache_utils.py:1870] GPU KV cache size: 96,432 tokens, Maximum concurrency for 65,536 tokens per request: 1.47x
"""
METRICS = ('# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
           'vllm:cache_config_info{block_size="784",cache_dtype="fp8",engine="0",kv_cache_size_tokens="96432",'
           'num_gpu_blocks="123"} 1.0\n')


class FakeVllm(ThreadingHTTPServer):
    """/health, /v1/models, /v1/chat/completions, /metrics, and /server_info when dev_mode is set."""

    def __init__(self, key: str = "", dev_mode: bool = False):
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.key, self.dev_mode, self.chats = key, dev_mode, []


class FakeHandler(BaseHTTPRequestHandler):
    server: FakeVllm

    def log_message(self, *args):  # quiet
        pass

    def reply(self, status: int, body: object) -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def authorized(self) -> bool:
        if self.server.key and self.headers.get("Authorization") != f"Bearer {self.server.key}":
            self.reply(401, {"error": "Unauthorized"})
            return False
        return True

    def do_GET(self):
        if self.path == "/health":
            return self.reply(200, "")
        if not self.authorized():
            return None
        if self.path == "/v1/models":
            return self.reply(200, {"data": [{"id": "qwen3.8-27b"}]})
        if self.path == "/metrics":
            return self.reply(200, METRICS)
        if self.path.startswith("/server_info") and self.server.dev_mode:
            return self.reply(200, {"vllm_config": {
                "speculative_config": {"method": "dflash2", "num_speculative_tokens": 7},
                "attention_config": {"backend": None}}})
        return self.reply(404, {"detail": "Not Found"})

    def do_POST(self):
        if not self.authorized():
            return None
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.chats.append(body)
        return self.reply(200, {"choices": [{"message": {"role": "assistant", "content": "ready"}}],
                                "usage": {"completion_tokens": 2}})


@pytest.fixture
def fake_vllm(request):
    server = FakeVllm(**getattr(request, "param", {}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def server_check(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_API_KEY": "", **env}
    return subprocess.run([sys.executable, "-m", "bench.server_check", *args], capture_output=True, text=True,
                          env=full, cwd=REPO, timeout=120)


def test_server_probe_reads_health_chat_pool_and_the_boot_log(fake_vllm, tmp_path):
    log = tmp_path / "server.log"
    log.write_text(BOOT_LOG)
    r = server_check("--mode", "batch", "--log", str(log), PORT=str(fake_vllm.server_port))
    assert r.returncode == 0, r.stdout + r.stderr
    base = f"http://127.0.0.1:{fake_vllm.server_port}"
    lines = r.stdout.splitlines()
    assert lines[0] == f"PASS server: {base}/health OK"
    assert lines[1].startswith("PASS chat: qwen3.8-27b answered 2 tokens in ") and lines[1].endswith("'ready'")
    assert lines[2:] == ["PASS kv pool: 123 blocks of 784 tokens, 96432 tokens in all (kv dtype fp8)",
                         "PASS attention backend: FLASH_ATTN (the log)",
                         "PASS spec decode: mtp with 3 speculative tokens"]
    chat = fake_vllm.chats[0]
    assert chat["model"] == "qwen3.8-27b" and chat["max_tokens"] <= 16 and chat["temperature"] == 0


@pytest.mark.parametrize("fake_vllm", [{"dev_mode": True, "key": "k1"}], indirect=True)
def test_server_probe_takes_spec_from_server_info_and_sends_the_key(fake_vllm):
    r = server_check(PORT=str(fake_vllm.server_port), VLLM_API_KEY="k1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS spec decode: dflash2 with 7 speculative tokens" in r.stdout
    # vLLM picks the backend at boot and /server_info says null: only the log knows
    assert "WARN attention backend: not known (pass --log FILE with the server's output)" in r.stdout
    wrong = server_check(PORT=str(fake_vllm.server_port), VLLM_API_KEY="wrong")
    assert wrong.returncode == 1 and "FAIL server: 401 Unauthorized; set VLLM_API_KEY" in wrong.stdout


def test_a_server_that_is_down_is_one_fail_line_in_verify(venv_link):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run("verify.sh", "--mode", "batch", pythonpath=patched_path(), venv=venv_link, MODEL="/nonexistent",
            PORT=str(port))
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    fails = [line for line in r.stdout.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith(f"FAIL server: nothing answers at http://127.0.0.1:{port} (")
    assert "pass --no-server" in fails[0]
