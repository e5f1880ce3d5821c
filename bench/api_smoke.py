"""API smoke test of a running server: the OpenAI routes and Anthropic /v1/messages, one PASS/FAIL/SKIP
line per feature, exit code = number of failures.

    python bench/api_smoke.py [--url http://127.0.0.1:18020] [--api-key K] [--json OUT.json]

Checks are built to hold on any weights (random, the scripted checkpoint's token chain, real): stop strings
are taken from the model's own greedy output, streaming (OpenAI and Anthropic) is compared with the same
greedy request unstreamed, tool calls are forced by name (structured output writes their arguments). Where
the plain greedy answer has no text (a random model can repeat a token that decodes to nothing, a tool parser
can hold back every delta) or a json_schema answer runs out of tokens inside a whitespace run the grammar
allows, the check asks again under a structured-output constraint that only visible text satisfies
(`VISIBLE_TEXT`, `COMPACT_TOWN`, `VISIBLE_ANTHROPIC`) and says so in its detail; real weights answer the
plain request, so there the checks are the plain ones. SKIP is left for a server without a tool parser, and for
the image requests (OpenAI image_url, Anthropic image block) on a server without the vision tower (VISION=0 serves
--language-model-only).
"""

from __future__ import annotations

import argparse
import base64
import json
import struct
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import serving  # noqa: E402

