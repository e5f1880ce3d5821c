"""bench/conc_ladder.py, bench/api_smoke.py and bench/step_profile.py without a GPU:
token counting from a streamed answer, clear errors on bad arguments or no server, and step_profile's
read of the server's engine config from /server_info (with its noted fallback)."""

from __future__ import annotations

import base64
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

from bench import serving  # noqa: E402


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
        conc_ladder.stream_one(serving.Client(f"http://127.0.0.1:{server.server_port}", None), {}, out)
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
    assert res.returncode == len(api_smoke.CHECKS) == 14  # the OpenAI and Anthropic image requests (#23)
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
        client = serving.Client(f"http://127.0.0.1:{server.server_port}/v1", key)
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

    assert step_profile.server_vllm_config(serving.Client("http://127.0.0.1:9", None)) is None
    assert "note: no engine config" in capsys.readouterr().out


def _smoke():
    sys.path.insert(0, str(BENCH))
    import api_smoke

    return api_smoke, object.__new__(api_smoke.Api)


def _chat_by_body(answers):
    """A fake Api.chat: the first answer whose key is in the request body (None: any body); records bodies."""
    bodies = []

    def chat(self, **body):
        bodies.append(body)
        key = next(k for k in answers if k is None or k in body)
        content, finish = answers[key]
        return {"choices": [{"message": {"content": content}, "finish_reason": finish}]}
    return chat, bodies


def _recording_stream(sent, events):
    return lambda self, path, body: sent.append(body) or events


def test_api_smoke_asks_again_under_a_regex_when_the_answer_has_no_text(monkeypatch):
    # H200, the batch plan on random weights: the tool parser returned content null for a plain chat answer;
    # stock-fp16state: the greedy answer decoded to ''. Both used to end the check in a SKIP
    api_smoke, api = _smoke()
    for plain in (None, ""):
        chat, bodies = _chat_by_body({"structured_outputs": ("seabreezeharbour", "length"), None: (plain, "length")})
        monkeypatch.setattr(api_smoke.Api, "chat", chat)
        # the stop request, cut at "eha", answers with the text before it
        monkeypatch.setattr(api_smoke.Api, "chat", lambda self, _chat=chat, **body: (
            {"choices": [{"message": {"content": "seabreez"}, "finish_reason": "stop"}]} if "stop" in body
            else _chat(self, **body)))
        assert api_smoke.check_stop(api).endswith(api_smoke.CONSTRAINED)
        assert bodies[-1]["structured_outputs"] == api_smoke.VISIBLE_TEXT["structured_outputs"]
        monkeypatch.setattr(api_smoke.Api, "chat", chat)
        sent = []
        monkeypatch.setattr(api_smoke.Api, "stream", _recording_stream(sent, [
            (None, {"choices": [{"delta": {"content": "seabreeze"}}]}),
            (None, {"choices": [{"delta": {"content": "harbour"}}]}), (None, "[DONE]")]))
        assert api_smoke.check_streaming(api) == "2 chunks, text equals the unstreamed answer" + api_smoke.CONSTRAINED
        assert sent[-1]["structured_outputs"] == api_smoke.VISIBLE_TEXT["structured_outputs"]
    # a server that gives no text even under the regex fails, it does not skip
    chat, _ = _chat_by_body({None: ("", "length")})
    monkeypatch.setattr(api_smoke.Api, "chat", chat)
    for check in (api_smoke.check_stop, api_smoke.check_streaming):
        with pytest.raises(AssertionError, match="even under the regex"):
            check(api)
    # text in the plain answer: the plain request is the one checked (real weights)
    chat, bodies = _chat_by_body({None: ("The sea is calm.", "stop")})
    monkeypatch.setattr(api_smoke.Api, "chat", chat)
    monkeypatch.setattr(api_smoke.Api, "stream", lambda self, path, body: [
        (None, {"choices": [{"delta": {"content": "The sea is calm."}}]}), (None, "[DONE]")])
    assert api_smoke.check_streaming(api) == "1 chunks, text equals the unstreamed answer"
    assert all("structured_outputs" not in body for body in bodies)
    monkeypatch.setattr(api_smoke.Api, "stream", lambda self, path, body: [(None, "[DONE]")])
    with pytest.raises(AssertionError):  # streamed '' against the text: a real failure
        api_smoke.check_streaming(api)


