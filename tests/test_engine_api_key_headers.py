"""qwen_serving/engine/api_key_headers.py and patches/api-key-x-api-key.patch: vLLM's API key check over an ASGI
call, pristine against patched. The patched middleware also takes the key from x-api-key (Anthropic's header);
everything the pristine one refuses but an x-api-key with the right key stays refused."""

from __future__ import annotations

import asyncio

import pytest

from qwen_serving.engine.api_key_headers import presented_key
from tests.helpers.engine_trees import load

SERVER_UTILS = "entrypoints/serve/utils/server_utils.py"


def status(tree: str, path: str, headers: dict[str, str]) -> int:
    """The HTTP status the tree's AuthenticationMiddleware (key "k") gives one request; 200 when it passes it on."""
    middleware = load(tree, SERVER_UTILS).AuthenticationMiddleware
    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(middleware(app, ["k"])(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


@pytest.mark.parametrize(("headers", "pristine", "patched"), [
    ({"Authorization": "Bearer k"}, 200, 200),
    ({"x-api-key": "k"}, 401, 200),  # Anthropic's SDK: refused upstream
    ({"Authorization": "Bearer k", "x-api-key": "k"}, 200, 200),  # bench/serving.py sends both
    ({"Authorization": "Bearer wrong"}, 401, 401),
    ({"x-api-key": "wrong"}, 401, 401),
    ({"Authorization": "Bearer wrong", "x-api-key": "k"}, 401, 401),  # the bearer token is the one presented
    ({"Authorization": "Basic k", "x-api-key": "k"}, 401, 401),
    ({}, 401, 401),
])
def test_the_key_by_either_header(headers, pristine, patched):
    assert status("pristine", "/v1/messages", headers) == pristine
    assert status("patched", "/v1/messages", headers) == patched


def test_unguarded_routes_stay_open():
    assert status("patched", "/health", {}) == 200 and status("patched", "/metrics", {"x-api-key": "x"}) == 200


def test_presented_key():
    assert presented_key("Bearer k", None) == "k" and presented_key("bearer k", "x") == "k"
    assert presented_key(None, "k") == "k" and presented_key("", "k") == "k"
    assert presented_key("Basic k", "k") is None and presented_key(None, "") is None and presented_key(None, None) is None
