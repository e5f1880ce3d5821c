"""Anthropic /v1/messages: a tool_choice that forces a tool call needs tools
(patches/api-anthropic-tool-choice.patch).

vLLM 0.28.0 converts an Anthropic request into a ChatCompletionRequest by setting its fields one by one after the
model is built, so the OpenAI route's own check (`tool_choice` needs `tools`, ChatCompletionRequest's validator)
never runs on it: `tool_choice: {"type": "any"}` or `{"type": "tool", "name": ...}` without `tools` answered 200 with
no tool call and no word that the choice was dropped. The same request on /v1/chat/completions is a 400; so it is
here now. `auto` and `none` without tools ask for nothing that cannot happen and pass as before.
"""

from __future__ import annotations

FORCING = ("any", "tool")  # the Anthropic tool_choice types that ask for a tool call


def refusal(tool_choice_type: str | None, tools: list | None) -> str | None:
    """Why the request is refused (for a 400 on `tool_choice`), or None when it is fine."""
    if tool_choice_type in FORCING and not tools:
        return (f'tool_choice {{"type": "{tool_choice_type}"}} asks for a tool call, but the request has no `tools`: '
                "send the tools, or leave tool_choice out")
    return None
