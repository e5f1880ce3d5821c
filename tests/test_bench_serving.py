"""bench/serving.py: the HTTP client against a real loopback server, the API-key lookup, the atomic JSON write,
Prometheus parsing on the recorded /metrics pages, and a real server subprocess started, probed and stopped."""

from __future__ import annotations

import http.server
import json
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from bench import serving

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "bench" / "fixtures"


class _Fake(http.server.ThreadingHTTPServer):
    """JSON, server-sent events (OpenAI's and Anthropic's shape), text, and error statuses; records what came."""

    def __init__(self):
        self.seen: list[dict] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, code: int, body: bytes, kind: str = "application/json"):
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                fake.seen.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                  "x-api-key": self.headers.get("x-api-key")})
                if self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": "qwen3.8-27b"}, {"id": "other"}]}).encode())
                elif self.path == "/metrics":
                    self._send(200, (FIXTURES / "metrics_before.txt").read_bytes(), "text/plain")
                else:
                    self._send(404, b'{"detail":"Not Found"}')

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.seen.append({"path": self.path, "body": body, "type": self.headers.get("Content-Type")})
                if body.get("bad"):
                    self._send(400, b'{"error": {"message": "presence_penalty out of range"}}')
                elif self.path == "/start_profile":
                    self._send(200, b"")
                elif not body.get("stream"):
                    self._send(200, json.dumps({"echo": body}).encode())
                else:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    if self.path == "/v1/messages":  # named events, each closed by a blank line
                        for name in ("message_start", "content_block_delta", "message_stop"):
                            self.wfile.write(f"event: {name}\ndata: {json.dumps({'type': name})}\n\n".encode())
                        self.wfile.write(b"data: {\"after\": \"a blank line\"}\n\n")
                    else:
                        for i in range(3):
                            self.wfile.write(f"data: {json.dumps({'i': i})}\r\n\r\n".encode())
                            self.wfile.flush()
                        self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def fake():
    server = _Fake()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_client_posts_json_streams_events_and_reads_text(fake, monkeypatch):
    # a proxy in the environment is not used: the loopback server answers directly
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    for bypass in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(bypass, raising=False)
    client = serving.Client(f"http://127.0.0.1:{fake.server_port}/v1/", "k")  # /v1 and the slash are dropped
    assert client.base == f"http://127.0.0.1:{fake.server_port}"
    assert client.served_model() == "qwen3.8-27b"
    assert fake.seen[-1] == {"path": "/v1/models", "auth": "Bearer k", "x-api-key": "k"}
    assert client.post_json("/v1/completions", {"prompt": "x"}) == {"echo": {"prompt": "x"}}
    assert fake.seen[-1]["type"] == "application/json"
    assert client.post_json("/start_profile", {}) is None  # vLLM answers it with an empty body
    events = list(client.post_events("/v1/completions", {"stream": True}))
    assert events == [(None, {"i": 0}), (None, {"i": 1}), (None, {"i": 2}), (None, serving.SSE_DONE)]
    named = list(client.post_events("/v1/messages", {"stream": True}))
    assert named == [("message_start", {"type": "message_start"}),
                     ("content_block_delta", {"type": "content_block_delta"}),
                     ("message_stop", {"type": "message_stop"}), (None, {"after": "a blank line"})]
    page = serving.get_text(client.base + "/metrics")
    assert page == (FIXTURES / "metrics_before.txt").read_text()


def test_error_status_is_an_http_error_with_the_body(fake):
    client = serving.Client(f"http://127.0.0.1:{fake.server_port}")
    with pytest.raises(serving.HttpError, match=r"POST http://127.0.0.1:\d+/v1/chat -> HTTP 400") as err:
        client.post_json("/v1/chat", {"bad": True})
    assert err.value.status == 400 and err.value.json() == {"error": {"message": "presence_penalty out of range"}}
    assert isinstance(err.value, OSError)  # callers that treat a failed request as I/O keep working
    with pytest.raises(serving.HttpError) as err:
        list(client.post_events("/v1/completions", {"stream": True, "bad": True}))
    assert err.value.status == 400
    with pytest.raises(serving.HttpError, match="HTTP 404") as err:
        client.get_json("/server_info")
    assert err.value.json() == {"detail": "Not Found"}
    with pytest.raises(OSError):  # nothing listens: the connection error itself
        serving.get_text("http://127.0.0.1:9/health", timeout_s=5)


def test_api_key_explicit_then_environment_then_the_key_file(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "an OpenAI key is never sent to our server")
    assert serving.api_key(None, repo=tmp_path) is None
    (tmp_path / "api_key.txt").write_text("  \n")
    assert serving.api_key(None, repo=tmp_path) is None
    (tmp_path / "api_key.txt").write_text(" file-key \nsecond line\n")
    assert serving.api_key(None, repo=tmp_path) == "file-key"
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert serving.api_key(None, repo=tmp_path) == "env-key"
    assert serving.api_key("given", repo=tmp_path) == "given"


def test_atomic_write_replaces_whole_files_and_leaves_nothing_on_error(tmp_path):
    path = tmp_path / "new" / "report.json"
    serving.write_json_atomic(path, {"path": Path("/x"), "n": 1})  # a Path is written as its text
    assert json.loads(path.read_text()) == {"path": "/x", "n": 1}
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match="Circular reference"):
        serving.write_json_atomic(path, {"figures": [1, 2], "broken": loop})
    assert json.loads(path.read_text()) == {"path": "/x", "n": 1}  # the old file, whole
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]  # and no temp file beside it


