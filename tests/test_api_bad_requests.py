"""Issue #21 item 2: what vLLM 0.28.0's own API server answers to each bad request bench/soak.py sends, and to the
other shapes an agent gets wrong, over a fake engine on the CPU (tests/helpers/fake_engine_api.py: vLLM's app,
routes, middleware, request models, serving classes, renderer, tokenizer and InputProcessor; only the engine core
is canned). What we want, for every case: a 4xx whose message names what was wrong, never a 5xx, never an
exception out of the app, never the server told to exit; and a client that leaves mid-request makes the engine
abort it. CPU harness, fake engine: not yet seen on a served GPU (docs/gotchas.md 26)."""

from __future__ import annotations

import json
import random

import pytest

from bench import soak
from tests.helpers import fake_engine_api
from tests.helpers.tiny_checkpoint import make_tiny

KEY = "sk-test"
MAX_MODEL_LEN = 512
# what the launchers pass for a served model with tools (qwen_serving/knobs.py: SERVED_NAME, TOOLS=1, TOOL_PARSER)
FLAGS = ("--api-key", KEY, "--served-model-name", "qwen3.8-27b", "--enable-auto-tool-choice",
         "--tool-call-parser", "qwen3_coder")
CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return fake_engine_api.start(make_tiny(tmp_path_factory), *FLAGS, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(autouse=True)
def engine_stays_up(request):
    """After every test: no exception came out of the app, no request failed inside the engine client (AsyncLLM's
    EngineGenerateError) or at the engine core's grammar compile (a request that passed the API's checks and
    fails there is a 500), and nothing told the server to exit (vLLM's handlers do when the engine is dead)."""
    yield
    if "server" in request.fixturenames:
        server = request.getfixturevalue("server")
        server.settle()
        assert not server.client.raised, server.client.raised
        assert not server.engine.failed, server.engine.failed
        assert not server.engine.grammar_errors, server.engine.grammar_errors
        assert not server.app.state.server.should_exit


def chat(server, **fields) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "Where does the ferry leave?"}],
            "max_tokens": 8, **fields}


def completion(server, **fields) -> dict:
    return {"model": server.model, "prompt": "The ferry leaves", "max_tokens": 8, **fields}


def anthropic(server, **fields) -> dict:
    return {"model": server.model, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Where does the ferry leave?"}], **fields}


def message_of(response: fake_engine_api.Response) -> str:
    """The error message of a 4xx in OpenAI's shape or Anthropic's, with the parameter OpenAI's names."""
    error = response.json()["error"]
    return f"{error.get('message', '')} param={error.get('param')}"


def refused(response: fake_engine_api.Response, status: int, *names: str) -> str:
    """Assert a `status` answer whose message names each of `names`; the message."""
    assert response.status == status, (response.status, response.text[:600])
    message = message_of(response)
    for name in names:
        assert name.lower() in message.lower(), (name, message)
    return message


# ---------------------------------------------------------------------------------------------
# The harness serves good requests: the refusals below are the app's, not a broken setup


@pytest.mark.parametrize(("path", "body"), [(CHAT, chat), (COMPLETIONS, completion), (MESSAGES, anthropic)])
def test_good_requests_are_answered(server, path, body):
    response = server.client.post(path, body(server))
    assert response.status == 200, response.text
    assert "harbour" in response.text  # the fake engine's canned tokens, detokenized by vLLM


def test_a_good_stream_ends_with_done(server):
    response = server.client.post(CHAT, chat(server, stream=True))
    assert response.status == 200 and response.events()[-1] == "[DONE]"


def test_a_grammar_the_engine_core_cannot_compile_is_a_500(tmp_path_factory, monkeypatch):
    """The harness sees what the engine core would fail: a schema that slipped past the API's checks finishes its
    request with an error, and vLLM's handler answers 500 (on a server of its own: the shared one stays clean)."""
    from vllm.sampling_params import SamplingParams

    def unchecked(params, *args, **kwargs):  # what the API's check leaves behind, without the check
        params.structured_outputs._backend = "xgrammar"

    monkeypatch.setattr(SamplingParams, "_validate_structured_outputs", unchecked)
    broken = fake_engine_api.start(make_tiny(tmp_path_factory), "--served-model-name", "m")
    response = broken.client.post(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": 4, "structured_outputs": {"json": {"type": "objekt"}}})
    assert response.status == 500 and "Internal server error" in response.text, response.text
    assert len(broken.engine.grammar_errors) == 1 and not broken.engine.failed


# ---------------------------------------------------------------------------------------------
# every kind bench/soak.py draws, as it draws them: the status the soak expects is vLLM's
# (disconnect, cancel and retry are the client's doing: the tests at the end)

SENT_AS_BUILT = [name for name in soak.KINDS if name not in ("disconnect", "cancel", "retry")]


@pytest.mark.parametrize("kind", SENT_AS_BUILT)
def test_each_soak_kind_gets_the_answer_the_soak_expects(server, kind):
    facts = soak.ServerFacts(server.model, MAX_MODEL_LEN, has_key=True)
    keys = {"ok": KEY, "wrong": f"wrong-{KEY}", "none": None}
    for seed in range(6):  # a few draws of the kind (each variant of each bad kind has its own test below)
        spec = soak.KINDS[kind].build(random.Random(seed), facts, 16)
        request = soak.Request(seed, kind, **spec)
        with server.slow_tokens(0):
            response = server.client.post(request.path, request.body, key=keys[request.auth],
                                          raw=None if request.raw is None else request.raw.encode())
        assert response.status in soak.KINDS[kind].expect, (request, response.status, response.text[:600])
        if response.status >= 400:
            assert soak.has_message(response.text), response.text
        elif request.mode == "stream":
            assert response.events()[-1] in ("[DONE]", '{"type":"message_stop"}'), response.events()[-3:]


# ---------------------------------------------------------------------------------------------
# soak kinds: malformed_json, wrong_type, unknown_field, bad_value


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES])
@pytest.mark.parametrize("raw", soak.MALFORMED)
def test_malformed_json(server, path, raw):
    refused(server.client.post(path, raw=raw.encode()), 400, "JSON decode error" if raw else "Field required")


@pytest.mark.parametrize("wrong", soak.WRONG_TYPES, ids=lambda wrong: next(iter(wrong)))
def test_wrong_type_names_the_field(server, wrong):
    refused(server.client.post(CHAT, chat(server, **wrong)), 400, next(iter(wrong)))


def test_a_body_that_is_not_an_object(server):
    refused(server.client.post(CHAT, [1, 2]), 400, "valid dictionary")


@pytest.mark.parametrize("raw", [b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
                                 b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"], ids=["not-utf8", "deep"])
def test_a_body_that_cannot_be_parsed(server, raw):
    response = server.client.post(CHAT, raw=raw)
    assert response.status == 400 and response.json() == {"detail": "There was an error parsing the body"}


@pytest.mark.parametrize("content_type", ["text/plain", ""])
def test_a_body_that_is_not_sent_as_json(server, content_type):
    response = server.client.post(CHAT, chat(server), headers={"content-type": content_type})
    refused(response, 400, "Unsupported Media Type")


def test_unknown_fields_are_ignored_not_refused(server):
    # OpenAI's own API refuses unknown fields; vLLM ignores them (with a log line), which is what an agent that
    # sends another vendor's extras needs: the request runs as if they were absent.
    response = server.client.post(CHAT, chat(server, frobnicate=1, reasoning_level="extreme"))
    assert response.status == 200, response.text


@pytest.mark.parametrize("bad", soak.BAD_VALUES, ids=lambda bad: next(iter(bad)))
def test_bad_value_names_the_parameter(server, bad):
    name = next(iter(bad))
    named = {"top_logprobs": "logprobs", "n": "n must"}.get(name, name)  # the messages word these two so
    refused(server.client.post(CHAT, chat(server, **bad)), 400, named)


@pytest.mark.parametrize(("fields", "named"), [
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 10}, "min_tokens"),  # over max_tokens 8
    ({"n": 16385}, "VLLM_MAX_N_SEQUENCES"),
    ({"stop": [""]}, "stop"),
    ({"allowed_token_ids": [10 ** 7]}, "allowed_token_ids"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
])
def test_more_values_out_of_range(server, fields, named):
    refused(server.client.post(CHAT, chat(server, **fields)), 400, named)


# ---------------------------------------------------------------------------------------------
# soak kinds: wrong_key, missing_key (the server has --api-key)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES])
@pytest.mark.parametrize("headers", [{"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {}],
                         ids=["wrong-bearer", "wrong-x-api-key", "missing"])
def test_wrong_or_missing_key(server, path, headers):
    admitted = len(server.engine.started)
    response = server.client.post(path, anthropic(server) if path == MESSAGES else chat(server), key=None,
                                  headers=headers)
    assert response.status == 401 and response.json() == {"error": "Unauthorized"}
    assert len(server.engine.started) == admitted  # refused before any handler ran


def test_the_anthropic_header_with_the_right_key_passes(server):  # patches/api-key-x-api-key.patch
    response = server.client.post(MESSAGES, anthropic(server), key=None, headers={"x-api-key": KEY})
    assert response.status == 200, response.text


# ---------------------------------------------------------------------------------------------
# soak kinds: over_context, max_tokens_over


def test_token_prompt_over_max_model_len(server):
    body = completion(server, prompt=[1000] * (MAX_MODEL_LEN + 88))
    refused(server.client.post(COMPLETIONS, body), 400, "maximum context length is 512", "600 input tokens")


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_text_prompt_over_max_model_len(server, path):
    long = [{"role": "user", "content": "sea " * (2 * MAX_MODEL_LEN)}]
    body = (anthropic if path == MESSAGES else chat)(server, messages=long)
    refused(server.client.post(path, body), 400, "maximum context length is 512")


def test_max_tokens_over_max_model_len(server):
    body = completion(server, prompt=[1000] * 500, max_tokens=4 * MAX_MODEL_LEN)
    refused(server.client.post(COMPLETIONS, body), 400, "max_tokens=2048", "max_model_len")


def test_max_tokens_over_the_context_left(server):
    # within max_model_len, but prompt + max_tokens exceed it: refused too (0.28.0 does not clamp a given max_tokens)
    body = completion(server, prompt=[1000] * 500, max_tokens=100)
    refused(server.client.post(COMPLETIONS, body), 400, "requested 100 output tokens", "500 input tokens")


def test_max_completion_tokens_over(server):
    refused(server.client.post(CHAT, chat(server, max_completion_tokens=10 ** 5)), 400, "max_completion_tokens")


def test_a_chat_without_max_tokens_gets_the_context_left(server):
    body = chat(server, messages=[{"role": "user", "content": "sea " * 200}])
    del body["max_tokens"]
    assert server.client.post(CHAT, body).status == 200
    request_id = server.engine.started[-1]
    assert server.engine.params[request_id].max_tokens == MAX_MODEL_LEN - server.engine.prompt_lengths[request_id]


# ---------------------------------------------------------------------------------------------
# n and logprobs out of range


@pytest.mark.parametrize(("fields", "named"), [
    ({"n": 0}, "n must be at least 1"),
    ({"n": -3}, "n must be at least 1"),
    ({"n": 2, "temperature": 0}, "n must be 1 when using greedy"),
    ({"logprobs": True, "top_logprobs": 21}, "max allowed: 20"),
    ({"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ({"top_logprobs": 5}, "`logprobs` must be set"),
])
def test_chat_n_and_logprobs_out_of_range(server, fields, named):
    refused(server.client.post(CHAT, chat(server, **fields)), 400, named)


@pytest.mark.parametrize(("fields", "named"), [
    ({"logprobs": 21}, "max allowed: 20"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt logprobs"),
    ({"n": 0}, "n must be at least 1"),
])
def test_completion_n_and_logprobs_out_of_range(server, fields, named):
    refused(server.client.post(COMPLETIONS, completion(server, **fields)), 400, named)


# ---------------------------------------------------------------------------------------------
# tool_choice, response_format, messages


@pytest.mark.parametrize(("fields", "named"), [
    ({"tools": [soak.TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "does not match any of the specified `tools`"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "`tools` must be set"),
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"tools": [soak.TOOL], "tool_choice": "sometimes"}, "Invalid value for `tool_choice`"),
    ({"tools": [soak.TOOL], "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": [], "tool_choice": "auto"}, "`tools` must not be an empty array"),
    ({"tools": [{"type": "function"}]}, "function"),
    ({"tools": [soak.TOOL, soak.TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "exactly one tool"),
])
def test_bad_tool_choice(server, fields, named):
    refused(server.client.post(CHAT, chat(server, **fields)), 400, named)


@pytest.mark.parametrize("fields", soak.BAD_TOOL_CHOICES, ids=["unknown-name", "without-tools", "not-a-choice"])
def test_the_soaks_bad_tool_choices(server, fields):
    refused(server.client.post(CHAT, chat(server, **fields)), 400, "tool")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "broken"}}])
def test_a_tool_schema_no_grammar_takes(server, tool_choice):
    # a 400, though its message ("'triggers'") names nothing the client sent (docs/gotchas.md 26)
    tool = {"type": "function", "function": {"name": "broken", "parameters": {"type": "objekt"}}}
    refused(server.client.post(CHAT, chat(server, tools=[tool], tool_choice=tool_choice)), 400,
            "Invalid grammar specification")


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "town", "schema": schema}}


@pytest.mark.parametrize(("response_format", "named"), [
    (schema_format({"type": "objekt"}), "objekt"),
    (schema_format({"$ref": "#/definitions/nowhere"}), "does not exist"),
    (schema_format({"type": "string", "pattern": "(["}), "regex"),
    (schema_format({"type": "string", "minLength": 5, "maxLength": 2}), "unsatisfiable"),
    (schema_format("a string"), "response_format"),
    ({"type": "json_schema"}, "'json_schema' field must be provided"),
    ({"type": "yaml"}, "response_format"),
])
def test_bad_response_format(server, response_format, named):
    refused(server.client.post(CHAT, chat(server, response_format=response_format)), 400, named)


@pytest.mark.parametrize("schema", soak.BAD_SCHEMAS, ids=["unknown-type", "dangling-ref", "bad-pattern"])
def test_the_soaks_bad_schemas(server, schema):
    refused(server.client.post(CHAT, chat(server, response_format=schema_format(schema))), 400, "grammar error")


@pytest.mark.parametrize(("constraint", "named"), [
    ({"regex": "(["}, "regex"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"choice": []}, "cannot be an empty list"),
    ({"regex": "a", "choice": ["a"]}, "one kind of constraints"),
    ({"json": "{not json"}, "Invalid JSON grammar"),
    ({"structural_tag": "garbage"}, "structural_tag"),
])
def test_bad_structured_outputs(server, constraint, named):
    refused(server.client.post(CHAT, chat(server, structured_outputs=constraint)), 400, named)


def test_a_good_schema_compiles_in_the_engine(server):
    # the engine core's grammar compile (vLLM's StructuredOutputManager, run by the fake) takes what the API passed
    response = server.client.post(CHAT, chat(server, response_format=schema_format(soak.SCHEMA)))
    assert response.status == 200 and not server.engine.grammar_errors


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_empty_messages(server, path):
    body = (anthropic if path == MESSAGES else chat)(server, messages=[])
    refused(server.client.post(path, body), 400, "empty conversation")


@pytest.mark.parametrize("messages", [[{"role": "robot", "content": "x"}], [{"content": "x"}]])
def test_a_message_without_a_known_role(server, messages):
    refused(server.client.post(CHAT, chat(server, messages=messages)), 400, "role")


USER = {"role": "user", "content": "x"}


@pytest.mark.parametrize(("messages", "named"), [
    ([USER, {"role": "system", "content": "late"}], "system message is only allowed first"),
    ([{"role": "user", "content": None}], "content"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "type"),
    ([USER, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}],
     "Expecting property name"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     "At most 0 image(s)"),
    ([{"role": "user", "content": "\ud800"}], "TextEncodeInput"),  # a lone surrogate: the tokenizer's words
])
def test_bad_messages(server, messages, named):
    refused(server.client.post(CHAT, chat(server, messages=messages)), 400, named)


@pytest.mark.parametrize(("path", "fields"), [
    (COMPLETIONS, {"echo": True, "logprobs": 2}),
    (COMPLETIONS, {"prompt": ["a", "b"], "n": 2, "temperature": 1}),
    (COMPLETIONS, {"use_beam_search": True, "n": 2}),
    (CHAT, {"n": 2, "temperature": 1, "stream": True, "tools": [soak.TOOL]}),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
])
def test_unusual_good_requests_are_answered(server, path, fields):
    response = server.client.post(path, (completion if path == COMPLETIONS else chat)(server, **fields))
    assert response.status == 200, response.text
    assert not [e for e in response.events() if '"error"' in e]


# ---------------------------------------------------------------------------------------------
# soak kind anthropic_bad, and more of /v1/messages


@pytest.mark.parametrize(("fields", "named"), [
    *zip(soak.ANTHROPIC_BAD, ("max_tokens", "messages", "role", "tool_choice"), strict=True),  # None: left out
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "content"),
    ({"max_tokens": -1}, "max_tokens must be positive"),
    ({"system": 5}, "system"),
    ({"temperature": 5}, "temperature"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name is required"),
])
def test_anthropic_bad(server, fields, named):
    body = {k: v for k, v in anthropic(server, **fields).items() if v is not None}
    refused(server.client.post(MESSAGES, body), 400, named)


