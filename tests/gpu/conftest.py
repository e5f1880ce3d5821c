"""GPU smoke session (tests/gpu/README.md): synthesise the two checkpoints, start the three engine
configurations once and all at the same time, hand them to the tests, write gpu-smoke-h200.json.

Collected on CPU too (CI deselects the tests with -m "not gpu"): nothing here touches CUDA at import.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import smoke_lib as lib

from bench import serving

HERE = Path(__file__).resolve().parent
REPO, RESULTS, WORK = lib.REPO, lib.RESULTS, lib.WORK
RESULT_JSON = "gpu-smoke-h200.json"
SERVER_START_TIMEOUT_S = 600  # first start of a config is ~200 s (Triton JIT of the GDN kernels)
SERVER_LOG_MAX_BYTES = 8 << 20  # results come back through a 16 MiB-per-file transfer
SYNTH_TIMEOUT_S = 600

_session_t0 = time.monotonic()
_outcomes: dict[str, str] = {}
_record: dict | None = None  # created when a GPU session really starts; absent in CPU runs


def say(message: str) -> None:
    """Progress for whoever polls the runner's log: bypasses pytest's output capture."""
    stream = sys.__stderr__ or sys.stderr
    stream.write(f"[gpu-smoke +{time.monotonic() - _session_t0:6.1f}s] {message}\n")
    stream.flush()


def synthesise(size: str, out: Path, record: dict, extra: tuple[str, ...] = ()) -> Path:
    """`python -m qwen_serving.checkpoint.synth` into a fresh `out`; timed into record['phases_s'].

    QS_GPU_<SIZE>_CKPT (e.g. QS_GPU_TINY_CKPT) names an existing checkpoint to use instead.
    """
    given = os.environ.get(f"QS_GPU_{size.upper()}_CKPT")
    if given:
        say(f"synth {size}: using {given}")
        return Path(given)
    if out.exists():
        shutil.rmtree(out)
    argv = [sys.executable, "-m", "qwen_serving.checkpoint.synth", "--size", size, *extra, "--out", str(out), "--seed", "0"]
    say(f"synth {size}: {' '.join(argv[1:])}")
    t0 = time.monotonic()
    done = subprocess.run(
        argv, cwd=REPO, env=lib.child_env(os.environ), capture_output=True, text=True, timeout=SYNTH_TIMEOUT_S, check=False
    )
    seconds = round(time.monotonic() - t0, 1)
    record["phases_s"][f"synth_{size}"] = seconds
    if done.returncode != 0 or not (out / "config.json").exists():
        raise RuntimeError(
            f"synth --size {size} failed (rc {done.returncode}, {seconds} s)\n"
            f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
        )
    say(f"synth {size}: done in {seconds} s")
    return out


class Fleet:
    """The three servers of the session, launched together so their start-ups (mostly CPU-side JIT) overlap."""

    def __init__(self, record: dict):
        self.record = record
        self.servers: dict[str, lib.SmokeServer] = {}
        self.errors: dict[str, str] = {}
        self.pgid_file = WORK / "server-pgids"

    def launch(self, key: str, spec: lib.ServerSpec) -> None:
        server = lib.SmokeServer(spec, RESULTS / spec.log_name, lib.child_env(os.environ), python=sys.executable)
        server.launch()
        assert server.proc is not None
        # run_on_device.sh kills these groups if pytest itself is killed before its teardown
        with open(self.pgid_file, "a") as handle:
            handle.write(f"{server.proc.pid} {spec.key}\n")
        self.servers[key] = server
        say(f"server {spec.key}: launched on port {server.port} (log {server.log_path.name})")

    def ready(self, key: str) -> lib.SmokeServer:
        if key in self.errors:
            pytest.fail(self.errors[key], pytrace=False)
        server = self.servers[key]
        if server.healthy_at is None:
            say(f"server {server.spec.key}: waiting for /health")
            try:
                server.wait_healthy(SERVER_START_TIMEOUT_S)
            except serving.ServerStartError as err:
                self.errors[key] = str(err)
            if key in self.errors:
                say(f"server {server.spec.key}: FAILED to start")
                pytest.fail(self.errors[key], pytrace=False)
            self.record["phases_s"][f"start_{server.spec.key}"] = server.start_seconds
            say(f"server {server.spec.key}: healthy after {server.start_seconds} s")
        return server

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.terminate()  # all at once: their shutdowns overlap
        for server in self.servers.values():
            server.stop()
            lib.trim_to_tail(server.log_path, SERVER_LOG_MAX_BYTES)
        self.pgid_file.unlink(missing_ok=True)


def _raise_keyboard_interrupt(signum, frame):
    # run_on_device.sh's `timeout` sends SIGTERM: turn it into an interrupt so fixtures tear down the servers
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def fleet():
    import torch  # already imported by tests/conftest.py; is_available() creates no CUDA context

    global _record
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tests/gpu/README.md)")
    _record = smoke_record = {"phases_s": lib.runner_phases(os.environ), "measurements": {}}
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    RESULTS.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(smoke_record)
    try:
        tiny = synthesise("tiny", WORK / "tiny", smoke_record)
        for key, spec in lib.tiny_server_specs(tiny).items():
            fleet.launch(key, spec)
    except Exception as err:  # one broken configuration must not cost the others their run
        fleet.errors["a"] = fleet.errors["b"] = f"tiny checkpoint unavailable:\n{err}"
    # A and B start up while the shape checkpoint is written
    try:
        shape = synthesise("shape", WORK / "shape", smoke_record, extra=("--layers", "4"))
        fleet.launch("c", lib.shape_server_spec(shape))
    except Exception as err:
        fleet.errors["c"] = f"shape checkpoint unavailable:\n{err}"
    try:
        yield fleet
    finally:
        say("stopping servers")
        fleet.stop_all()
        for key, server in fleet.servers.items():
            smoke_record["measurements"].setdefault("servers", {})[server.spec.key] = {
                "command": " ".join(server.argv[3:]),
                "extra_env": dict(server.spec.extra_env),
                "start_s": server.start_seconds,
                "w4a16_kernels": sorted(set(lib.WNA16_KERNEL_RE.findall(server.log_text()))),
                "attention_block_size": _last_int(lib.BLOCK_SIZE_RE.findall(server.log_text())),
                "error": fleet.errors.get(key),
            }


def _last_int(found: list[str]) -> int | None:
    return int(found[-1]) if found else None


@pytest.fixture(scope="session")
def server_a(fleet) -> lib.SmokeServer:
    """Tiny checkpoint, MTP speculation (4 tokens), prefix caching, qwen3_coder tool parser."""
    return fleet.ready("a")


@pytest.fixture(scope="session")
def server_b(fleet) -> lib.SmokeServer:
    """Server A's configuration without speculation."""
    return fleet.ready("b")


