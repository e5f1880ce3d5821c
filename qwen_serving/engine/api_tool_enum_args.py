"""Tool-call arguments: a string `enum`/`const` value loses the whitespace around it
(patches/api-tool-enum-args.patch).

The forced/required tool-call grammar vLLM 0.28.0 builds for `qwen3_coder` (xgrammar's structural tag "qwen_3_coder",
JSON schema style "qwen_xml") allows any run of `[ \\n\\r\\t]` on both sides of an enum, const, number or boolean
parameter value, and vLLM's Qwen3 argument converter strips only one newline each side (Qwen's markup). Numbers and
booleans survive that, as `int`, `float` and the boolean check strip whitespace themselves; an enum member did not:
`<parameter=city>\\n   Aarhus  \\n</parameter>` became `{"city": "   Aarhus  "}`, which the tool's own schema
refuses. A free string keeps its text: the grammar adds no whitespace around it, and what the model wrote there
may be meant.
"""

from __future__ import annotations


def string_members(schema: object) -> list[str]:
    """The string values the schema's own `enum` or `const` allows (empty when it names none)."""
    if not isinstance(schema, dict):  # vLLM passes a property's schema on as the tools sent it
        return []
    members = schema.get("enum")
    if not isinstance(members, list):
        members = [schema["const"]] if "const" in schema else []
    return [member for member in members if isinstance(member, str)]


def as_member(value: str, schema: dict) -> str | None:
    """The schema's string member `value` is, whitespace around it aside; None when it is none of them."""
    members = string_members(schema)
    if value in members:  # a member that has whitespace of its own keeps it
        return value
    stripped = value.strip()
    return stripped if stripped in members else None
