"""The API key a request presents, for vLLM's AuthenticationMiddleware (patches/api-key-x-api-key.patch).

vLLM 0.28.0 reads only `Authorization: Bearer <key>`; Anthropic's SDK (and Claude Code with ANTHROPIC_API_KEY)
sends its key as `x-api-key: <key>` on /v1/messages, and got 401 from a server with the right key. The bearer
token wins when both are sent; a non-Bearer Authorization scheme is no key (as upstream), and then neither is
an x-api-key beside it: one request presents one key.
"""

from __future__ import annotations


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key to compare with the server's, or None when the request presents none."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        return token if scheme.lower() == "bearer" else None
    return x_api_key or None
