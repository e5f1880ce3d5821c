"""The text `echo: true` repeats on /v1/chat/completions, streamed or not (patches/api-chat-echo-stream.patch).

With echo, vLLM 0.28.0 answers the last message's content (when it has the answer's role) before the new tokens.
The renderer keeps that content as the chat template wants it: for Qwen's template (the "openai" content format)
a list of parts, `[{"type": "text", "text": ...}]`, even when the request sent a string. The non-streamed path
joins the parts' text; the streamed path put the list itself into DeltaMessage.content, a str field, so every
echo stream with such a message ended in an error event ("1 validation error for DeltaMessage", code 400) right
after its first chunk: a server bug inside a 200, not the client's mistake. Both paths now take the text here.
"""

from __future__ import annotations


def echo_text(content: str | list[dict] | None) -> str:
    """The content as text: a string as it is, the text of content parts joined by newlines (as upstream joins
    them for a non-streamed answer); parts without text (an image) add nothing."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if isinstance(part.get("text"), str))
    return content or ""
