"""qwen_serving/engine/api_anthropic_tool_choice.py and patches/api-anthropic-tool-choice.patch: vLLM's conversion
of an Anthropic request into a chat completion request, pristine against patched. A tool_choice that forces a tool
call without tools is dropped silently upstream and refused patched; every other tool_choice converts as before.
(tests/test_api_bad_requests.py sends the same requests to vLLM's whole API server.)"""

from __future__ import annotations

import pytest

from qwen_serving.engine.api_anthropic_tool_choice import refusal
from tests.helpers.engine_trees import load

SERVING = "entrypoints/anthropic/serving.py"
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def convert(tree: str, **fields):
    """The ChatCompletionRequest the tree's /v1/messages handler makes of an Anthropic request."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    request = AnthropicMessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields})
    return load(tree, SERVING).AnthropicServingMessages._convert_anthropic_to_openai_request(request)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_forced_tool_call_without_tools(choice):
    from vllm.exceptions import VLLMValidationError

    dropped = convert("pristine", tool_choice=choice)
    assert dropped.tools is None and dropped.tool_choice is not None  # kept, with nothing to call: no call, no error
    with pytest.raises(VLLMValidationError, match="no `tools`") as refused:
        convert("patched", tool_choice=choice)
    assert refused.value.parameter == "tool_choice"
    with pytest.raises(VLLMValidationError):
        convert("patched", tool_choice=choice, tools=[])


@pytest.mark.parametrize(("fields", "tool_choice"), [
    ({"tool_choice": {"type": "any"}, "tools": TOOLS}, "required"),
    ({"tool_choice": {"type": "auto"}}, "auto"),
    ({"tool_choice": {"type": "none"}}, "none"),
    ({"tools": TOOLS}, "auto"),
    ({}, None),
])
def test_every_other_choice_converts_as_upstream(fields, tool_choice):
    pristine, patched = convert("pristine", **fields), convert("patched", **fields)
    assert pristine.tool_choice == patched.tool_choice == tool_choice
    assert pristine.model_dump(exclude={"request_id"}) == patched.model_dump(exclude={"request_id"})


def test_refusal():
    assert "no `tools`" in refusal("any", None) and "no `tools`" in refusal("tool", [])
    assert refusal("any", TOOLS) is None and refusal("auto", None) is None and refusal("none", None) is None
    assert refusal(None, None) is None