def test_api_smoke_anthropic_stream_is_compared_with_the_unstreamed_answer(monkeypatch):
    # H200, the batch plan on random weights: the stream had no content_block_delta and the check said nothing
    api_smoke, api = _smoke()
    held_back = [("message_start", {}), ("content_block_start", {}), ("content_block_stop", {}),
                 ("message_delta", {}), ("message_stop", {})]

    def with_text(text):
        return held_back[:2] + [("content_block_delta", {"delta": {"type": "text_delta", "text": text}})] + held_back[2:]

    bodies = []

    def answer(plain, constrained):
        def post(self, path, body):
            bodies.append((path, body))
            return 200, {"content": [{"type": "text", "text": constrained if "output_config" in body else plain}]}
        return post

    monkeypatch.setattr(api_smoke.Api, "stream", lambda self, path, body: held_back)
    monkeypatch.setattr(api_smoke.Api, "post", answer("x", "x"))
    with pytest.raises(AssertionError, match="streamed '' .*'content_block_start'.*unstreamed 'x'"):
        api_smoke.check_anthropic_stream(api)
    assert bodies[0] == ("/v1/messages", {"max_tokens": 16, "messages": api_smoke.PROMPT, "temperature": 0})
    # H200, stock-fp16state (no tool parser): the greedy answer had no text: asked again as a string of an enum
    monkeypatch.setattr(api_smoke.Api, "post", answer("", '"Aarhus"'))
    monkeypatch.setattr(api_smoke.Api, "stream", lambda self, path, body: with_text('"Aarhus"'))
    assert api_smoke.check_anthropic_stream(api) == ("6 events, text equals the unstreamed answer"
                                                     + api_smoke.CONSTRAINED)
    assert bodies[-1][1]["output_config"] == api_smoke.VISIBLE_ANTHROPIC["output_config"]
    monkeypatch.setattr(api_smoke.Api, "post", answer("", ""))
    with pytest.raises(AssertionError, match="even under the output format"):
        api_smoke.check_anthropic_stream(api)
    monkeypatch.setattr(api_smoke.Api, "post", answer("x", "x"))
    monkeypatch.setattr(api_smoke.Api, "stream", lambda self, path, body: with_text("x"))
    assert api_smoke.check_anthropic_stream(api) == "6 events, text equals the unstreamed answer"


