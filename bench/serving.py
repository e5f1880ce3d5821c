"""What every script that talks to or starts a vLLM server shares (bench/, tests/gpu/, prepare/count_outputs.py):
the HTTP client (JSON, server-sent events, text), the API key, the atomic JSON write, a progress bar, Prometheus
/metrics parsing, and a server process in its own process group.

Standard library only, so it imports on the GPU machine's bare python3 as well as on CPU.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwen_serving import files, plan

REPO = Path(__file__).resolve().parents[1]
SSE_DONE = "[DONE]"  # the data of OpenAI's last streamed event

# Every URL here is a vLLM server measured directly: never through a proxy from the environment (it would add
# its own latency to every figure, and on the GPU machine a proxy for 127.0.0.1 leads nowhere).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---------------------------------------------------------------------------------------------
# API key


def api_key(explicit: str | None = None, repo: Path = REPO) -> str | None:
    """The key a server of this repo was started with: `explicit`, else the serve plan's own rule
    (plan.api_key: $VLLM_API_KEY, else the first line of api_key.txt); None when there is none."""
    return explicit or plan.api_key(os.environ, Path(repo))[0] or None


# ---------------------------------------------------------------------------------------------
# HTTP


class HttpError(OSError):
    """The server answered with an error status (an OSError, as urllib's own HTTPError is)."""

    def __init__(self, method: str, url: str, status: int, body: str):
        super().__init__(f"{method} {url} -> HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body

    def json(self) -> Any:
        """The error body as JSON ({} when it is not JSON)."""
        try:
            return json.loads(self.body)
        except ValueError:
            return {}


def _headers(key: str | None, json_body: bool) -> dict[str, str]:
    headers = {"Content-Type": "application/json"} if json_body else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"  # OpenAI routes
        headers["x-api-key"] = key  # Anthropic's /v1/messages
    return headers


def _open(url: str, body: Mapping | None, key: str | None, timeout_s: float):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=_headers(key, body is not None),
                                     method="GET" if body is None else "POST")
    try:
        return _OPENER.open(request, timeout=timeout_s)
    except urllib.error.HTTPError as err:
        raise HttpError(request.get_method(), url, err.code, err.read().decode(errors="replace")) from None


def get_text(url: str, *, key: str | None = None, timeout_s: float = 60) -> str:
    with _open(url, None, key, timeout_s) as response:
        return response.read().decode()


def get_json(url: str, *, key: str | None = None, timeout_s: float = 60) -> Any:
    return json.loads(get_text(url, key=key, timeout_s=timeout_s))


def post_json(url: str, body: Mapping, *, key: str | None = None, timeout_s: float = 600) -> Any:
    """The answer's JSON; None for an empty answer (vLLM's /start_profile and /stop_profile send none)."""
    with _open(url, body, key, timeout_s) as response:
        data = response.read()
    return json.loads(data) if data.strip() else None


def post_events(url: str, body: Mapping, *, key: str | None = None,
                timeout_s: float = 600) -> Iterator[tuple[str | None, Any]]:
    """POST a streaming request; yield (event name or None, data) for each server-sent event as it arrives.
    data is the event's JSON, or SSE_DONE for OpenAI's end marker."""
    with _open(url, body, key, timeout_s) as response:
        event = None
        for raw in response:
            line = raw.decode().rstrip("\r\n")
            if not line:
                event = None  # a blank line ends the event, and its name with it
            elif line.startswith("event:"):
                event = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data = line[len("data:"):].strip()
                yield event, data if data == SSE_DONE else json.loads(data)


def probe(url: str, body: Mapping | None = None, *, key: str | None = None,
          timeout_s: float = 60) -> tuple[int, str]:
    """(HTTP status, body text) of one request that never raises for the server's answer: status 0 with the
    reason when nothing answered (for checks that report a dead server as a line, not a traceback)."""
    try:
        with _open(url, body, key, timeout_s) as response:
            return response.status, response.read().decode(errors="replace")
    except HttpError as err:
        return err.status, err.body
    except OSError as err:  # refused, unreachable, timed out
        return 0, str(getattr(err, "reason", err))


def probe_raw(url: str, data: bytes, *, key: str | None = None, timeout_s: float = 60) -> tuple[int, str]:
    """probe() for a body that is not JSON-encoded here (bench/soak.py's malformed requests): the bytes go as
    they are, still labelled application/json, so the server's JSON parser is what answers."""
    request = urllib.request.Request(url, data=data, headers=_headers(key, True), method="POST")
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except OSError as err:
        return 0, str(getattr(err, "reason", err))


class Client:
    """One server: its base URL (a trailing /v1 is dropped, so both spellings work) and API key."""

    def __init__(self, base: str, key: str | None = None):
        self.base = base.rstrip("/").removesuffix("/v1")
        self.key = key

    def get_text(self, path: str, timeout_s: float = 60) -> str:
        return get_text(self.base + path, key=self.key, timeout_s=timeout_s)

    def get_json(self, path: str, timeout_s: float = 60) -> Any:
        return get_json(self.base + path, key=self.key, timeout_s=timeout_s)

    def post_json(self, path: str, body: Mapping, timeout_s: float = 600) -> Any:
        return post_json(self.base + path, body, key=self.key, timeout_s=timeout_s)

    def post_events(self, path: str, body: Mapping, timeout_s: float = 600) -> Iterator[tuple[str | None, Any]]:
        return post_events(self.base + path, body, key=self.key, timeout_s=timeout_s)

    def served_model(self) -> str:
        """The first model the server lists (its --served-model-name)."""
        return self.get_json("/v1/models")["data"][0]["id"]


# ---------------------------------------------------------------------------------------------
# Result files


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write through a temp file in the same folder, so a crash never leaves half a file. A value JSON has no
    type for (a Path, a dtype) is written as its str(): a measurement is never lost to its own record."""
    files.write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


# ---------------------------------------------------------------------------------------------
# Progress


class Progress:
    """A one-line progress bar on stderr (no dependency: the GPU machine's bare python3 runs this too)."""

    def __init__(self, label: str, total: int, done: int = 0, stream=None, width: int = 30):
        self.label, self.total, self.done, self.width = label, total, done, width
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self._draw()

    def step(self, extra: str = "") -> None:
        self.done += 1
        self._draw(extra)
        if self.done >= self.total:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, extra: str = "") -> None:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self.started
        self.stream.write(f"\r{self.label:<11} [{bar}] {self.done}/{self.total} {elapsed:5.0f} s {extra}")
        self.stream.flush()


class MetricsWatch:
    """While one long request runs: every `every_s` one /metrics read, appended to `path` as a JSON line (seconds
    since the start, the summed WATCHED values, or the error), flushed each time, so a run that is killed midway
    still says how far the server got. A context manager; the thread is a daemon."""

    WATCHED = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
               "kv_cache_usage": "vllm:kv_cache_usage_perc", "prompt_tokens": "vllm:prompt_tokens_total",
               "generation_tokens": "vllm:generation_tokens_total"}

    def __init__(self, client: Client, path: Path, label: str, every_s: float = 10.0):
        self.client, self.path, self.label, self.every_s = client, Path(path), label, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-watch-{label}", daemon=True)

    def __enter__(self) -> MetricsWatch:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def read(self) -> dict:
        line: dict[str, Any] = {"label": self.label, "t_s": round(time.monotonic() - self.started, 1)}
        try:
            samples = parse_prometheus(self.client.get_text("/metrics", timeout_s=min(5.0, self.every_s)))
        except (OSError, ValueError) as err:
            return {**line, "error": f"{type(err).__name__}: {err}"[:300]}
        for key, name in self.WATCHED.items():
            values = [x.value for x in samples if x.name == name]
            line[key] = sum(values) if values else None
        return line

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            with open(self.path, "a") as out:
                out.write(json.dumps(self.read()) + "\n")


