"""Replies for the loopback fake servers of the tests (http.server request handlers)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


def send_json(handler: BaseHTTPRequestHandler, obj: object, status: int = 200) -> None:
    """One JSON answer with its length, as vLLM's OpenAI routes send it."""
    data = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