def test_api_smoke_structured_and_tool_checks_on_whitespace_and_without_a_parser(monkeypatch):
    """What the H200's servers answered on random weights: JSON that runs out of tokens in whitespace, HTTP 400
    for a forced tool call without a tool parser, HTTP 500 from the batch plan."""
    api_smoke, api = _smoke()
    compact = '{"city":"Aarhus","coastal":true}'
    chat, bodies = _chat_by_body({"structured_outputs": (compact, "stop"), None: ('{"city"' + " " * 80, "length")})
    monkeypatch.setattr(api_smoke.Api, "chat", chat)
    assert "asked again under a compact regex" in api_smoke.check_structured(api)
    assert bodies[-1]["structured_outputs"] == api_smoke.COMPACT_TOWN["structured_outputs"]
    assert "response_format" not in bodies[-1]  # with it vLLM would see two constraints
    chat, _ = _chat_by_body({None: ('{"city": "Aarhus", "coastal": tru', "length")})
    monkeypatch.setattr(api_smoke.Api, "chat", chat)
    with pytest.raises(AssertionError, match="before the object closed"):
        api_smoke.check_structured(api)

    no_parser = {"error": {"message": 'tool_choice=function "get_weather" requires --tool-call-parser to be set',
                           "type": "BadRequestError", "code": 400}}
    monkeypatch.setattr(api_smoke.Api, "post", lambda self, path, body: (400, no_parser))
    with pytest.raises(api_smoke.Inconclusive, match="without --tool-call-parser"):
        api_smoke.check_tool_call(api)
    monkeypatch.setattr(api_smoke.Api, "post", lambda self, path, body: (500, {"error": {"message": ""}}))
    with pytest.raises(AssertionError, match="HTTP 500"):
        api_smoke.check_tool_call(api)

    def tool_answer(arguments, finish):
        call = {"function": {"name": "get_weather", "arguments": arguments}}
        return lambda self, path, body: (200, {"choices": [{"message": {"tool_calls": [call]}, "finish_reason": finish}]})

    monkeypatch.setattr(api_smoke.Api, "post", tool_answer('{"city"' + " " * 120, "length"))
    with pytest.raises(AssertionError, match="disable_any_whitespace"):
        api_smoke.check_tool_call(api)
    monkeypatch.setattr(api_smoke.Api, "post", tool_answer('{"city": "Aarhus"}', "stop"))
    assert api_smoke.check_tool_call(api) == "forced call get_weather({'city': 'Aarhus'})"


def test_api_smoke_counts_only_failures_in_its_exit_code(monkeypatch, tmp_path, capsys):
    sys.path.insert(0, str(BENCH))
    import api_smoke

    class FakeApi:
        base, model = "http://h:1", "m"

        def __init__(self, *args):
            pass

    def skip(api):
        raise api_smoke.Inconclusive("nothing to test")

    def fail(api):
        raise AssertionError("wrong")

    monkeypatch.setattr(api_smoke, "Api", FakeApi)
    monkeypatch.setattr(api_smoke, "CHECKS", [("a", lambda api: "fine"), ("b", skip), ("c", fail), ("d", skip)])
    assert api_smoke.main(["--json", str(tmp_path / "api.json")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ["PASS a: fine", "SKIP b: nothing to test", "FAIL c: AssertionError: wrong", "SKIP d: nothing to test",
                   "1/4 passed, 2 inconclusive (SKIP), 1 failed"]
    checks = json.loads((tmp_path / "api.json").read_text())["checks"]
    assert {k: (v["status"], v["passed"]) for k, v in checks.items()} == {
        "a": ("pass", True), "b": ("skip", None), "c": ("fail", False), "d": ("skip", None)}


def test_api_smoke_sends_an_anthropic_image_block_and_counts_its_tokens():
    api_smoke, api = _smoke()
    sent = []

    def post(path, body, with_tower=True):
        sent.append((path, body))
        blocks = body["messages"][0]["content"]
        if not with_tower and blocks[0]["type"] == "image":
            return 400, {"error": {"message": "At most 0 image(s) may be provided in one prompt."}}
        return 200, {"usage": {"input_tokens": 20 + 66 * (blocks[0]["type"] == "image"), "output_tokens": 8}}

    api.post = post
    assert api_smoke.check_anthropic_image(api).startswith("a 64x64 PNG image block became 66 input tokens")
    image = sent[0][1]["messages"][0]["content"][0]
    assert sent[0][0] == "/v1/messages" and image["source"]["media_type"] == "image/png"
    assert base64.b64decode(image["source"]["data"]).startswith(b"\x89PNG")
    api.post = lambda path, body: post(path, body, with_tower=False)
    with pytest.raises(api_smoke.Inconclusive):
        api_smoke.check_anthropic_image(api)
    api.post = lambda path, body: (200, {"usage": {"input_tokens": 20, "output_tokens": 8}})  # the image was dropped
    with pytest.raises(AssertionError, match="not expanded"):
        api_smoke.check_anthropic_image(api)
