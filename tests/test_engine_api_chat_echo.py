"""qwen_serving/engine/api_chat_echo.py (patches/api-chat-echo-stream.patch): the text an echo repeats. The whole
server, streamed and not, is in tests/test_api_bad_requests.py (test_echo_repeats_the_last_message)."""

from __future__ import annotations

from qwen_serving.engine.api_chat_echo import echo_text


def test_echo_text():
    assert echo_text("From") == "From" and echo_text(None) == "" and echo_text("") == ""
    assert echo_text([{"type": "text", "text": "From"}]) == "From"
    assert echo_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"  # as upstream joins
    assert echo_text([{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "a"}]) == "a"
    assert echo_text([]) == ""
