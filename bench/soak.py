"""Soak test of a running server (issue #21): N seeded requests of every kind an agent sends, good and bad, at a
mixed concurrency, then whether the server stayed up, answered each kind as it should, and gave back what it took.

    python -m bench.soak --url http://127.0.0.1:8000 [--n 1000] [--seed 0] [--concurrency 1,4,16,32]
        [--api-key K] [--pid PID] [--server-log PATH] [--json OUT.json] [--markdown OUT.md] [--max-seconds 600]

Loopback only (a soak sends malformed and oversized requests: never at someone else's server). The request mix is
drawn from --seed up front (kinds, bodies, waves and their concurrency), so two runs send the same requests.
Every request waits at most --request-timeout; requests not started within --max-seconds are reported as not run.

Report (JSON and a markdown table): status codes and p50/p99 latency per kind, every 5xx and every error event
inside a 200 stream with its body, /health failures and engine deaths or restarts in the server log, seats
(vllm:num_requests_running + waiting) and KV blocks in use (vllm:kv_cache_usage_perc x num_gpu_blocks) before and
after, server RSS (the PID's process tree: the API server and its engine core) and GPU memory from nvidia-smi, and
the engine's own allocator figures (PyTorch's allocated vs reserved bytes, peaks, retries, OOMs) at the start, after
the warm-up (its peaks reset there) and at the end, where the server answers vLLM's dev route POST /collective_rpc
with worker-memory-stats.patch's qs_memory_stats (VLLM_SERVER_DEV_MODE=1); recorded as unavailable, with the reason,
otherwise. Recorded, never judged.
Pass/fail: 0 5xx, 0 engine deaths, 0 leaked seats or blocks, RSS drift < 5% (from the end of the warm-up, the
waves up to 5% of the requests, to the end), every request answered with its kind's expected status. Exit code 0
when all hold, 1 when one fails, 2 when the soak could not run.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import serving
from qwen_serving import files
from qwen_serving.engine.worker_memory_stats import METHOD  # worker-memory-stats.patch's Worker method

CANCELLED = "cancelled"  # the client gave up on purpose (a cancel): the server must drop the request
NO_ANSWER = "no_answer"  # nothing answered: refused, reset, or a timeout the kind did not ask for
NO_TOOL_PARSER = "no_tool_parser"  # a 400 saying the server runs without tool calling (TOOLS=0): shown, not failed
NO_TOOL_PARSER_RE = re.compile(r"tool-call-parser|enable-auto-tool-choice")
RSS_DRIFT_LIMIT = 0.05
WARMUP_SHARE = 0.05  # the waves up to this share of the requests are the warm-up: RSS drift is measured after them
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WORDS = ("sea harbour wind tide ship rope sail gull storm calm north south light stone bridge river market "
         "bread salt iron copper garden winter summer lamp road hill valley ferry island coast").split()
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Copenhagen", "Aarhus"]}},
                   "required": ["city"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Aarhus", "Odense"]}, "coastal": {"type": "boolean"}},
          "required": ["city", "coastal"], "additionalProperties": False}

# Log lines of vLLM 0.28.0 that mean the engine died (v1/engine/core_client.py, v1/engine/exceptions.py,
# v1/engine/core.py) or the API server started again (entrypoints/openai/api_server.py, run_server).
DEATH_RE = re.compile(r"EngineDeadError|Engine core proc \S+ died|EngineCore encountered a fatal error|"
                      r"CUDA error|illegal memory access")
START_RE = re.compile(r"vLLM API server version")


class SoakError(RuntimeError):
    """The soak cannot run (a non-loopback URL, no server, a server without /metrics)."""


# ---------------------------------------------------------------------------------------------
# The server's facts the request mix depends on


@dataclass(frozen=True)
class ServerFacts:
    model: str
    max_model_len: int
    has_key: bool  # the server was started with an API key (the auth kinds then expect 401)


def require_loopback(url: str) -> str:
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SoakError(f"{url}: the soak sends malformed and oversized requests, so only to a loopback server "
                        "(127.0.0.1, ::1, localhost)")
    return url


def server_facts(client: serving.Client) -> ServerFacts:
    """The served model and its max_model_len from /v1/models; whether /v1 is guarded by a key (a request
    without one answers 401)."""
    try:
        model = client.get_json("/v1/models")["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as err:
        raise SoakError(f"no usable /v1/models at {client.base}: {err}") from None
    if not model.get("max_model_len"):
        raise SoakError(f"/v1/models names no max_model_len: {json.dumps(model)[:200]}")
    unkeyed, _ = serving.probe(client.base + "/v1/models", key=None, timeout_s=30)
    return ServerFacts(model["id"], int(model["max_model_len"]), unkeyed == 401)


# ---------------------------------------------------------------------------------------------
# Request kinds: each draws one request from the seeded generator


@dataclass(frozen=True)
class Request:
    index: int
    kind: str
    path: str
    body: dict | None = None  # JSON body
    raw: str | None = None  # a body sent as it is (malformed JSON)
    auth: str = "ok"  # "ok": the server's key; "wrong": another key; "none": no key
    mode: str = "json"  # json | stream | disconnect | cancel | retry
    events_before_drop: int = 0  # disconnect: events read before the client closes the stream
    cancel_after_s: float = 0.0  # cancel, retry: the client gives up after this long


@dataclass(frozen=True)
class Kind:
    weight: float
    expect: frozenset  # statuses that count as the right answer
    build: Callable[[random.Random, ServerFacts, int], dict]  # fields of Request besides index and kind
    needs_key: bool = False  # only drawn when the server has a key


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _chat_body(rng: random.Random, facts: ServerFacts, max_tokens: int, **extra) -> dict:
    return {"model": facts.model, "messages": [{"role": "user", "content": _sentence(rng, rng.randint(4, 40))}],
            "max_tokens": max_tokens, "temperature": rng.choice((0, 0.7)), **NO_THINK, **extra}


def _completion_body(rng: random.Random, facts: ServerFacts, max_tokens: int, **extra) -> dict:
    return {"model": facts.model, "prompt": _sentence(rng, rng.randint(4, 40)), "max_tokens": max_tokens,
            "temperature": rng.choice((0, 0.7)), **extra}


def _anthropic_body(rng: random.Random, facts: ServerFacts, max_tokens: int) -> dict:
    return {"model": facts.model, "max_tokens": max_tokens, "temperature": rng.choice((0, 0.7)),
            "messages": [{"role": "user", "content": _sentence(rng, rng.randint(4, 40))}]}


# Long prompts are token ids: their length is exact whatever the tokenizer. They share one seeded prefix (as an
# agent's turns share their context), so after the first the prefix cache makes them cheap to prefill; ids
# 1000-2999 are ordinary tokens in the real tokenizer and the synthetic one alike.
LONG_PREFIX_SEED = 21


def _token_prompt(rng: random.Random, length: int) -> list[int]:
    prefix = random.Random(LONG_PREFIX_SEED)
    shared = max(0, length - 64)
    return [prefix.randint(1000, 2999) for _ in range(shared)] + [rng.randint(1000, 2999)
                                                                   for _ in range(length - shared)]


def _long_prompt(rng, facts, max_tokens):
    length = facts.max_model_len - max_tokens - rng.randint(1, 32)
    return {"path": "/v1/completions", "body": {"model": facts.model, "prompt": _token_prompt(rng, length),
                                                "max_tokens": max_tokens, "temperature": 0}}


def _over_context(rng, facts, max_tokens):
    length = facts.max_model_len + rng.randint(1, 256)
    return {"path": "/v1/completions", "body": {"model": facts.model, "prompt": _token_prompt(rng, length),
                                                "max_tokens": max_tokens}}


def _max_tokens_over(rng, facts, max_tokens):
    # a prompt a few tokens short of the context and a max_tokens past all of it: vLLM 0.28.0 refuses a max_tokens
    # that does not fit (400), it clamps only one left out (docs/gotchas.md 26)
    length = facts.max_model_len - rng.randint(2, max(2, max_tokens))
    return {"path": "/v1/completions", "body": {"model": facts.model, "prompt": _token_prompt(rng, length),
                                                "max_tokens": 4 * facts.max_model_len, "temperature": 0}}


WRONG_TYPES = ({"messages": "hello"}, {"max_tokens": "ten"}, {"temperature": [0.5]}, {"stream": "yes please"},
                {"messages": [{"role": "user", "content": 42}]}, {"tools": {"name": "x"}})
BAD_VALUES = ({"temperature": 3.0}, {"top_p": 0}, {"presence_penalty": 5.0}, {"max_tokens": -1}, {"n": 0},
               {"logprobs": True, "top_logprobs": 1000})
MALFORMED = ('{"model": "m", "messages": [', "not json at all", '{"messages": [{"role": "user", "content": "x"}]',
              '{"max_tokens": 8,, }', "")
# a tool_choice naming a tool that is not sent, a choice without tools, a choice that is no choice
BAD_TOOL_CHOICES = ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                    {"tool_choice": "required"}, {"tools": [TOOL], "tool_choice": "sometimes"})
# JSON schemas no grammar can be built from: an unknown type, a dangling $ref, a pattern that is no regex
BAD_SCHEMAS = ({"type": "objekt"}, {"$ref": "#/definitions/nowhere"}, {"type": "string", "pattern": "(["})
# max_tokens left out (it is required), messages not a list, an unknown role, a forced tool call without tools
ANTHROPIC_BAD = ({"max_tokens": None}, {"messages": "hello"}, {"messages": [{"role": "robot", "content": "x"}]},
                 {"tool_choice": {"type": "any"}})


def _wrong_type(rng, facts, max_tokens):
    return {"path": "/v1/chat/completions", "body": {**_chat_body(rng, facts, max_tokens),
                                                            **rng.choice(WRONG_TYPES)}}


def _bad_value(rng, facts, max_tokens):
    return {"path": "/v1/chat/completions", "body": {**_chat_body(rng, facts, max_tokens),
                                                            **rng.choice(BAD_VALUES)}}


def _bad_tool_choice(rng, facts, max_tokens):
    return {"path": "/v1/chat/completions", "body": {**_chat_body(rng, facts, max_tokens),
                                                            **rng.choice(BAD_TOOL_CHOICES)}}


def _bad_schema(rng, facts, max_tokens):
    body = _chat_body(rng, facts, max_tokens, response_format={
        "type": "json_schema", "json_schema": {"name": "broken", "schema": rng.choice(BAD_SCHEMAS)}})
    return {"path": "/v1/chat/completions", "body": body}


def _empty_messages(rng, facts, max_tokens):
    path = rng.choice(("/v1/chat/completions", "/v1/messages"))
    body = (_chat_body if path == "/v1/chat/completions" else _anthropic_body)(rng, facts, max_tokens)
    return {"path": path, "body": {**body, "messages": []}}


def _chat(**extra):
    return lambda rng, facts, max_tokens: {"path": "/v1/chat/completions",
                                           "body": _chat_body(rng, facts, max_tokens, **extra)}


# Room for the JSON a constraint writes (~10-20 tokens on real weights): a cut one cannot be checked.
JSON_TOKENS = 48


def _structured(rng, facts, max_tokens):
    body = _chat_body(rng, facts, JSON_TOKENS, response_format={
        "type": "json_schema", "json_schema": {"name": "town", "schema": SCHEMA}})
    return {"path": "/v1/chat/completions", "body": body}


def _tool_forced(rng, facts, max_tokens):
    body = _chat_body(rng, facts, JSON_TOKENS, tools=[TOOL],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    return {"path": "/v1/chat/completions", "body": body}


def _anthropic(stream: bool):
    def build(rng, facts, max_tokens):
        body = _anthropic_body(rng, facts, max_tokens)
        return {"path": "/v1/messages", "body": {**body, "stream": True} if stream else body,
                "mode": "stream" if stream else "json"}
    return build


def _anthropic_bad(rng, facts, max_tokens):
    body = _anthropic_body(rng, facts, max_tokens)
    broken = rng.choice(ANTHROPIC_BAD)
    return {"path": "/v1/messages", "body": {k: v for k, v in {**body, **broken}.items() if v is not None}}


def _streamed(build, mode: str = "stream"):
    def wrapped(rng, facts, max_tokens):
        spec = build(rng, facts, max_tokens)
        spec["body"] = {**spec["body"], "stream": True}
        spec["mode"] = mode
        if mode == "disconnect":
            spec["body"]["max_tokens"] = max(spec["body"]["max_tokens"], 64)
            spec["events_before_drop"] = rng.randint(1, 4)
        return spec
    return wrapped


def _cancelled(mode: str):
    def build(rng, facts, max_tokens):
        spec = _chat()(rng, facts, max(max_tokens, 64))
        return {**spec, "mode": mode, "cancel_after_s": round(rng.uniform(0.05, 0.5), 3)}
    return build


def _completion(rng, facts, max_tokens):
    return {"path": "/v1/completions", "body": _completion_body(rng, facts, max_tokens)}


def _auth(auth: str):
    return lambda rng, facts, max_tokens: {**_chat()(rng, facts, max_tokens), "auth": auth}


OK = frozenset({200})
BAD = frozenset({400})
KINDS: dict[str, Kind] = {
    "chat": Kind(12, OK, _chat()),
    "chat_stream": Kind(12, OK, _streamed(_chat())),
    "completion": Kind(8, OK, _completion),
    "completion_stream": Kind(6, OK, _streamed(_completion)),
    "tool_auto": Kind(5, frozenset({200, NO_TOOL_PARSER}), _chat(tools=[TOOL], tool_choice="auto")),
    "tool_forced": Kind(6, frozenset({200, NO_TOOL_PARSER}), _tool_forced),
    "structured": Kind(6, OK, _structured),
    "long_prompt": Kind(2, OK, _long_prompt),
    "over_context": Kind(3, BAD, _over_context),
    "max_tokens_over": Kind(2, BAD, _max_tokens_over),
    "disconnect": Kind(6, OK, _streamed(_chat(), "disconnect")),
    "cancel": Kind(4, frozenset({CANCELLED, 200}), _cancelled("cancel")),
    "retry": Kind(4, OK, _cancelled("retry")),
    "malformed_json": Kind(3, BAD, lambda rng, facts, max_tokens: {
        "path": rng.choice(("/v1/chat/completions", "/v1/completions", "/v1/messages")), "raw": rng.choice(MALFORMED)}),
    "wrong_type": Kind(3, BAD, _wrong_type),
    "unknown_field": Kind(3, OK, _chat(frobnicate=1, reasoning_level="extreme")),
    "bad_value": Kind(3, BAD, _bad_value),
    "bad_tool_choice": Kind(2, BAD, _bad_tool_choice),
    "bad_schema": Kind(2, BAD, _bad_schema),
    "empty_messages": Kind(2, BAD, _empty_messages),
    "wrong_key": Kind(2, frozenset({401}), _auth("wrong"), needs_key=True),
    "missing_key": Kind(2, frozenset({401}), _auth("none"), needs_key=True),
    "anthropic": Kind(4, OK, _anthropic(stream=False)),
    "anthropic_stream": Kind(4, OK, _anthropic(stream=True)),
    "anthropic_bad": Kind(2, BAD, _anthropic_bad),
}


def parse_weights(text: str | None) -> dict[str, float]:
    """KIND=W,... over the default weights (0 leaves a kind out)."""
    weights = {name: kind.weight for name, kind in KINDS.items()}
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        if name not in KINDS or not value:
            raise SoakError(f"--weights {item!r}: expected KIND=WEIGHT with KIND one of {', '.join(KINDS)}")
        weights[name] = float(value)
    return weights


@dataclass(frozen=True)
class Wave:
    concurrency: int
    requests: tuple[Request, ...]


def build_plan(facts: ServerFacts, n: int, seed: int, concurrency: Iterable[int], max_tokens: int,
               weights: Mapping[str, float] | None = None) -> list[Wave]:
    """The whole run, drawn from `seed`: waves of 4 x their concurrency requests (the last one shorter), each at a
    concurrency drawn from `concurrency`, each request's kind drawn by weight and its body built by the kind."""
    rng = random.Random(seed)
    weights = dict(weights or {name: kind.weight for name, kind in KINDS.items()})
    names = [name for name, kind in KINDS.items() if weights.get(name, 0) > 0 and (facts.has_key or not kind.needs_key)]
    if not names:
        raise SoakError("every request kind has weight 0")
    levels = sorted(set(concurrency))
    waves, index = [], 0
    while index < n:
        level = rng.choice(levels)
        requests = []
        for _ in range(min(4 * level, n - index)):
            name = rng.choices(names, [weights[name] for name in names])[0]
            spec = KINDS[name].build(rng, facts, rng.randint(1, max_tokens))
            requests.append(Request(index, name, **spec))
            index += 1
        waves.append(Wave(level, tuple(requests)))
    return waves