# ---------------------------------------------------------------------------------------------
# Prometheus /metrics

_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition page (comments and blank lines skipped); a line that is not a
    sample is a ValueError, so a page that is not /metrics never reads as zeros."""
    samples = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            raise ValueError(f"/metrics line {lineno} is not a Prometheus sample: {line[:120]!r}")
        labels = {}
        body = match.group("labels") or ""
        pos = 0
        while pos < len(body):
            label = _LABEL.match(body, pos)
            if not label:
                raise ValueError(f"/metrics line {lineno}: bad label set {body[:120]!r}")
            labels[label.group(1)] = re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], label.group(2))
            pos = label.end()
        samples.append(Sample(match.group("name"), labels, float(match.group("value"))))
    return samples


def counter_total(page: str | Iterable[Sample], name: str) -> float:
    """Sum of counter `name` over all engines and label sets; prometheus_client exports a counter as
    `<name>_total` (and `<name>_created`, which is not counted). A KeyError when the page has no such counter,
    so a renamed metric fails loudly instead of reading 0."""
    samples = parse_prometheus(page) if isinstance(page, str) else page
    wanted = {name, name + "_total"}
    values = [s.value for s in samples if s.name in wanted]
    if not values:
        raise KeyError(f"no counter {name!r} on the /metrics page")
    return sum(values)


# ---------------------------------------------------------------------------------------------
# Server processes


def local_url(host: str, port: int) -> str:
    """Where a client on this machine reaches a server bound to host:port (a wildcard bind answers on loopback)."""
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def free_port() -> int:
    """A TCP port nothing listens on at this moment (take it as late as possible: other servers take ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


KV_TOKENS_LINE = r"GPU KV cache size: ([0-9,]+) tokens"  # vLLM 0.28.0's pool, as its log states it at boot
# what a vLLM 0.28.0 server's log says about its start: (key, the pattern whose group is the number)
BOOT_FACTS = (
    ("weights_gib", r"Model loading took ([0-9.]+) GiB"),
    ("torch_compile_s", r"torch\.compile took ([0-9.]+) s in total"),
    ("warmup_s", r"Initial profiling/warmup run took ([0-9.]+) s"),
    ("graph_capture_s", r"Graph capturing finished in ([0-9.]+) secs"),
    ("graph_capture_gib", r"Graph capturing finished in [0-9.]+ secs, took (-?[0-9.]+) GiB"),
    ("engine_init_s", r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s"),
    ("kv_cache_tokens", KV_TOKENS_LINE),
)


def boot_facts(log_text: str) -> dict[str, float | list[float]]:
    """Numbers a vLLM server's log gives about its start (the weights' and CUDA graphs' GPU memory, compile and
    warm-up seconds, the KV pool in tokens); a number the log gives more than once (the target's torch.compile
    and the drafter's) is a list, in log order."""
    facts: dict[str, float | list[float]] = {}
    for key, pattern in BOOT_FACTS:
        found = [float(m.replace(",", "")) for m in re.findall(pattern, log_text)]
        if found:
            facts[key] = found[0] if len(found) == 1 else found
    return facts


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    """A server child (`vllm serve ...`) on 127.0.0.1:`port` in its own session, so stopping its process group
    reaches vLLM's engine-core child too; stdout and stderr go to one log that starts with the command."""

    def __init__(self, name: str, argv: Sequence[str], port: int, log_path: Path,
                 env: Mapping[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self.env = None if env is None else dict(env)
        self.proc: subprocess.Popen | None = None
        self.launched_at = 0.0
        self.healthy_at: float | None = None

    def launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.argv) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)  # the child keeps its own handle on the log
        self.launched_at = time.monotonic()

    @property
    def start_seconds(self) -> float | None:
        return None if self.healthy_at is None else round(self.healthy_at - self.launched_at, 1)

    def exit_code(self) -> int | None:
        """The server's exit code once it has exited, else None."""
        assert self.proc is not None, "launch() first"
        return self.proc.poll()

    def healthy(self) -> bool:
        """One GET /health: True (and healthy_at set) once it answers 200."""
        if self.healthy_at is not None:
            return True
        try:
            with _OPENER.open(self.url + "/health", timeout=5) as response:
                if response.status == 200:
                    self.healthy_at = time.monotonic()
        except OSError:  # refused while it boots, a timeout, an error status
            pass
        return self.healthy_at is not None

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> None:
        """Block until /health answers 200; ServerStartError with the log tail if it exits or times out first."""
        deadline = self.launched_at + timeout_s
        while not self.healthy():
            code = self.exit_code()
            if code is not None:
                raise ServerStartError(f"{self.name} exited with code {code} before /health answered\n"
                                       f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"{self.name}: no healthy /health within {timeout_s:.0f} s\n{self.log_tail()}")
            time.sleep(poll_s)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        tail = self.log_text().splitlines()[-lines:]
        return f"--- last {len(tail)} lines of {self.log_path} ---\n" + "\n".join(tail)

    def terminate(self) -> None:
        """SIGTERM the server's process group without waiting (several servers' shutdowns can overlap)."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGTERM)

    def stop(self, grace_s: float = 15) -> None:
        """terminate(), then SIGKILL what is left of the group after `grace_s`."""
        if self.proc is None:
            return
        group = self.proc.pid
        self.terminate()
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.proc.poll()  # reap our own child, or the group never looks empty
            if not _group_alive(group):
                return
            time.sleep(0.2)
        _signal_group(group, signal.SIGKILL)
        self.proc.wait(timeout=10)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group(group: int, sig: signal.Signals) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass
