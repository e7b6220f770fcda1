"""Raw ASGI pieces the middleware share: an error response sent before any route ran, a request
header, the whole body read ahead of the app."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from server.errors import GatewayError, error_body_for, gateway_error_body


async def send_error(send: Send, status: int, message: str, headers: dict[str, str] | None = None,
                     *, body: dict[str, Any] | None = None, path: str = "") -> None:
    """A JSON response (by default the error body for `status` and `message` in the dialect of
    the route at `path`: OpenAI's, or Anthropic's on /v1/messages)."""
    payload = json.dumps(body if body is not None else error_body_for(path, message, status)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


async def send_gateway_error(send: Send, error: GatewayError, path: str = "") -> None:
    await send_error(send, error.status, error.message, error.headers, body=gateway_error_body(path, error))


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of a request header (`name` in lower case), or None."""
    for key, value in scope.get("headers", []):
        if key == name:
            return value
    return None


async def buffered_body(receive: Receive) -> tuple[bytes, Receive]:
    """The whole request body, and a receive that hands it to the app again."""
    messages: list[Message] = []
    body = bytearray()
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False):
            messages = [{"type": "http.request", "body": bytes(body), "more_body": False}]
            break

    async def replay() -> Message:
        return messages.pop(0) if messages else await receive()

    return bytes(body), replay