@pytest.mark.parametrize(("fields", "named"), [
    ({"tools": [{"name": "get_weather", "input_schema": soak.TOOL["function"]["parameters"]}],
      "tool_choice": {"type": "tool", "name": "nope"}}, "'nope' is not found in the tools"),
    ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "tools"),
    ({"tool_choice": {"type": "any"}}, "tools"),
])
def test_anthropic_tool_choice_without_its_tool(server, fields, named):  # patches/api-anthropic-tool-choice.patch
    refused(server.client.post(MESSAGES, anthropic(server, **fields)), 400, named)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}])
def test_anthropic_tool_choice_with_its_tool_runs(server, choice):
    tools = [{"name": "get_weather", "input_schema": soak.TOOL["function"]["parameters"]}]
    response = server.client.post(MESSAGES, anthropic(server, tools=tools, tool_choice=choice))
    assert response.status == 200, response.text


# ---------------------------------------------------------------------------------------------
# good requests that got a server error


@pytest.mark.parametrize("stream", [False, True])
def test_echo_repeats_the_last_message(server, stream):  # patches/api-chat-echo-stream.patch
    messages = [{"role": "user", "content": "Where does the ferry leave?"}, {"role": "assistant", "content": "From"}]
    body = chat(server, messages=messages, echo=True, stream=stream, add_generation_prompt=False,
                continue_final_message=True)
    response = server.client.post(CHAT, body)
    assert response.status == 200, response.text
    if stream:
        events = [json.loads(e) for e in response.events() if e != "[DONE]"]
        assert not [e for e in events if "error" in e], events
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    else:
        text = response.json()["choices"][0]["message"]["content"]
    assert text.startswith("FromThe harbour"), text


