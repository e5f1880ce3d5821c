"""qwen_serving/engine/api_tool_enum_args.py and patches/api-tool-enum-args.patch: a forced qwen3_coder tool call
whose enum value came with whitespace around it (what the grammar allows; measured on the H200 with the synthetic
model) answers the member, through vLLM's own parser, streamed and not. vLLM's pristine coercion, beside it, keeps
the whitespace. Numbers, booleans and free strings convert as upstream."""

from __future__ import annotations

import json

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser import ParserManager

from qwen_serving.engine.api_tool_enum_args import as_member, string_members
from tests.helpers.engine_trees import load

CITY = {"enum": ["Copenhagen", "Aarhus"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"],
                   "additionalProperties": False}}}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
# the two values the H200 answered, as the model wrote them between Qwen's newlines
H200_VALUES = {"Copenhagen\r       \n  \r   ": "Copenhagen", "         Aarhus  ": "Aarhus"}
REPORT = {"type": "object", "properties": {
    "city": CITY, "unit": {"const": "celsius"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "note": {"type": "string"}, "tags": {"type": "array", "items": CITY}}}


def call_text(params: dict[str, str], name: str = "get_weather") -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from qwen_serving.checkpoint.synth_tokenizer import write_tokenizer

    folder = tmp_path_factory.mktemp("qwen-tokenizer")
    write_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def request_for(tools) -> ChatCompletionRequest:
    name = tools[0]["function"]["name"]
    return ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                                 tool_choice={"type": "function", "function": {"name": name}})


def server_parser(tokenizer, request):
    """The parser the chat server builds per request for `--enable-auto-tool-choice --tool-call-parser qwen3_coder`."""
    parser_cls = ParserManager.get_parser(tool_parser_name="qwen3_coder", enable_auto_tools=True, model_name="tiny")
    return parser_cls(tokenizer, request.tools, chat_template_kwargs={}, model_config=None)


def parsed(tokenizer, text: str, tools=TOOLS) -> list[tuple[str, str]]:
    request = request_for(tools)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    _, _, calls = server_parser(tokenizer, request).parse(
        text, request, enable_auto_tools=True, model_output_token_ids=token_ids)
    return [(call.name, call.arguments) for call in calls]


def streamed(tokenizer, text: str, tools=TOOLS) -> list[tuple[str, str]]:
    """One token at a time, as the detokenizer feeds `parse_delta`; each call's name and argument deltas joined."""
    request = request_for(tools)
    parser = server_parser(tokenizer, request)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    prompt_ids = tokenizer.encode("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    calls: dict[int, list[str]] = {}
    previous = ""
    for i, token_id in enumerate(token_ids):
        current = tokenizer.decode(token_ids[: i + 1], skip_special_tokens=False)
        delta_text, previous = current[len(previous):], current
        delta = parser.parse_delta(delta_text, [token_id], request, prompt_token_ids=prompt_ids,
                                   finished=i == len(token_ids) - 1)
        for tool_delta in (delta.tool_calls or []) if delta is not None else []:
            name, arguments = calls.setdefault(tool_delta.index, ["", ""])
            if tool_delta.function is not None:
                calls[tool_delta.index] = [name + (tool_delta.function.name or ""),
                                           arguments + (tool_delta.function.arguments or "")]
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize(("written", "member"), H200_VALUES.items())
def test_the_h200_enum_values_parse_as_their_member(tokenizer, written, member):
    text = call_text({"city": written})
    assert parsed(tokenizer, text) == [("get_weather", json.dumps({"city": member}))]
    (call,) = streamed(tokenizer, text)
    assert call[0] == "get_weather" and json.loads(call[1]) == {"city": member}


@pytest.mark.parametrize(("written", "member"), H200_VALUES.items())
def test_pristine_coercion_keeps_the_whitespace(written, member):
    pristine = load("pristine", "parser/engine/parser_engine.py").ParserEngine
    patched = load("patched", "parser/engine/parser_engine.py").ParserEngine
    assert pristine._coerce_value(written, CITY) == (written, False)
    assert patched._coerce_value(written, CITY) == (member, True)


def test_a_whole_call_of_every_type(tokenizer):
    tools = [{"type": "function", "function": {"name": "report", "parameters": REPORT}}]
    text = call_text({"city": "\t Aarhus \r", "unit": "  celsius\n", "days": " 3 \r\n ", "temp": "\n -2.5  ",
                      "metric": "   true \t", "note": "  two spaces kept  ", "tags": ' ["Aarhus"] '}, "report")
    expected = {"city": "Aarhus", "unit": "celsius", "days": 3, "temp": -2.5, "metric": True,
                "note": "  two spaces kept  ", "tags": ["Aarhus"]}
    ((name, arguments),) = parsed(tokenizer, text, tools)
    assert name == "report" and json.loads(arguments) == expected
    ((name, arguments),) = streamed(tokenizer, text, tools)
    assert name == "report" and json.loads(arguments) == expected


def test_a_value_that_is_no_member_is_left_as_written(tokenizer):
    text = call_text({"city": " Odense "})
    assert parsed(tokenizer, text) == [("get_weather", json.dumps({"city": " Odense "}))]
    ((_, arguments),) = streamed(tokenizer, text)
    assert json.loads(arguments) == {"city": " Odense "}


def test_free_strings_stream_before_their_value_closes_enum_values_once_closed():
    patched = load("patched", "parser/engine/parser_engine.py").ParserEngine
    keys = patched._streamable_string_keys(
        {"note": {"type": "string"}, "city": CITY, "unit": {"const": "celsius"}, "typed": {"type": "string", **CITY},
         "days": {"type": "integer"}, "odd": "not a schema"})
    assert keys == {"note", "odd"}


@pytest.mark.parametrize(("value", "schema", "member"), [
    ("Copenhagen\r       \n  \r   ", CITY, "Copenhagen"),
    ("         Aarhus  ", CITY, "Aarhus"),
    ("Aarhus", CITY, "Aarhus"),
    (" Aarhus", {"type": "string", "enum": ["Aarhus", " Aarhus"]}, " Aarhus"),  # a member's own whitespace stays
    ("\n celsius ", {"const": "celsius"}, "celsius"),
    (" 1 ", {"enum": ["1", 2]}, "1"),  # upstream's integer-first coercion made this 1, which the enum lacks
    (" Odense ", CITY, None),
    ("Aar hus", CITY, None),
    (" 2 ", {"enum": ["1", 2]}, None),  # not a string member: vLLM's coercion makes it 2
    (" true ", {"type": "boolean"}, None),
    (" 3 ", {"type": "integer"}, None),
    ("  free text  ", {"type": "string"}, None),
])
def test_as_member(value, schema, member):
    assert as_member(value, schema) == member


def test_string_members():
    assert string_members(CITY) == ["Copenhagen", "Aarhus"]
    assert string_members({"const": "x"}) == ["x"] and string_members({"const": 5}) == []
    assert string_members({"enum": ["a", 1, None, True]}) == ["a"]
    assert string_members({"type": "string"}) == [] and string_members("string") == []