@pytest.fixture(scope="session")
def server_c(fleet) -> lib.SmokeServer:
    """Shape checkpoint (every real 27B matrix shape, 4 layers) with Marlin forced."""
    return fleet.ready("c")


@pytest.fixture(scope="session")
def smoke_record(fleet) -> dict:
    """Measurements for the result JSON (timings and numbers beyond pass/fail)."""
    return fleet.record


@pytest.fixture(scope="session")
def results_dir() -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS


@pytest.fixture(scope="session")
def work_dir() -> Path:
    WORK.mkdir(parents=True, exist_ok=True)
    return WORK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if item.path.resolve().parent == HERE:
        _outcomes[item.name] = lib.merge_outcome(_outcomes.get(item.name), report.when, report.outcome)


def _patch_series_state() -> dict:
    series = REPO / "patches" / "series"
    names = []
    if series.exists():
        names = [line.strip() for line in series.read_text().splitlines() if line.strip() and not line.startswith("#")]
    state: dict = {"series": names}
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        state["verify"] = "vllm not importable"
        return state
    vllm_dir = list(spec.submodule_search_locations)[0]
    state["vllm_dir"] = vllm_dir
    try:
        done = subprocess.run(
            [sys.executable, "-m", "qwen_serving.patchset", "verify", "--vllm-dir", vllm_dir],
            cwd=REPO,
            env=lib.child_env(os.environ),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        state["verify_rc"] = done.returncode
        state["verify_output"] = (done.stdout + done.stderr)[-4000:]
    except (OSError, subprocess.SubprocessError) as err:
        state["verify_rc"] = None
        state["verify_output"] = f"could not run patchset verify: {err}"
    return state


def pytest_sessionfinish(session, exitstatus):
    if _record is None:
        return  # no GPU session ran (CPU collection, or the tests were deselected)
    report = lib.build_report(
        outcomes=_outcomes,
        record=_record,
        exit_status=int(exitstatus),
        session_seconds=time.monotonic() - _session_t0,
        patches=_patch_series_state(),
        runner_t0=os.environ.get("QS_GPU_RUNNER_T0"),
    )
    serving.write_json_atomic(RESULTS / RESULT_JSON, report)
    say(f"wrote {RESULTS / RESULT_JSON}")
