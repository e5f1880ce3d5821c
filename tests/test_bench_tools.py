"""bench/conc_ladder.py, bench/api_smoke.py and bench/step_profile.py without a GPU:
token counting from a streamed answer, clear errors on bad arguments or no server, and step_profile's
read of the server's engine config from /server_info (with its noted fallback)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import conc_ladder  # noqa: E402


class _Sse(http.server.ThreadingHTTPServer):
    """Streams a completion whose chunks carry 1, 3, 0 (usage-only) and 2 new tokens."""

    def __init__(self):
        cumulative = [1, 4, 4, 6]

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for n in cumulative:
                    chunk = {"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": n}}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_stream_counts_every_token_of_a_bundled_chunk():
    server = _Sse()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out: dict = {}
        conc_ladder.stream_one(conc_ladder.Client(f"http://127.0.0.1:{server.server_port}", None), {}, out)
    finally:
        server.shutdown()
        server.server_close()
    assert "error" not in out
    assert len(out["times"]) == 6  # a speculative step's 3 tokens arrive in one chunk and count as 3
    assert out["times"] == sorted(out["times"]) and out["times"][0] >= out["start"]


def test_documents_are_seeded_and_distinct():
    a, b = conc_ladder.document(200, "s1"), conc_ladder.document(200, "s2")
    assert a == conc_ladder.document(200, "s1") and a != b
    assert 200 <= len(a.split()) < 220


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_api_smoke_without_server_fails_every_check():
    sys.path.insert(0, str(BENCH))
    import api_smoke

    res = run(sys.executable, str(BENCH / "api_smoke.py"), "--url", "http://127.0.0.1:9")
    assert res.returncode == len(api_smoke.CHECKS) == 12
    assert res.stdout.startswith("FAIL server: no usable server at http://127.0.0.1:9")


@pytest.mark.parametrize("args,message", [
    (["--n", "1,x"], "comma-separated positive integers"),
    (["--n", "0"], "comma-separated positive integers"),
    (["--max-tokens", "1"], "--max-tokens >= 2"),
])
def test_conc_ladder_bad_arguments(args, message):
    res = run(sys.executable, str(BENCH / "conc_ladder.py"), *args)
    assert res.returncode == 2 and message in res.stderr


def test_conc_ladder_without_server():
    res = run(sys.executable, str(BENCH / "conc_ladder.py"), "--url", "http://127.0.0.1:9", "--n", "1")
    assert res.returncode == 3 and "no usable server" in res.stderr


def test_step_profile_needs_the_trace_folder(tmp_path):
    res = run(sys.executable, str(BENCH / "step_profile.py"), "--trace-dir", str(tmp_path / "missing"),
              "--model-dir", str(tmp_path), "--out", str(tmp_path / "o.json"))
    assert res.returncode == 2 and "not a folder" in res.stderr


class _ServerInfo(http.server.ThreadingHTTPServer):
    """Answers GET /server_info?config_format=json with `status` and `body`, anything else with 404."""

    def __init__(self, status: int, body: dict):
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                seen.append((self.path, self.headers.get("Authorization")))
                ok = self.path == "/server_info?config_format=json"
                raw = json.dumps(body if ok else {"detail": "Not Found"}).encode()
                self.send_response(status if ok else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def _server_config(status: int, body: dict, key: str | None = None) -> tuple[dict | None, list]:
    import step_profile

    server = _ServerInfo(status, body)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = conc_ladder.Client(f"http://127.0.0.1:{server.server_port}/v1", key)
        return step_profile.server_vllm_config(client), server.seen
    finally:
        server.shutdown()
        server.server_close()


ENGINE = {"model_config": {"dtype": "torch.bfloat16"},
          "cache_config": {"cache_dtype": "fp8", "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "float16"}}


def test_step_profile_takes_the_cache_dtypes_from_server_info(capsys):
    config, seen = _server_config(200, {"vllm_config": ENGINE, "vllm_env": {}, "system_env": {}}, key="k")
    assert config == ENGINE
    assert seen == [("/server_info?config_format=json", "Bearer k")]
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("status,body", [
    (404, {"detail": "Not Found"}),  # VLLM_SERVER_DEV_MODE unset: no such route
    (200, {"vllm_config": "VllmConfig(...)"}),  # the text form is no engine config to read
])
def test_step_profile_without_server_info_notes_the_checkpoint_fallback(capsys, status, body):
    config, _ = _server_config(status, body)
    assert config is None
    out = capsys.readouterr().out
    assert out.startswith("note: no engine config from http://127.0.0.1:") and "VLLM_SERVER_DEV_MODE=1" in out
    assert "checkpoint config's dtypes" in out


def test_step_profile_without_any_server_notes_the_fallback(capsys):
    import step_profile

    assert step_profile.server_vllm_config(conc_ladder.Client("http://127.0.0.1:9", None)) is None
    assert "note: no engine config" in capsys.readouterr().out


def test_api_smoke_names_an_answer_without_text(monkeypatch):
    # H200, the batch plan on random weights: the tool parser returned content null for a plain chat answer,
    # and the stop and streaming checks failed with a TypeError instead of saying so
    sys.path.insert(0, str(BENCH))
    import api_smoke

    message = {"role": "assistant", "content": None, "tool_calls": []}
    monkeypatch.setattr(api_smoke.Api, "chat", lambda self, **body: {"choices": [{"message": message}]})
    api = object.__new__(api_smoke.Api)
    for check in (api_smoke.check_stop, api_smoke.check_streaming):
        with pytest.raises(AssertionError, match="no text in the answer"):
            if check is api_smoke.check_streaming:
                monkeypatch.setattr(api_smoke.Api, "stream", lambda self, path, body: [(None, "[DONE]")])
            check(api)


def test_api_smoke_anthropic_stream_names_the_events_it_got(monkeypatch):
    # H200, the batch plan on random weights: the stream had no content_block_delta and the check said nothing
    sys.path.insert(0, str(BENCH))
    import api_smoke

    api = object.__new__(api_smoke.Api)
    held_back = [("message_start", {}), ("content_block_start", {}), ("content_block_stop", {}),
                 ("message_delta", {}), ("message_stop", {})]
    monkeypatch.setattr(api_smoke.Api, "stream", lambda self, path, body: held_back)
    with pytest.raises(AssertionError, match="no content_block_delta among .*'content_block_start'"):
        api_smoke.check_anthropic_stream(api)
    whole = held_back[:2] + [("content_block_delta", {"delta": {"text": "x"}})] + held_back[2:]
    monkeypatch.setattr(api_smoke.Api, "stream", lambda self, path, body: whole)
    assert api_smoke.check_anthropic_stream(api) == "6 events, message_start .. message_stop"