PROMPT = [{"role": "user", "content": "Write three sentences about the sea."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
# Constraints for the second ask: letters only (no whitespace to wander in, nothing a tool parser holds back),
# the town object with one fixed layout, an Anthropic answer that is one JSON string of an enum.
VISIBLE_TEXT = {"structured_outputs": {"regex": "[a-z]{12,24}"}}
COMPACT_TOWN = {"structured_outputs": {"regex": r'\{"city":"(Aarhus|Odense|Aalborg)","coastal":(true|false)\}'}}
VISIBLE_ANTHROPIC = {"output_config": {"format": {"type": "json_schema", "schema": {
    "type": "string", "enum": ["Copenhagen", "Aarhus", "Odense"]}}}}
CONSTRAINED = " (asked again under a structured-output constraint: the plain greedy answer had no text)"


class Inconclusive(Exception):
    """The server's answer gives the check nothing to test (reported as SKIP, not counted as a failure)."""


class Api:
    def __init__(self, base: str, key: str | None, model: str | None):
        self.client = serving.Client(base, key)
        self.base = self.client.base
        self.model = model or self.client.served_model()

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        """(HTTP status, the answer's JSON): a check can expect an error status."""
        try:
            return 200, self.client.post_json(path, {"model": self.model, **body}, timeout_s=300)
        except serving.HttpError as e:
            return e.status, e.json()

    def stream(self, path: str, body: dict) -> list[tuple[str | None, dict | str]]:
        """(event name, data) of each server-sent event; data is parsed JSON, or serving.SSE_DONE."""
        return list(self.client.post_events(path, {"model": self.model, **body, "stream": True}, timeout_s=300))

    def chat(self, **body) -> dict:
        status, out = self.post("/v1/chat/completions", {"messages": PROMPT, **NO_THINK, **body})
        if status != 200:
            raise AssertionError(f"HTTP {status}: {json.dumps(out)[:300]}")
        return out

    def text(self, **body) -> str:
        """The answer's text; a clear failure when the server returned none (on random weights a tool parser
        can take the whole answer for a malformed call and return content null)."""
        message = self.chat(**body)["choices"][0]["message"]
        if message.get("content") is None:
            raise AssertionError(f"no text in the answer: {json.dumps(message)[:300]}")
        return message["content"]

    def visible_text(self, min_chars: int, **body) -> tuple[str, dict, str]:
        """(text, the body that gave it, a note): the plain greedy answer when it has `min_chars` characters, else
        the same request under VISIBLE_TEXT, which any weights answer with letters."""
        try:
            text = self.text(**body)
            if len(text) >= min_chars:
                return text, body, ""
        except AssertionError:  # content null: a tool parser took the answer
            pass
        body = {**body, **VISIBLE_TEXT}
        text = self.text(**body)
        assert len(text) >= min_chars, f"even under the regex {VISIBLE_TEXT} the answer is {text!r}"
        return text, body, CONSTRAINED


def check_chat(api: Api) -> str:
    out = api.chat(max_tokens=16)
    choice = out["choices"][0]
    assert choice["finish_reason"] in ("stop", "length"), choice["finish_reason"]
    assert out["usage"]["completion_tokens"] > 0
    return f"{out['usage']['completion_tokens']} tokens, finish {choice['finish_reason']}"


def check_logprobs(api: Api) -> str:
    out = api.chat(max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"], (len(content), out["usage"])
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 3 for e in content)
    # greedy: the chosen token is the most likely one
    assert all(e["logprob"] >= max(t["logprob"] for t in e["top_logprobs"]) - 1e-3 for e in content)
    return f"{len(content)} tokens x top-3, greedy token is the top-1"


def check_prompt_logprobs(api: Api) -> str:
    status, out = api.post("/v1/completions", {"prompt": "The capital of Denmark is", "max_tokens": 1,
                                               "prompt_logprobs": 2})
    assert status == 200, out
    plp = out["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == out["usage"]["prompt_tokens"], (plp[:2], out["usage"])
    assert all(1 <= len(entry) <= 3 for entry in plp[1:])  # top-2 plus the actual token when it is not in them
    return f"{len(plp)} prompt positions"


def check_n(api: Api) -> str:
    out = api.chat(max_tokens=8, n=3, temperature=1.0)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2]
    return "3 choices"


def check_stop(api: Api) -> str:
    free, body, note = api.visible_text(6, max_tokens=24, temperature=0)
    cut = len(free) // 2
    stop = free[cut:cut + 3]
    out = api.chat(**body, stop=[stop])["choices"][0]
    expected = free[:free.index(stop)]
    assert out["finish_reason"] == "stop" and out["message"]["content"] == expected, (out, expected)
    return f"stopped at {stop!r} from the model's own greedy text{note}"


def check_seed(api: Api) -> str:
    texts = [api.chat(max_tokens=16, temperature=1.0, seed=1234)["choices"][0]["message"]["content"]
             for _ in range(2)]
    assert texts[0] == texts[1], texts
    return "same seed, same sampled text"


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Aarhus", "Odense", "Aalborg"]},
                                           "coastal": {"type": "boolean"}},
          "required": ["city", "coastal"], "additionalProperties": False}


def _in_whitespace_run(choice: dict, text: str) -> bool:
    return choice["finish_reason"] == "length" and len(text) >= 8 and text[-8:].isspace()


def check_structured(api: Api) -> str:
    out = api.chat(max_tokens=128, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "town", "schema": SCHEMA}})
    choice = out["choices"][0]
    text = choice["message"]["content"]
    note = ""
    if _in_whitespace_run(choice, text):  # xgrammar lets JSON carry any whitespace: ask for one layout
        note = f" (asked again under a compact regex: the json_schema answer ran into whitespace: {text[:24]!r}...)"
        choice = api.chat(max_tokens=128, temperature=0, **COMPACT_TOWN)["choices"][0]
        text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", f"finish {choice['finish_reason']} before the object closed: {text!r}"
    value = json.loads(text)
    assert set(value) == {"city", "coastal"} and value["city"] in SCHEMA["properties"]["city"]["enum"]
    assert isinstance(value["coastal"], bool)
    return f"valid against the schema: {text.strip()}{note}"


def check_penalties(api: Api) -> str:
    api.chat(max_tokens=8, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3)
    status, _ = api.post("/v1/chat/completions", {"messages": PROMPT, "max_tokens": 4, "presence_penalty": 5.0})
    assert status == 400, f"presence_penalty 5.0 (outside [-2, 2]) gave HTTP {status}"
    return "accepted in range, HTTP 400 outside it"