def plan_digest(waves: list[Wave]) -> str:
    """A short hash of every request of the plan: equal digests, equal runs."""
    text = json.dumps([[w.concurrency, [r.__dict__ for r in w.requests]] for w in waves], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Sending


@dataclass
class Outcome:
    index: int
    kind: str
    status: int | str
    seconds: float
    body: str = ""  # kept for 5xx, unexpected statuses and stream errors
    stream_error: str = ""  # an error event inside a 200 stream
    problem: str = ""  # why the answer is wrong although its status is expected


def _keys(request: Request, key: str | None) -> str | None:
    return {"ok": key, "wrong": f"wrong-{key}", "none": None}[request.auth]


def _read_stream(client: serving.Client, request: Request, timeout_s: float) -> tuple[int | str, str, str, str]:
    """(status, problem, error event, error body) of a streamed request, read to its end or, for a disconnect,
    dropped after `events_before_drop` events (closing the generator closes the connection)."""
    events = client.post_events(request.path, request.body, timeout_s=timeout_s)
    seen, last, error = 0, None, ""
    try:
        for name, data in events:
            seen += 1
            last = (name, data)
            if name == "error" or (isinstance(data, dict) and "error" in data):
                error = json.dumps(data)[:2000]
            if request.mode == "disconnect" and seen >= request.events_before_drop:
                break
    except serving.HttpError as err:  # refused before the stream started
        return err.status, "", "", err.body
    except (OSError, ValueError) as err:
        return NO_ANSWER, f"stream broke after {seen} events: {err}", "", ""
    finally:
        events.close()
    ended = last is not None and (last[1] == serving.SSE_DONE or last[0] == "message_stop")
    problem = "" if ended or request.mode == "disconnect" else f"stream ended without its end marker after {seen} events"
    return 200, problem, error, ""


def _cancel(client: serving.Client, request: Request) -> tuple[int | str, str]:
    try:
        client.post_json(request.path, request.body, timeout_s=request.cancel_after_s)
        return 200, ""
    except serving.HttpError as err:
        return err.status, err.body
    except TimeoutError:
        return CANCELLED, ""
    except OSError as err:  # urllib wraps a timeout that hits while the request is still being sent
        if isinstance(getattr(err, "reason", None), TimeoutError):
            return CANCELLED, ""
        return NO_ANSWER, str(err)


def answer_problem(request: Request, text: str) -> str:
    """What is wrong with a 200 answer that the kind can check whatever the weights say ('' when nothing): the
    forced call and the json_schema answer come from structured output (checked unless they were cut at
    max_tokens, e.g. in the whitespace the grammar allows, docs/gotchas.md 25: nothing to check then)."""
    if request.kind not in ("tool_forced", "structured"):
        return ""
    try:
        out = json.loads(text)
        choice = out["choices"][0]
        if choice["finish_reason"] == "length":
            return ""
        if request.kind == "tool_forced":
            calls = choice["message"].get("tool_calls") or []
            if len(calls) != 1 or json.loads(calls[0]["function"]["arguments"]).get("city") not in ("Copenhagen",
                                                                                                    "Aarhus"):
                return f"the forced call is not get_weather with a city of the schema: {json.dumps(calls)[:300]}"
        else:
            value = json.loads(choice["message"]["content"])
            if set(value) != {"city", "coastal"}:
                return f"structured output outside the schema: {choice['message']['content'][:300]}"
    except (ValueError, KeyError, IndexError, TypeError) as err:
        return f"unreadable answer ({type(err).__name__}: {err}): {text[:300]}"
    return ""


def send(client: serving.Client, key: str | None, request: Request, timeout_s: float) -> Outcome:
    """One request of the plan, never raising for the server's answer."""
    start = time.monotonic()
    url = client.base + request.path
    problem = error = body = ""
    kind_key = _keys(request, key)
    if request.raw is not None:
        status, body = serving.probe_raw(url, request.raw.encode(), key=kind_key, timeout_s=timeout_s)
    elif request.mode in ("stream", "disconnect"):
        status, problem, error, body = _read_stream(serving.Client(client.base, kind_key), request, timeout_s)
    elif request.mode in ("cancel", "retry"):
        status, body = _cancel(serving.Client(client.base, kind_key), request)
        if request.mode == "retry" and status in (200, CANCELLED):  # the same request again, to its end
            status, body = serving.probe(url, request.body, key=kind_key, timeout_s=timeout_s)
    else:
        status, body = serving.probe(url, request.body, key=kind_key, timeout_s=timeout_s)
    if status == 0:
        status, problem = NO_ANSWER, body
    elif status == 400 and request.kind.startswith("tool_") and NO_TOOL_PARSER_RE.search(body):
        status = NO_TOOL_PARSER
    elif status == 200 and request.mode in ("json", "retry"):
        problem = answer_problem(request, body)
    elif isinstance(status, int) and 400 <= status < 500 and not has_message(body):
        problem = f"HTTP {status} without a message"
    outcome = Outcome(request.index, request.kind, status, round(time.monotonic() - start, 4), stream_error=error,
                      problem=problem)
    if isinstance(status, int) and status >= 500 or status not in KINDS[request.kind].expect or error or problem:
        outcome.body = (body or error)[:4000]
    return outcome


def has_message(body: str) -> bool:
    """A 4xx body that says what was wrong: OpenAI's {"error": {"message"}}, Anthropic's, FastAPI's {"detail"},
    vLLM's auth answer {"error": "Unauthorized"}."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    error = data.get("error", data.get("detail")) if isinstance(data, dict) else None
    return bool(error.get("message") if isinstance(error, dict) else error)


# ---------------------------------------------------------------------------------------------
# The server's state: /metrics, /health, its log, its processes, the GPU


def metrics_state(client: serving.Client) -> dict:
    """Seats in use (running + waiting requests), KV blocks in use and the preemptions so far (None when the page
    has no such counter), from vLLM's /metrics."""
    samples = serving.parse_prometheus(client.get_text("/metrics", timeout_s=30))

    def total(name: str) -> float:
        values = [s.value for s in samples if s.name == name]
        if not values:
            raise SoakError(f"/metrics has no {name}")
        return sum(values)

    usage = total("vllm:kv_cache_usage_perc")
    blocks = [int(s.labels["num_gpu_blocks"]) for s in samples
              if s.name == "vllm:cache_config_info" and s.labels.get("num_gpu_blocks", "").isdigit()]
    preempted = [s.value for s in samples if s.name in ("vllm:num_preemptions", "vllm:num_preemptions_total")]
    state = {"running": total("vllm:num_requests_running"), "waiting": total("vllm:num_requests_waiting"),
             "kv_cache_usage": usage, "num_gpu_blocks": blocks[0] if blocks else None,
             "preemptions": sum(preempted) if preempted else None}
    state["seats_in_use"] = int(state["running"] + state["waiting"])
    state["kv_blocks_in_use"] = round(usage * blocks[0]) if blocks else None
    return state


def settled_state(client: serving.Client, baseline: dict, settle_s: float) -> dict:
    """The metrics once the server has given back what the soak took, or after `settle_s` (a seat that is still
    held then is leaked: every request of the soak has ended on the client's side)."""
    deadline = time.monotonic() + settle_s
    while True:
        state = metrics_state(client)
        done = state["seats_in_use"] <= baseline["seats_in_use"] and state["kv_cache_usage"] <= baseline["kv_cache_usage"]
        if done or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


class HealthWatch(threading.Thread):
    """GET /health every `every_s` while the soak runs: each answer that is not 200 after a 200 is a death."""

    def __init__(self, base: str, every_s: float):
        super().__init__(daemon=True)
        self.url, self.every_s = base + "/health", every_s
        self.stop = threading.Event()
        self.checks = 0
        self.failures: list[dict] = []
        self.deaths = 0
        self._healthy = True

    def check(self) -> None:
        status, body = serving.probe(self.url, timeout_s=10)
        self.checks += 1
        if status != 200:
            self.failures.append({"t": round(time.time(), 1), "status": status, "body": body[:300]})
            self.deaths += self._healthy
        self._healthy = status == 200

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.check()

    def summary(self) -> dict:
        return {"checks": self.checks, "deaths": self.deaths, "failures": self.failures[:50]}


def log_events(text: str) -> dict:
    """Engine deaths and server starts in the part of the server log written during the soak."""
    deaths = [line.strip()[:300] for line in text.splitlines() if DEATH_RE.search(line)]
    return {"death_lines": len(deaths), "deaths_first": deaths[:10], "restarts": len(START_RE.findall(text))}


def listening_pid(port: int, proc: Path = Path("/proc")) -> int | None:
    """The process listening on TCP `port` (its socket's inode in /proc/net/tcp*, then the fd that holds it)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:  # another user's process, or gone
            continue
    return None


def process_tree_rss(pid: int, proc: Path = Path("/proc")) -> dict | None:
    """VmRSS of `pid` and all its descendants (vLLM's engine core is a child of the API server), in bytes."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if "VmRSS" not in fields:  # a zombie: it has exited, only its parent has not reaped it
            continue
        parents[int(entry.name)] = int(fields.get("PPid", "0").strip())
        rss[int(entry.name)] = int(fields["VmRSS"].split()[0]) * 1024
    if pid not in parents:
        return None
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent and p not in tree]
        tree.update(children)
        frontier.extend(children)
    return {"pids": sorted(tree), "bytes": sum(rss[p] for p in tree)}


def gpu_memory_mib() -> list[int] | None:
    """memory.used per GPU from nvidia-smi; None where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return [int(float(v)) for v in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


ALLOCATOR_KEYS = ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes", "peak_reserved_bytes")
MiB = 1 << 20


def allocator_stats(client: serving.Client, reset_peak: bool = False, timeout_s: float = 30) -> dict:
    """The engine's PyTorch allocator figures, one dict per worker (bytes), from POST /collective_rpc
    {"method": "qs_memory_stats", "args": ["1" or "0"]}; "1" resets the peaks once read. Where the server has no
    such route (started without VLLM_SERVER_DEV_MODE=1) or its workers no such method (the patch not applied),
    {"available": False, "reason": ...}: never an error."""
    body = {"method": METHOD, "args": ["1" if reset_peak else "0"]}
    status, text = serving.probe(client.base + "/collective_rpc", body, key=client.key, timeout_s=timeout_s)
    if status != 200:
        why = {0: "no answer", 404: "no /collective_rpc route (server started without VLLM_SERVER_DEV_MODE=1)"}.get(
            status, f"HTTP {status} (a worker without {METHOD}: worker-memory-stats.patch not applied?)")
        return {"available": False, "reason": f"{why}: {text.strip()[:300]}"}
    try:
        workers = json.loads(text)["results"]
    except (ValueError, KeyError, TypeError):
        workers = None
    if not isinstance(workers, list) or not workers or not all(
            isinstance(w, dict) and all(isinstance(w.get(k), int) for k in ALLOCATOR_KEYS) for w in workers):
        return {"available": False, "reason": f"/collective_rpc answered 200 without allocator figures: {text[:300]}"}
    return {"available": True, "peak_reset": reset_peak, "workers": workers}


def allocator_summary(records: dict) -> dict | None:
    """Worker 0's end figures in MiB, its peak since the warm-up's reset (else since the engine's last one), and
    the allocation retries and OOMs during the soak (else since the engine started); None without an end record."""
    end = records.get("end") or {}
    if not end.get("available"):
        return None
    last = end["workers"][0]
    warm, start = records.get("after_warmup") or {}, records.get("start") or {}
    since = "after_warmup" if warm.get("available") and warm.get("peak_reset") else "last_reset"
    counted = start["workers"][0] if start.get("available") else None

    def during(key: str) -> int:
        return int(last.get(key, 0)) - (int(counted.get(key, 0)) if counted else 0)

    return {"workers": len(end["workers"]),
            "allocated_mib": round(last["allocated_bytes"] / MiB), "reserved_mib": round(last["reserved_bytes"] / MiB),
            "cached_mib": round((last["reserved_bytes"] - last["allocated_bytes"]) / MiB),
            "peak_allocated_mib": round(last["peak_allocated_bytes"] / MiB),
            "peak_reserved_mib": round(last["peak_reserved_bytes"] / MiB), "peak_since": since,
            "alloc_retries": during("num_alloc_retries"), "ooms": during("num_ooms"),
            "counted_from": "start" if counted else "engine_start"}


# ---------------------------------------------------------------------------------------------
# Running and reporting


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class Progress:
    """One line on stderr, redrawn as requests finish."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream = total, 0, stream
        self.start = time.monotonic()
        self.lock = threading.Lock()

    def tick(self) -> None:
        with self.lock:
            self.done += 1
            if 100 * self.done // self.total == 100 * (self.done - 1) // self.total:
                return  # redrawn once per percent: a log file gets 100 lines, not N
            filled = 30 * self.done // max(1, self.total)
            self.stream.write(f"\rsoak [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                              f"{time.monotonic() - self.start:.0f} s")
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()


@dataclass
class Options:
    n: int = 1000
    seed: int = 0
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    max_tokens: int = 32
    max_seconds: float = 600
    request_timeout_s: float = 120
    settle_s: float = 30
    health_every_s: float = 1.0
    weights: dict[str, float] = field(default_factory=dict)
    pid: int | None = None
    server_log: Path | None = None


def run_soak(url: str, key: str | None, options: Options) -> dict:
    """Plan, send, watch and judge; the report as a dict."""
    client = serving.Client(require_loopback(url), key)
    facts = server_facts(client)
    waves = build_plan(facts, options.n, options.seed, options.concurrency, options.max_tokens,
                       options.weights or None)
    port = urllib.parse.urlsplit(client.base).port or 80
    pid = options.pid or listening_pid(port)
    log_offset = options.server_log.stat().st_size if options.server_log and options.server_log.exists() else 0
    before = metrics_state(client)
    rss = {"start": pid and process_tree_rss(pid)}
    gpu = {"start": gpu_memory_mib()}
    allocator = {"start": allocator_stats(client)}
    watch = HealthWatch(client.base, options.health_every_s)
    watch.check()
    watch.start()
    progress = Progress(options.n)
    outcomes: list[Outcome] = []
    not_run = 0
    started = time.monotonic()
    deadline = started + options.max_seconds
    for wave in waves:
        if time.monotonic() > deadline:
            not_run += len(wave.requests)
            continue
        with ThreadPoolExecutor(wave.concurrency) as pool:
            outcomes.extend(pool.map(lambda r: _timed(client, key, r, options, deadline, progress),
                                     wave.requests))
        if "after_warmup" not in rss and len(outcomes) >= WARMUP_SHARE * options.n:
            rss["after_warmup"] = pid and process_tree_rss(pid)  # allocations of first use are not drift
            gpu["after_warmup"] = gpu_memory_mib()
            allocator["after_warmup"] = allocator_stats(client, reset_peak=True)  # the end's peak: the soak's own
    skipped = [o for o in outcomes if o is None]
    outcomes = [o for o in outcomes if o is not None]
    not_run += len(skipped)
    duration = time.monotonic() - started
    watch.stop.set()
    watch.join()
    watch.check()
    after = _state_or_none(lambda: settled_state(client, before, options.settle_s))
    rss["end"] = pid and process_tree_rss(pid)
    gpu["end"] = gpu_memory_mib()
    allocator["end"] = allocator_stats(client)
    log = None
    if options.server_log:
        with open(options.server_log, errors="replace") as handle:
            handle.seek(log_offset)
            log = log_events(handle.read())
    return report(facts, client.base, options, waves, outcomes, not_run, duration, before, after, watch.summary(),
                  log, pid, rss, gpu, allocator)


def _timed(client, key, request: Request, options: Options, deadline: float,
           progress: Progress) -> Outcome | None:
    if time.monotonic() > deadline:
        return None
    outcome = send(client, key, request, options.request_timeout_s)
    progress.tick()
    return outcome


def _state_or_none(read: Callable[[], dict]) -> dict | None:
    """The metrics after the soak; None when a dead server has none to give."""
    try:
        return read()
    except (OSError, ValueError, SoakError):
        return None


def _drift(start: Any, end: Any) -> float | None:
    return None if not start or not end else round((end - start) / start, 4)


def report(facts: ServerFacts, base: str, options: Options, waves: list[Wave], outcomes: list[Outcome],
           not_run: int, duration: float, before: dict, after: dict | None, health: dict, log: dict | None,
           pid: int | None, rss: dict, gpu: dict, allocator: dict | None = None) -> dict:
    kinds: dict[str, dict] = {}
    for name in dict.fromkeys(r.kind for w in waves for r in w.requests):
        mine = [o for o in outcomes if o.kind == name]
        statuses: dict[str, int] = {}
        for o in mine:
            statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
        seconds = [o.seconds for o in mine if o.status != NO_ANSWER]
        expect = KINDS[name].expect
        kinds[name] = {"count": len(mine), "statuses": dict(sorted(statuses.items())),
                       "expected": sorted(map(str, expect)),
                       "unexpected": sum(o.status not in expect or bool(o.problem) for o in mine),
                       "p50_s": percentile(seconds, 0.5), "p99_s": percentile(seconds, 0.99)}
    server_errors = [o.__dict__ for o in outcomes if isinstance(o.status, int) and o.status >= 500]
    stream_errors = [o.__dict__ for o in outcomes if o.stream_error]
    unexpected = [o.__dict__ for o in outcomes if o.status not in KINDS[o.kind].expect or o.problem]
    rss_start = (rss.get("after_warmup") or rss.get("start") or {}).get("bytes")
    rss_end = (rss.get("end") or {}).get("bytes")
    gpu_start = gpu.get("after_warmup") or gpu.get("start")
    gpu_end = gpu.get("end")
    deaths = health["deaths"] + (log or {}).get("death_lines", 0) + (log or {}).get("restarts", 0) + (
        1 if pid and rss.get("start") and not rss.get("end") else 0)
    leaked_seats = None if after is None else after["seats_in_use"] - before["seats_in_use"]
    # blocks where the page names the pool's size, else the usage fraction
    unit = "kv_blocks_in_use" if before["kv_blocks_in_use"] is not None else "kv_cache_usage"
    leaked_blocks = None if after is None else round(after[unit] - before[unit], 4)
    rss_drift = _drift(rss_start, rss_end)
    criteria = {
        "no_5xx": {"value": len(server_errors) + len(stream_errors), "passed": not server_errors and not stream_errors,
                   "rule": "0 answers >= 500 and 0 error events inside a 200 stream"},
        "no_engine_death": {"value": deaths, "passed": deaths == 0,
                            "rule": "/health 200 throughout, no death or restart line in the log, the PID alive"},
        "no_leaked_seats": {"value": leaked_seats, "passed": leaked_seats is not None and leaked_seats <= 0,
                            "rule": "running + waiting back to the start's count once the soak ends"},
        "no_leaked_blocks": {"value": leaked_blocks, "passed": leaked_blocks is not None and leaked_blocks <= 0,
                             "rule": f"{unit} back to the start's value once the soak ends"},
        "rss_drift_under_5pct": {"value": rss_drift, "passed": rss_drift is not None and rss_drift < RSS_DRIFT_LIMIT,
                                 "rule": "server process tree RSS, end vs after the warm-up waves, < 5%"},
        "expected_answers": {"value": len(unexpected), "passed": not unexpected and not_run == 0,
                             "rule": "every request run, each with its kind's expected status and a checkable answer "
                                     "(4xx with a message)"},
    }
    return {
        "url": base, "model": facts.model, "max_model_len": facts.max_model_len, "api_key_set": facts.has_key,
        "seed": options.seed, "n": options.n, "concurrency": list(options.concurrency),
        "max_tokens": options.max_tokens, "plan_digest": plan_digest(waves), "waves": len(waves),
        "duration_s": round(duration, 1), "not_run": not_run, "kinds": kinds,
        "server_errors": server_errors, "stream_errors": stream_errors, "unexpected": unexpected[:100],
        "health": health, "log": log, "pid": pid,
        "seats": {"before": before["seats_in_use"], "after": None if after is None else after["seats_in_use"]},
        "kv_blocks": {"before": before["kv_blocks_in_use"], "after": None if after is None else after["kv_blocks_in_use"],
                      "num_gpu_blocks": before["num_gpu_blocks"], "usage_before": before["kv_cache_usage"],
                      "usage_after": None if after is None else after["kv_cache_usage"]},
        # recorded, not judged: a full pool preempts (and recomputes) requests, which is slow but not a fault
        "preemptions": None if after is None or after.get("preemptions") is None or before.get("preemptions") is None
        else after["preemptions"] - before["preemptions"],
        "rss": {**rss, "drift": rss_drift},
        "gpu_memory_mib": {**gpu, "drift_mib": None if not gpu_start or not gpu_end else sum(gpu_end) - sum(gpu_start)},
        # recorded, not judged: what PyTorch's allocator holds vs keeps, from the engine itself (None: not asked)
        "allocator": None if allocator is None else {"method": METHOD, **allocator,
                                                      "summary": allocator_summary(allocator)},
        "criteria": criteria, "passed": all(c["passed"] for c in criteria.values()),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def allocator_lines(allocator: dict | None) -> list[str]:
    """One line on the engine's allocator figures (none when they were not asked for)."""
    if not allocator:
        return []
    summary = allocator.get("summary")
    if summary is None:
        reason = (allocator.get("end") or {}).get("reason", "no end record")
        return [f"engine allocator figures unavailable ({allocator['method']} over /collective_rpc): {reason}"]
    who = "worker 0" + (f" of {summary['workers']}" if summary["workers"] > 1 else "")
    peak = "since the warm-up" if summary["peak_since"] == "after_warmup" else "since the engine's last peak reset"
    counted = "during the soak" if summary["counted_from"] == "start" else "since the engine started"
    return [f"engine allocator at the end ({who}): {summary['allocated_mib']:,} MiB allocated, "
            f"{summary['reserved_mib']:,} MiB reserved ({summary['cached_mib']:,} MiB kept by the cache); peak "
            f"{peak} {summary['peak_allocated_mib']:,} MiB allocated / {summary['peak_reserved_mib']:,} MiB reserved; "
            f"{summary['alloc_retries']} allocation retries and {summary['ooms']} OOMs {counted} (recorded, not judged)"]


def markdown(result: dict) -> str:
    """The per-kind table and the criteria, as bench/README.md shows them."""
    lines = ["| kind | requests | statuses | expected | unexpected | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|"]
    for name, k in result["kinds"].items():
        statuses = ", ".join(f"{s}: {c}" for s, c in k["statuses"].items())
        lines.append(f"| {name} | {k['count']} | {statuses} | {' or '.join(k['expected'])} | {k['unexpected']} | "
                     f"{_ms(k['p50_s'])} | {_ms(k['p99_s'])} |")
    lines += ["", "| criterion | value | result |", "|---|---|---|"]
    for name, c in result["criteria"].items():
        lines.append(f"| {name} ({c['rule']}) | {c['value']} | {'PASS' if c['passed'] else 'FAIL'} |")
    extra = [f"{result['not_run']} of {result['n']} requests not run (the time budget ran out)"] if result["not_run"] else []
    extra += allocator_lines(result.get("allocator"))
    if result.get("preemptions") is not None:
        extra.append(f"{result['preemptions']:g} requests preempted during the soak (vllm:num_preemptions; recorded, "
                     "not judged)")
    return "\n".join(lines + ([""] + extra if extra else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", help="default: $VLLM_API_KEY, else the first line of api_key.txt")
    p.add_argument("--n", type=int, default=1000, help="requests (1-100000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", default="1,4,16,32", help="levels the waves are drawn from")
    p.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a good request")
    p.add_argument("--max-seconds", type=float, default=600, help="no request starts after this")
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--settle", type=float, default=30, help="seconds the server has to give seats back")
    p.add_argument("--weights", help="KIND=W,... over the default mix (0 leaves a kind out)")
    p.add_argument("--pid", type=int, help="the server's PID (default: the process listening on the URL's port)")
    p.add_argument("--server-log", type=Path, help="the server's log, read for engine deaths and restarts")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--markdown", type=Path, help="write the per-kind table here")
    args = p.parse_args(argv)
    try:
        levels = tuple(int(v) for v in args.concurrency.split(","))
        if not 1 <= args.n <= 100_000 or not levels or min(levels) < 1 or max(levels) > 256:
            raise SoakError("--n must be 1-100000 and --concurrency levels 1-256")
        options = Options(args.n, args.seed, levels, args.max_tokens, args.max_seconds, args.request_timeout,
                          args.settle, weights=parse_weights(args.weights), pid=args.pid, server_log=args.server_log)
        result = run_soak(args.url, serving.api_key(args.api_key), options)
    except (SoakError, ValueError, OSError) as err:
        print(f"soak: {err}", file=sys.stderr)
        return 2
    table = markdown(result)
    print(table, end="")
    for error in result["server_errors"][:20]:
        print(f"5xx #{error['index']} {error['kind']}: HTTP {error['status']}: {error['body'][:300]}")
    print(f"soak {'PASSED' if result['passed'] else 'FAILED'}: {result['n']} requests in {result['duration_s']} s, "
          f"plan {result['plan_digest']}")
    if args.json:
        serving.write_json_atomic(args.json, result)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        files.write_text_atomic(args.markdown, table)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
