"""A loopback stand-in for vLLM's OpenAI and Anthropic routes that bench/soak.py's tests run as a child process
(its own PID, its own listening socket): it validates requests as vLLM 0.28.0 does for the kinds the soak sends
(400 with a message, 401 without the key), streams slowly enough to be cancelled, keeps /metrics honest (seats
in use while a request runs, KV blocks with them), and can be told to misbehave:

    python -m tests.helpers.soak_server --port P [--key K] [--no-tools] [--fail-tools] [--stream-error]
        [--leak-after N] [--die-after N] [--log PATH]

--no-tools answers requests with tools as vLLM 0.28.0 does without --tool-call-parser (400);
--fail-tools answers every request with tools 500; --stream-error ends every OpenAI stream with an error event
before [DONE], as vLLM does for an error after the first event; --leak-after N keeps one seat and its blocks after the Nth
request; --die-after N plays an engine death after N requests (/health 503, every request 500, the death in the log).
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.helpers.fake_http import send_json

MAX_MODEL_LEN = 512
BLOCKS = 64
BLOCKS_PER_REQUEST = 2


class State:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.lock = threading.Lock()
        self.requests = 0
        self.running = 0
        self.leaked = 0
        self.dead = False

    def log(self, line: str) -> None:
        if self.args.log:
            with open(self.args.log, "a") as handle:
                handle.write(line + "\n")


def _error(message: str, status: int = 400) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": "BadRequestError", "code": status}}


def validate(path: str, body: object) -> tuple[int, dict] | None:
    """The 400s vLLM 0.28.0 gives the soak's bad requests (pydantic types, SamplingParams ranges, the prompt and
    max_tokens against the context, tool_choice against tools, schemas a grammar cannot be built from, an empty
    conversation), as tests/test_api_bad_requests.py sees them on vLLM's own API server."""
    if not isinstance(body, dict):
        return _error("body is not an object")
    for name, kind in (("max_tokens", int), ("temperature", (int, float)), ("stream", bool), ("tools", list),
                       ("n", int)):
        if name in body and not isinstance(body[name], kind):
            return _error(f"{name}: wrong type")
    if path == "/v1/messages":
        if "max_tokens" not in body:
            return _error("max_tokens: Field required")
        if not isinstance(body.get("messages"), list) or any(m.get("role") not in ("user", "assistant")
                                                             for m in body["messages"]):
            return _error("messages: invalid")
        if isinstance(body.get("tool_choice"), dict) and body["tool_choice"].get("type") in ("any", "tool") and \
                not body.get("tools"):
            return _error("tool_choice: a tool call was asked for without tools")
    elif path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or any(not isinstance(m.get("content"), str) for m in messages):
            return _error("messages: invalid")
        problem = _tool_choice_problem(body) or _schema_problem(body)
        if problem:
            return _error(problem)
    if body.get("messages") == []:
        return _error("Cannot apply chat template to an empty conversation")
    if not 0 <= body.get("temperature", 1) <= 2 or not 0 < body.get("top_p", 1) <= 1:
        return _error("temperature or top_p out of range")
    if not -2 <= body.get("presence_penalty", 0) <= 2 or body.get("top_logprobs", 0) > 20:
        return _error("presence_penalty or top_logprobs out of range")
    if body.get("max_tokens", 1) < 1 or body.get("n", 1) < 1:
        return _error("max_tokens and n must be at least 1")
    if body.get("max_tokens", 0) > MAX_MODEL_LEN:
        return _error(f"max_tokens={body['max_tokens']} cannot be greater than max_model_len={MAX_MODEL_LEN}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) + body.get("max_tokens", 16) > MAX_MODEL_LEN:
        return _error(f"This model's maximum context length is {MAX_MODEL_LEN} tokens; your prompt contains "
                      f"{len(prompt)} input tokens")
    return None


def _tool_choice_problem(body: dict) -> str:
    choice, names = body.get("tool_choice"), [t["function"]["name"] for t in body.get("tools") or []]
    if choice is None or choice == "none":
        return ""
    if not names:
        return "When using `tool_choice`, `tools` must be set."
    if isinstance(choice, dict):
        return "" if choice.get("function", {}).get("name") in names else "tool_choice names no tool of `tools`"
    return "" if choice in ("auto", "required") else f"Invalid value for `tool_choice`: {choice}"


def _schema_problem(body: dict) -> str:
    schema = (body.get("response_format") or {}).get("json_schema", {}).get("schema")
    if not isinstance(schema, dict):
        return ""
    if schema.get("type") not in (None, "object", "string", "array", "number", "integer", "boolean", "null"):
        return f"Grammar error: Invalid type: {schema['type']}"
    target = schema
    for part in schema.get("$ref", "#").removeprefix("#").strip("/").split("/"):
        target = target.get(part) if part and isinstance(target, dict) else target
    if target is None:
        return f"Grammar error: Pointer {schema['$ref']} does not exist"
    try:
        re.compile(schema.get("pattern", ""))
    except re.error as err:
        return f"Grammar error: regex parse error: {err}"
    return ""


def answer(path: str, body: dict) -> tuple[dict, int]:
    """A non-streamed answer and its token count (validate has refused a max_tokens that does not fit)."""
    prompt_tokens = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 8
    tokens = body.get("max_tokens", 16)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens}
    if path == "/v1/messages":
        return {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "x " * tokens}],
                "usage": {"output_tokens": tokens}}, tokens
    if path == "/v1/completions":
        return {"choices": [{"text": "x " * tokens, "finish_reason": "length"}], "usage": usage}, tokens
    message = {"role": "assistant", "content": "x " * tokens}
    if isinstance(body.get("tool_choice"), dict):
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Aarhus"}'}}]}
    elif body.get("response_format"):
        message["content"] = '{"city": "Odense", "coastal": true}'
    return {"choices": [{"message": message, "finish_reason": "stop"}], "usage": usage}, tokens