def check_streaming(api: Api) -> str:
    whole, body, note = api.visible_text(1, max_tokens=16, temperature=0)
    events = api.stream("/v1/chat/completions", {"messages": PROMPT, **NO_THINK, **body})
    assert events and events[-1][1] == serving.SSE_DONE
    text = "".join(d["choices"][0]["delta"].get("content") or "" for _, d in events[:-1] if d.get("choices"))
    assert text == whole, (text, whole)
    return f"{len(events) - 1} chunks, text equals the unstreamed answer{note}"


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Copenhagen", "Aarhus"]}},
                   "required": ["city"], "additionalProperties": False}}}


def check_tool_call(api: Api) -> str:
    body = {"messages": PROMPT, **NO_THINK, "max_tokens": 128, "temperature": 0, "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    status, out = api.post("/v1/chat/completions", body)
    if status == 400 and "tool-call-parser" in json.dumps(out):
        raise Inconclusive("the server runs without --tool-call-parser")
    assert status == 200, f"HTTP {status}: {json.dumps(out)[:300]}"
    calls = out["choices"][0]["message"].get("tool_calls") or []
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather", calls
    arguments = calls[0]["function"]["arguments"]
    # a named tool choice replaces any structured_outputs of the request with the tool's schema, so no compact
    # layout can be asked for here: only the server's --structured-outputs-config can forbid the whitespace
    assert not _in_whitespace_run(out["choices"][0], arguments), (
        f"the forced call's arguments ran out of tokens inside a whitespace run the JSON grammar allows: "
        f"{arguments[:40]!r}... (a server started with --structured-outputs-config "
        "'{\"disable_any_whitespace\": true}' writes them compact)")
    args = json.loads(arguments)
    assert args.get("city") in ("Copenhagen", "Aarhus"), args
    return f"forced call get_weather({args})"


def check_anthropic(api: Api) -> str:
    status, out = api.post("/v1/messages", {"max_tokens": 16, "messages": PROMPT})
    assert status == 200, out
    assert out["type"] == "message" and out["role"] == "assistant", out
    assert out["content"][0]["type"] == "text" and out["usage"]["output_tokens"] > 0
    return f"{out['usage']['output_tokens']} tokens, stop_reason {out.get('stop_reason')}"


def _anthropic_text(api: Api, body: dict) -> str:
    status, out = api.post("/v1/messages", body)
    assert status == 200, out
    return "".join(block.get("text", "") for block in out["content"] if block["type"] == "text")


def check_anthropic_stream(api: Api) -> str:
    body = {"max_tokens": 16, "messages": PROMPT, "temperature": 0}
    whole, note = _anthropic_text(api, body), ""
    if not whole:  # the Messages API has no regex: its json_schema output format, a string of an enum
        body, note = {**body, **VISIBLE_ANTHROPIC}, CONSTRAINED
        whole = _anthropic_text(api, body)
        assert whole, f"even under the output format {VISIBLE_ANTHROPIC} the answer has no text"
    events = api.stream("/v1/messages", body)
    kinds = [e for e, _ in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    text = "".join(d["delta"].get("text", "") for e, d in events if e == "content_block_delta")
    # on random weights a tool parser can hold back every delta as a possible call: name what did arrive
    assert text == whole, f"streamed {text!r} (events {kinds}), unstreamed {whole!r}"
    return f"{len(events)} events, text equals the unstreamed answer{note}"


def png_data_url(width: int = 64, height: int = 64) -> str:
    """A data URL of an RGB gradient PNG, written with the standard library (no image package on the client)."""
    rows = b"".join(b"\x00" + bytes(v for x in range(width) for v in (x * 255 // width, y * 255 // height, 128))
                    for y in range(height))  # filter byte 0 (none) before every row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


NO_TOWER = "At most 0 image(s)"  # vLLM 0.28.0's refusal when the image limit is 0 (--language-model-only)


def check_image(api: Api) -> str:
    question = {"type": "text", "text": "What colours does this image have?"}
    image = {"type": "image_url", "image_url": {"url": png_data_url()}}
    body = {**NO_THINK, "max_tokens": 8, "temperature": 0}
    status, out = api.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [image, question]}],
                                                    **body})
    if status == 400 and NO_TOWER in json.dumps(out):
        raise Inconclusive("the server runs without the vision tower (VISION=0: --language-model-only)")
    assert status == 200, f"HTTP {status}: {json.dumps(out)[:300]}"
    text_only = api.chat(messages=[{"role": "user", "content": [question]}], **body)
    image_tokens = out["usage"]["prompt_tokens"] - text_only["usage"]["prompt_tokens"]
    assert image_tokens > 2, f"the image added {image_tokens} prompt tokens: it was not expanded into image tokens"
    assert out["usage"]["completion_tokens"] > 0, out["usage"]
    return f"a 64x64 PNG data URL became {image_tokens} prompt tokens (markers included); answered"


