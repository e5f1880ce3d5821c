"""GPU smoke tests (issue 3): the patched engine served on a real GPU with synthetic checkpoints.

Server fixtures (conftest.py) start each configuration once; tests run in file order, so server A's
tests run while B and C are still starting. Numbers worth keeping go to gpu-smoke-h200.json.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
import time

import pytest
import smoke_lib as lib

from bench import serving

pytestmark = pytest.mark.gpu

CHAT_TOKENS = 16
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
GREEDY_PROMPTS = [
    "The history of the city begins",
    "def fibonacci(n):",
    "Ingredients: flour, sugar, eggs,",
    "In 1969 the first",
    "Q: What is the capital of Denmark?\nA:",
]
GREEDY_TOKENS = 128
BENCH_RESULT = "bench-serve-tiny-mtp.json"
METRICS_PAGE = "metrics-tiny-mtp.txt"


def chat_payload(server: lib.SmokeServer, **extra) -> dict:
    return {
        "model": server.spec.served_name,
        "messages": [{"role": "user", "content": "Say hello and tell me about the weather."}],
        "max_tokens": CHAT_TOKENS,
        "temperature": 0,
        "ignore_eos": True,  # exactly CHAT_TOKENS tokens: random weights may pick EOS at once
        "return_token_ids": True,
        **extra,
    }


def chat(server: lib.SmokeServer, **extra) -> dict:
    return serving.post_json(server.url + "/v1/chat/completions", chat_payload(server, **extra))


def assert_assistant_choice(response: dict) -> dict:
    assert response["object"] == "chat.completion"
    (choice,) = response["choices"]
    message = choice["message"]
    assert message["role"] == "assistant"
    assert message["content"] is None or isinstance(message["content"], str)
    tool_calls = message.get("tool_calls") or []
    for call in tool_calls:  # random weights rarely write a complete call; if they do it must be well-formed
        assert call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    assert choice["finish_reason"] == ("tool_calls" if tool_calls else "length")
    assert response["usage"]["completion_tokens"] == CHAT_TOKENS
    assert len(choice["token_ids"]) == CHAT_TOKENS
    return choice


# ------------------------------------------------------------------------------------------------
# (a) server A answers chat, streaming chat, and a request carrying tools


def test_chat_completion_answers(server_a):
    assert_assistant_choice(chat(server_a))


def test_streaming_chat_completion_matches_non_streaming(server_a):
    # distinct cache salts: the second request must not reuse the first one's cached prefill
    expected = assert_assistant_choice(chat(server_a, cache_salt="plain"))["token_ids"]
    *events, last = [data for _, data in serving.post_events(
        server_a.url + "/v1/chat/completions",
        chat_payload(server_a, stream=True, stream_options={"include_usage": True}, cache_salt="stream"),
    )]
    assert last == serving.SSE_DONE, "stream ended without 'data: [DONE]'"
    assert all(event["object"] == "chat.completion.chunk" for event in events)
    choices = [choice for event in events for choice in event["choices"]]
    assert choices[0]["delta"].get("role") == "assistant"
    streamed_ids = [token for choice in choices for token in (choice.get("token_ids") or [])]
    assert streamed_ids == expected, "greedy streaming must produce the non-streaming tokens"
    assert [c["finish_reason"] for c in choices if c.get("finish_reason")] in (["length"], ["tool_calls"])
    assert events[-1]["usage"]["completion_tokens"] == CHAT_TOKENS
    assert len(choices) >= 2, "a stream of one chunk is not streaming"


def test_chat_request_with_tools_is_accepted(server_a):
    plain = chat(server_a)
    with_tools = chat(server_a, tools=[WEATHER_TOOL], tool_choice="auto")
    assert_assistant_choice(with_tools)
    # the chat template rendered the tool declaration into the prompt
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


# ------------------------------------------------------------------------------------------------
# (d) prefix caching: a repeated long prompt hits the cache and answers the same


def long_prompt_ids(server: lib.SmokeServer, length: int) -> list[int]:
    rng = random.Random(20261129)
    words = ["river", "stone", "market", "lantern", "copper", "meadow", "harbor", "violet", "engine", "thunder",
             "orchard", "pepper", "signal", "canyon", "velvet", "glacier", "puzzle", "saddle", "ember", "quartz"]
    text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(2 * length))
    tokens = serving.post_json(
        server.url + "/tokenize", {"model": server.spec.served_name, "prompt": text, "add_special_tokens": False}
    )["tokens"]
    assert len(tokens) >= length, f"tokenizer gave {len(tokens)} tokens, need {length}"
    return tokens[:length]


def read_counter(server: lib.SmokeServer, name: str) -> float:
    return serving.counter_total(serving.get_text(server.url + "/metrics"), name)


def test_prefix_cache_hits_on_repeated_long_prompt(server_a, smoke_record):
    length = min(3000, server_a.spec.max_model_len - 64)
    payload = {
        "model": server_a.spec.served_name,
        "prompt": long_prompt_ids(server_a, length),
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": lib.TIE_TOP_K,  # raw logits of the top tokens: a difference must be a measured near-tie
        "return_tokens_as_token_ids": True,
    }
    hits_before = read_counter(server_a, "vllm:prefix_cache_hits")
    first = serving.post_json(server_a.url + "/v1/completions", payload)
    second = serving.post_json(server_a.url + "/v1/completions", payload)
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for r in (first, second)]
    # counters are updated by the stats loop after the response; give it a moment
    deadline = time.monotonic() + 15
    while (hits := read_counter(server_a, "vllm:prefix_cache_hits") - hits_before) < cached[1]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    # the cached prefill computes the prompt's tail on another path: hold it to the near-tie rule
    comparison = lib.compare_greedy(
        [lib.trace_from_choice(first["choices"][0])], [lib.trace_from_choice(second["choices"][0])]
    )
    smoke_record["measurements"]["prefix_cache"] = {
        "prompt_tokens": first["usage"]["prompt_tokens"],
        "cached_tokens_first": cached[0],
        "cached_tokens_second": cached[1],
        "metrics_hits_delta": hits,
        "second_vs_first": comparison.summary(),
    }
    assert first["usage"]["prompt_tokens"] == length
    assert cached[0] == 0, "a never-seen prompt cannot hit the cache"
    assert cached[1] > 0, "the repeated prompt did not hit the prefix cache"
    assert hits >= cached[1], f"/metrics prefix_cache_hits grew by {hits}, the response reported {cached[1]}"
    assert not comparison.unexplained, f"the cached prefill changed the answer: {comparison.summary()}"


# ------------------------------------------------------------------------------------------------
# (b) greedy MTP (server A) is token-identical to no speculation (server B), up to measured near-ties


def greedy_traces(server: lib.SmokeServer) -> list[lib.GreedyTrace]:
    response = serving.post_json(
        server.url + "/v1/completions",
        {
            "model": server.spec.served_name,
            "prompt": GREEDY_PROMPTS,
            "max_tokens": GREEDY_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": lib.TIE_TOP_K,  # raw logits of the top tokens (the servers run --logprobs-mode raw_logits)
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
    )
    choices = sorted(response["choices"], key=lambda c: c["index"])
    assert len(choices) == len(GREEDY_PROMPTS)
    traces = [lib.trace_from_choice(c) for c in choices]
    assert all(len(t.token_ids) == GREEDY_TOKENS for t in traces)
    return traces


def test_mtp_greedy_matches_no_speculation(server_a, server_b, smoke_record):
    drafted_before = read_counter(server_a, "vllm:spec_decode_num_draft_tokens")
    accepted_before = read_counter(server_a, "vllm:spec_decode_num_accepted_tokens")
    with_mtp = greedy_traces(server_a)
    without = greedy_traces(server_b)
    time.sleep(2)  # let the stats loop publish the last step
    drafted = read_counter(server_a, "vllm:spec_decode_num_draft_tokens") - drafted_before
    accepted = read_counter(server_a, "vllm:spec_decode_num_accepted_tokens") - accepted_before
    comparison = lib.compare_greedy(with_mtp, without)
    smoke_record["measurements"]["mtp_vs_plain"] = {
        **comparison.summary(),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
    }
    assert drafted > 0, "server A proposed no MTP drafts: speculation did not run"
    assert not comparison.unexplained, "greedy outputs differ beyond a near-tie:\n" + "\n".join(
        f"prompt {d.prompt} position {d.position}: A={d.token_a} B={d.token_b}: {d.reason}"
        for d in comparison.unexplained
    )


# ------------------------------------------------------------------------------------------------
# Fixtures for the bench harness, recorded against server A (committed under bench/fixtures/)


def test_record_bench_fixtures(server_a, results_dir, work_dir):
    scratch = work_dir / "bench-serve"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    argv = lib.bench_serve_argv(
        server_a.url, server_a.spec.served_name, server_a.spec.model_dir, scratch, BENCH_RESULT, sys.executable
    )
    done = subprocess.run(argv, env=server_a.env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads((scratch / BENCH_RESULT).read_text())
    assert result["completed"] == 16, f"bench completed {result.get('completed')} of 16 requests"
    shutil.copyfile(scratch / BENCH_RESULT, results_dir / BENCH_RESULT)
    # the page after the bench (and, in a full run, after every test above) for the harness's parser
    page = serving.get_text(server_a.url + "/metrics")
    serving.counter_total(page, "vllm:prefix_cache_hits")  # KeyError if the counter is not exported
    serving.counter_total(page, "vllm:prefix_cache_queries")
    for name in ("vllm:spec_decode_num_draft_tokens", "vllm:generation_tokens"):
        assert serving.counter_total(page, name) > 0, f"{name} is 0 after the bench traffic"
    tmp = results_dir / (METRICS_PAGE + ".tmp")
    tmp.write_text(page)
    tmp.replace(results_dir / METRICS_PAGE)


# ------------------------------------------------------------------------------------------------
# (c) the shape checkpoint loads with Marlin forced and decodes finite logits


def test_shape_checkpoint_selects_marlin(server_c):
    kernels = set(lib.WNA16_KERNEL_RE.findall(server_c.log_text()))
    assert kernels == {"MarlinLinearKernel"}, f"W4A16 kernels in the log: {sorted(kernels) or 'none'}"


def test_shape_checkpoint_decodes_finite_logits(server_c, smoke_record):
    response = serving.post_json(
        server_c.url + "/v1/completions",
        {
            "model": server_c.spec.served_name,
            "prompt": ["The capital of Denmark is", "def add(a, b):\n    return"],
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
        },
    )
    spreads = []
    for choice in response["choices"]:
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == 16
        values = [v for top in logprobs["top_logprobs"] for v in top.values()] + logprobs["token_logprobs"]
        # vLLM reports -inf as -9999.0; NaN or inf logits make either a non-finite value or a failed response
        bad = [v for v in values if not math.isfinite(v) or v <= -9999.0]
        assert not bad, f"non-finite logprobs: {bad[:5]}"
        spreads += [max(top.values()) - min(top.values()) for top in logprobs["top_logprobs"]]
    smoke_record["measurements"]["shape_marlin_top5_spread_max"] = max(spreads)
    assert max(spreads) > 1e-3, "every top-5 is flat: the quantized layers produce a constant output"