class WideBacklog(ThreadingHTTPServer):
    request_queue_size = 256  # the soak's widest wave connects at once: the default backlog of 5 resets them
    daemon_threads = True


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _authorized(self) -> bool:
            key = state.args.key
            return not key or self.headers.get("Authorization") == f"Bearer {key}"

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self.send_response(503 if state.dead else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/metrics":
                with state.lock:
                    seats = state.running + state.leaked
                text = (f'vllm:num_requests_running{{engine="0"}} {seats}\n'
                        f'vllm:num_requests_waiting{{engine="0"}} 0\n'
                        f'vllm:kv_cache_usage_perc{{engine="0"}} {seats * BLOCKS_PER_REQUEST / BLOCKS}\n'
                        f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{BLOCKS}"}} 1.0\n').encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)
            elif not self._authorized():
                send_json(self, {"error": "Unauthorized"}, 401)
            elif self.path == "/v1/models":
                send_json(self, {"data": [{"id": "fake", "max_model_len": MAX_MODEL_LEN}]})
            else:
                send_json(self, {"detail": "Not Found"}, 404)

        def do_POST(self):  # noqa: N802
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if not self._authorized():
                return send_json(self, {"error": "Unauthorized"}, 401)
            with state.lock:
                state.requests += 1
                number = state.requests
                if state.args.die_after and number > state.args.die_after and not state.dead:
                    state.dead = True
                    state.log("ERROR EngineCore encountered a fatal error.\nvllm.v1.engine.exceptions.EngineDeadError")
                if state.args.leak_after and number == state.args.leak_after:
                    state.leaked += 1
            if state.dead:
                return send_json(self, {"error": {"message": "EngineDeadError: engine core died"}}, 500)
            try:
                body = json.loads(raw)
            except ValueError as err:
                status, error = _error(f"JSON decode error: {err}")
                return send_json(self, error, status)
            problem = validate(self.path, body)
            if problem:
                return send_json(self, problem[1], problem[0])
            if state.args.no_tools and body.get("tools"):
                status, error = _error('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser')
                return send_json(self, error, status)
            if state.args.fail_tools and body.get("tools"):
                return send_json(self, {"error": {"message": "Traceback: KeyError 'tools'"}}, 500)
            with state.lock:
                state.running += 1
            try:
                out, tokens = answer(self.path, body)
                if body.get("stream"):
                    self._stream(tokens, self.path == "/v1/messages")
                else:
                    time.sleep(0.005 * tokens)  # a cancel after 0.05-0.5 s lands while this runs
                    send_json(self, out)
            except (BrokenPipeError, ConnectionResetError):  # the client dropped the stream: nothing leaks
                pass
            finally:
                with state.lock:
                    state.running -= 1

        def _stream(self, tokens: int, anthropic: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            events = [("message_start", {"type": "message_start"})] if anthropic else []
            events += [("content_block_delta" if anthropic else None,
                        {"delta": {"text": "x"}} if anthropic else {"choices": [{"delta": {"content": "x"}}]})
                       for _ in range(tokens)]
            if state.args.stream_error and not anthropic:
                events.append((None, {"error": {"message": "Internal server error", "code": 500}}))
            events.append(("message_stop", {"type": "message_stop"}) if anthropic else (None, "[DONE]"))
            for name, data in events:
                text = (f"event: {name}\n" if name else "") + f"data: {data if data == '[DONE]' else json.dumps(data)}\n\n"
                self.wfile.write(text.encode())
                self.wfile.flush()
                time.sleep(0.002)
            self.close_connection = True

    return Handler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--key")
    p.add_argument("--no-tools", action="store_true")
    p.add_argument("--fail-tools", action="store_true")
    p.add_argument("--stream-error", action="store_true")
    p.add_argument("--leak-after", type=int, default=0)
    p.add_argument("--die-after", type=int, default=0)
    p.add_argument("--log")
    args = p.parse_args()
    state = State(args)
    state.log("INFO vLLM API server version 0.28.0 (fake)")
    WideBacklog(("127.0.0.1", args.port), make_handler(state)).serve_forever()


if __name__ == "__main__":
    main()