# ---------------------------------------------------------------------------------------------
# soak kind disconnect: the client leaves mid-stream, or before a non-streamed answer


def left_early(server, path, body, **leave) -> tuple[str, fake_engine_api.Response]:
    """Send, leave early (`drop_after_chunks` or `leave_after_s`); the request id the engine saw, the response."""
    before = len(server.engine.started)
    with server.slow_tokens():
        response = server.client.post(path, body, **leave)
        server.settle(0.2)
    assert len(server.engine.started) == before + 1
    return server.engine.started[-1], response


@pytest.mark.parametrize(("path", "body"), [(CHAT, chat), (COMPLETIONS, completion), (MESSAGES, anthropic)])
def test_a_disconnect_mid_stream_aborts_the_request(server, path, body):
    request_id, response = left_early(server, path, body(server, stream=True, max_tokens=16), drop_after_chunks=2)
    assert response.status == 200 and len(response.chunks) == 2
    assert request_id in server.engine.aborted and request_id not in server.engine.finished


def test_a_stream_read_to_its_end_is_not_aborted(server):
    server.client.post(CHAT, chat(server, stream=True))
    server.settle()
    assert server.engine.started[-1] in server.engine.finished and server.engine.started[-1] not in server.engine.aborted


@pytest.mark.parametrize(("path", "body"), [(CHAT, chat), (COMPLETIONS, completion), (MESSAGES, anthropic)])
def test_a_disconnect_before_a_non_streamed_answer_aborts_it(server, path, body):
    # 16 tokens 0.02 s apart: the client has left (0.05 s) long before the answer is ready
    request_id, response = left_early(server, path, body(server, max_tokens=16), leave_after_s=0.05)
    assert response.status == 0  # nothing was sent while the client was there
    assert request_id in server.engine.aborted and request_id not in server.engine.finished


@pytest.mark.parametrize("kind", ["disconnect", "cancel", "retry"])
def test_the_soaks_client_side_kinds(server, kind):
    """As bench/soak.py sends them: a stream dropped after a few events, a request given up after 0.05-0.5 s
    (64 tokens 0.02 s apart take longer), and a given-up request sent again; the engine aborts what was left."""
    facts = soak.ServerFacts(server.model, MAX_MODEL_LEN, has_key=True)
    request = soak.Request(0, kind, **soak.KINDS[kind].build(random.Random(4), facts, 16))
    leave = ({"drop_after_chunks": request.events_before_drop} if kind == "disconnect"
             else {"leave_after_s": request.cancel_after_s})
    request_id, response = left_early(server, request.path, request.body, **leave)
    assert request_id in server.engine.aborted and request_id not in server.engine.finished
    if kind == "retry":
        with server.slow_tokens(0):
            again = server.client.post(request.path, request.body)
        assert again.status == 200 and server.engine.started[-1] in server.engine.finished
