"""vLLM 0.28.0's `qwen3_coder` tool parser (what `--tool-call-parser qwen3_coder` serves) on recorded
Qwen3-coder XML tool-call text.

Random-weight checkpoints never write this format by themselves, so the GPU smoke test only proves
that the server accepts `tools`; the parsing itself is proven here, through the same entry points the
OpenAI server uses: the tool parser class, and the composed parser's non-streaming `parse` and
streaming `parse_delta`. The tokenizer is the synthetic checkpoints' Qwen-style tokenizer: the
parser looks up the ids of <tool_call>/<think> and the special tokens in it.
"""

from __future__ import annotations

import json

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser import ParserManager
from vllm.tool_parsers import ToolParserManager
from vllm.tool_parsers.abstract_tool_parser import ToolParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "postcode": {"type": "string"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_note",
            "parameters": {
                "type": "object",
                "properties": {"title": {"type": "string"}, "body": {"type": "string"}, "pin": {"type": "number"}},
            },
        },
    },
]

# Recorded in the format Qwen3 coder models emit (one parameter value per tag, wrapped in newlines).
ONE_CALL = (
    "Let me look that up.\n"
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nCopenhagen\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n"
    "<parameter=postcode>\n1050\n</parameter>\n"
    "</function>\n</tool_call>"
)
TWO_CALLS = (
    "I'll check the weather and write it down.\n"
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=write_note>\n"
    "<parameter=title>\nTrip\n</parameter>\n"
    "<parameter=body>\nPack a coat.\nBring <b>boots</b> & an umbrella.\n</parameter>\n"
    "<parameter=pin>\n2.5\n</parameter>\n"
    "</function>\n</tool_call>"
)
TWO_CALLS_EXPECTED = [
    ("get_weather", {"city": "Oslo", "metric": True}),
    ("write_note", {"title": "Trip", "body": "Pack a coat.\nBring <b>boots</b> & an umbrella.", "pin": 2.5}),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from qwen_serving.checkpoint.synth_tokenizer import write_tokenizer

    folder = tmp_path_factory.mktemp("qwen-tokenizer")
    write_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def make_request(tool_choice: str = "auto") -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, tool_choice=tool_choice
    )


def calls_of(function_calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in function_calls]


def test_qwen3_coder_is_the_qwen3_engine_parser(tokenizer):
    parser_cls = ToolParserManager.get_tool_parser("qwen3_coder")
    assert issubclass(parser_cls, ToolParser)
    parser = parser_cls(tokenizer, make_request().tools)
    # the parser keys on the ids of Qwen's markup tokens: they must be single tokens of this vocabulary
    for tag in ("<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert [parser.vocab[tag]] == tokenizer.encode(tag, add_special_tokens=False)


def test_one_call_with_content_before_it(tokenizer):
    request = make_request()
    parser = ToolParserManager.get_tool_parser("qwen3_coder")(tokenizer, request.tools)
    info = parser.extract_tool_calls(ONE_CALL, request)
    assert info.tools_called
    assert info.content == "Let me look that up."
    (call,) = info.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    # typed by the declared schema: integer -> 3; a string parameter keeps its digits as text
    assert json.loads(call.function.arguments) == {"city": "Copenhagen", "days": 3, "postcode": "1050"}


def test_two_calls_typed_parameters_and_multiline_value(tokenizer):
    request = make_request()
    parser = ToolParserManager.get_tool_parser("qwen3_coder")(tokenizer, request.tools)
    info = parser.extract_tool_calls(TWO_CALLS, request)
    assert info.tools_called
    assert info.content == "I'll check the weather and write it down."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == TWO_CALLS_EXPECTED
    assert len({c.id for c in info.tool_calls}) == 2


def test_text_without_a_call_is_plain_content(tokenizer):
    request = make_request()
    parser = ToolParserManager.get_tool_parser("qwen3_coder")(tokenizer, request.tools)
    text = "It is sunny in Copenhagen; no function needed."
    info = parser.extract_tool_calls(text, request)
    assert not info.tools_called
    assert info.tool_calls == []
    assert info.content == text


def server_parser(tokenizer, request):
    """The parser object the chat server builds per request for `--enable-auto-tool-choice --tool-call-parser qwen3_coder`."""
    parser_cls = ParserManager.get_parser(tool_parser_name="qwen3_coder", enable_auto_tools=True, model_name="tiny")
    assert parser_cls is not None
    return parser_cls(tokenizer, request.tools, chat_template_kwargs={}, model_config=None)


def test_server_parse_non_streaming(tokenizer):
    request = make_request()
    token_ids = tokenizer.encode(TWO_CALLS, add_special_tokens=False)
    reasoning, content, calls = server_parser(tokenizer, request).parse(
        TWO_CALLS, request, enable_auto_tools=True, model_output_token_ids=token_ids
    )
    assert reasoning is None
    assert content == "I'll check the weather and write it down."
    assert calls_of(calls) == TWO_CALLS_EXPECTED


def test_server_parse_tool_choice_none_returns_no_calls(tokenizer):
    request = make_request(tool_choice="none")
    token_ids = tokenizer.encode(ONE_CALL, add_special_tokens=False)
    _, _, calls = server_parser(tokenizer, request).parse(
        ONE_CALL, request, enable_auto_tools=True, model_output_token_ids=token_ids
    )
    assert not calls


def test_server_streaming_token_by_token_matches_non_streaming(tokenizer):
    """Decode one token at a time, as the detokenizer feeds `parse_delta`, and rebuild the calls from the deltas."""
    request = make_request()
    parser = server_parser(tokenizer, request)
    token_ids = tokenizer.encode(TWO_CALLS, add_special_tokens=False)
    prompt_ids = tokenizer.encode("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    content = ""
    calls: dict[int, dict] = {}
    previous = ""
    for i, token_id in enumerate(token_ids):
        current = tokenizer.decode(token_ids[: i + 1], skip_special_tokens=False)
        delta_text, previous = current[len(previous) :], current
        delta = parser.parse_delta(
            delta_text, [token_id], request, prompt_token_ids=prompt_ids, finished=i == len(token_ids) - 1
        )
        if delta is None:
            continue
        content += delta.content or ""
        for tool_delta in delta.tool_calls or []:
            call = calls.setdefault(tool_delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or tool_delta.id
            if tool_delta.function is not None:
                call["name"] += tool_delta.function.name or ""
                call["arguments"] += tool_delta.function.arguments or ""
    assert content.strip() == "I'll check the weather and write it down."
    assert sorted(calls) == [0, 1]
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in (0, 1)] == TWO_CALLS_EXPECTED
    assert all(calls[i]["id"] for i in (0, 1))