def test_prometheus_samples_of_the_recorded_pages():
    """bench/fixtures/metrics_*.txt: pages rendered by vLLM's own Prometheus objects (make_fixtures.py)."""
    before = serving.parse_prometheus((FIXTURES / "metrics_before.txt").read_text())
    after = (FIXTURES / "metrics_after.txt").read_text()
    drafts = [s for s in before if s.name == "vllm:spec_decode_num_drafts_total"]
    assert drafts and all(s.labels["model_name"] and "engine" in s.labels for s in drafts)
    per_pos = {s.labels["position"] for s in before if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0", "1", "2", "3"}  # MTP, k = 4
    grown = serving.counter_total(after, "vllm:generation_tokens") - serving.counter_total(
        before, "vllm:generation_tokens")
    assert grown > 0
    assert serving.counter_total(before, "vllm:spec_decode_num_drafts") == sum(s.value for s in drafts)
    with pytest.raises(KeyError, match="vllm:no_such_counter"):
        serving.counter_total(after, "vllm:no_such_counter")


def test_counter_total_sums_engines_and_label_sets_and_skips_created():
    page = textwrap.dedent("""\
        # HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
        # TYPE vllm:prefix_cache_hits_total counter
        vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 800.0
        vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 4.0
        vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9
        vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 1.28e3
        """)
    assert serving.counter_total(page, "vllm:prefix_cache_hits") == 804.0
    assert serving.counter_total(page, "vllm:spec_decode_num_draft_tokens") == 1280.0
    (sample,) = serving.parse_prometheus('vllm:x_total{a="say \\"hi\\", ok",b="c\\\\d"} 3 1700000000\n')
    assert sample.labels == {"a": 'say "hi", ok', "b": "c\\d"} and sample.value == 3.0
    with pytest.raises(ValueError, match="line 2 is not a Prometheus sample"):
        serving.parse_prometheus("# HELP x\nnot a sample line at all {\n")


# A server that boots for a moment, answers /health, and starts a child of its own (as vLLM's API server starts
# its engine core), which must go when the server is stopped.
SERVER = textwrap.dedent("""
    import http.server, subprocess, sys, time
    port, mode, child_pid_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    print("booting", mode, flush=True)
    if mode == "dies":
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(child_pid_file, "w").write(str(child.pid))
    time.sleep(0.3)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" and mode == "ok" else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


def _server(tmp_path: Path, mode: str) -> serving.ServerProcess:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = serving.free_port()
    argv = [sys.executable, str(script), str(port), mode, str(tmp_path / "child.pid")]
    return serving.ServerProcess(f"fake-{mode}", argv, port, tmp_path / "logs" / "server.log",
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that does not reap is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_server_process_starts_healthy_and_stops_with_its_children(tmp_path):
    server = _server(tmp_path, "ok")
    assert server.url == f"http://127.0.0.1:{server.port}"
    server.launch()
    try:
        server.wait_healthy(timeout_s=30, poll_s=0.1)
        assert server.healthy() and server.start_seconds is not None and server.start_seconds >= 0
        assert os.getpgid(server.proc.pid) == server.proc.pid != os.getpgid(0)  # its own process group
        child = int((tmp_path / "child.pid").read_text())
        assert _alive(child)
    finally:
        server.stop(grace_s=10)
    assert server.proc.poll() == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
    log = server.log_text()
    assert log.startswith(f"$ {sys.executable} ") and "booting ok" in log


def test_server_that_exits_fails_with_its_log_tail(tmp_path):
    server = _server(tmp_path, "dies")
    server.launch()
    with pytest.raises(serving.ServerStartError, match="fake-dies exited with code 3") as err:
        server.wait_healthy(timeout_s=30, poll_s=0.1)
    assert "booting dies" in str(err.value) and "last 2 lines" in str(err.value)
    server.stop(grace_s=1)  # nothing left to stop: no error


def test_server_that_never_gets_healthy_times_out_and_is_killed(tmp_path):
    server = _server(tmp_path, "unhealthy")  # answers /health with 503
    server.launch()
    try:
        with pytest.raises(serving.ServerStartError, match="no healthy /health within 1 s"):
            server.wait_healthy(timeout_s=1, poll_s=0.1)
        assert server.exit_code() is None and not server.healthy()
    finally:
        server.stop(grace_s=10)
    assert server.exit_code() is not None


def test_boot_facts_read_a_vllm_servers_start():
    log = "\n".join([
        "(EngineCore pid=1) INFO 12-02 04:17:47 [gpu_model_runner.py:5515] Model loading took 14.99 GiB memory and 11.5 seconds",
        "(EngineCore pid=1) INFO 12-02 04:19:01 [monitor.py:53] torch.compile took 73.82 s in total",
        "(EngineCore pid=1) INFO 12-02 04:20:35 [monitor.py:81] Initial profiling/warmup run took 94.38 s",
        "(EngineCore pid=1) INFO 12-02 04:20:42 [monitor.py:53] torch.compile took 6.18 s in total",
        "(EngineCore pid=1) INFO 12-02 04:20:50 [kv_cache_utils.py:1] GPU KV cache size: 38,765 tokens",
        "(EngineCore pid=1) INFO 12-02 04:21:03 [gpu_model_runner.py:7048] Graph capturing finished in 12 secs, took 6.77 GiB",
        "(EngineCore pid=1) INFO 12-02 04:21:04 [core.py:347] init engine (profile, create kv cache, warmup model) took "
        "197.22 s (compilation: 80.01 s)",
    ])
    assert serving.boot_facts(log) == {"weights_gib": 14.99, "torch_compile_s": [73.82, 6.18], "warmup_s": 94.38,
                                       "graph_capture_s": 12.0, "graph_capture_gib": 6.77, "engine_init_s": 197.22,
                                       "kv_cache_tokens": 38765.0}
    assert serving.boot_facts("the server died before loading anything") == {}