def check_anthropic_image(api: Api) -> str:
    """/v1/messages with a base64 image block (vLLM 0.28.0 turns it into an image_url part)."""
    data = png_data_url().partition(",")[2]
    question = {"type": "text", "text": "What colours does this image have?"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    status, out = api.post("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [image, question]}]})
    if status == 400 and NO_TOWER in json.dumps(out):
        raise Inconclusive("the server runs without the vision tower (VISION=0: --language-model-only)")
    assert status == 200, f"HTTP {status}: {json.dumps(out)[:300]}"
    status, text_only = api.post("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [question]}]})
    assert status == 200, text_only
    image_tokens = out["usage"]["input_tokens"] - text_only["usage"]["input_tokens"]
    assert image_tokens > 2, f"the image block added {image_tokens} input tokens: it was not expanded into image tokens"
    assert out["usage"]["output_tokens"] > 0, out["usage"]
    return f"a 64x64 PNG image block became {image_tokens} input tokens (markers included); answered"


CHECKS: list[tuple[str, Callable[[Api], str]]] = [
    ("chat", check_chat), ("logprobs", check_logprobs), ("prompt_logprobs", check_prompt_logprobs),
    ("n", check_n), ("stop", check_stop), ("seed", check_seed), ("structured_output", check_structured),
    ("penalties", check_penalties), ("streaming", check_streaming), ("tool_call", check_tool_call),
    ("anthropic_messages", check_anthropic), ("anthropic_streaming", check_anthropic_stream),
    ("image", check_image), ("anthropic_image", check_anthropic_image),
]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:18020")
    p.add_argument("--api-key", help="default: $VLLM_API_KEY, else the first line of api_key.txt")
    p.add_argument("--model", help="default: the server's first model")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    try:
        api = Api(args.url, serving.api_key(args.api_key), args.model)
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"FAIL server: no usable server at {args.url}: {e}")
        return len(CHECKS)
    results = {}
    for name, check in CHECKS:
        t0 = time.time()
        try:
            detail, status = check(api), "pass"
        except Inconclusive as e:
            detail, status = str(e)[:400], "skip"
        except (AssertionError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
            detail, status = f"{type(e).__name__}: {e}"[:400], "fail"
        results[name] = {"status": status, "passed": {"pass": True, "fail": False}.get(status), "detail": detail,
                         "seconds": round(time.time() - t0, 2)}
        print(f"{status.upper()} {name}: {detail}", flush=True)
    count = {status: sum(r["status"] == status for r in results.values()) for status in ("pass", "skip", "fail")}
    print(f"{count['pass']}/{len(CHECKS)} passed, {count['skip']} inconclusive (SKIP), {count['fail']} failed")
    failures = count["fail"]
    if args.json:
        serving.write_json_atomic(args.json, {"url": api.base, "model": api.model, "checks": results})
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
