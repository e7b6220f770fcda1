"""Pure-ASGI middleware that refuses requests before they reach a route: API keys, body size."""

from __future__ import annotations

import hmac
import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_body


async def send_error(send: Send, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(error_body(message, status)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def _bearer(scope: Scope) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def key_matches(token: bytes, keys: list[bytes]) -> bool:
    """Constant time in the token's content: every key is compared, no early exit."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched


class AuthMiddleware:
    """`Authorization: Bearer <key>` on the API; a separate admin key on /admin/*.

    No API key configured means the API is open. /admin/* takes an admin key; without one it is
    open only while the API is open too, and refused (403) otherwise.
    """

    def __init__(self, app: ASGIApp, api_keys: list[str], admin_keys: list[str], open_paths: list[str]) -> None:
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]
        self.admin_keys = [k.encode() for k in admin_keys]
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path.startswith("/admin"):
            keys = self.admin_keys
            if not keys:
                if self.api_keys:
                    await send_error(send, 403, "Admin routes are disabled: set auth.admin_keys to use them.")
                    return
                await self.app(scope, receive, send)
                return
        elif path in self.open_paths or not self.api_keys:
            await self.app(scope, receive, send)
            return
        else:
            keys = self.api_keys
        token = _bearer(scope)
        if token is None:
            await send_error(send, 401, "Missing API key: send `Authorization: Bearer <key>`.",
                             {"WWW-Authenticate": "Bearer"})
            return
        if not key_matches(token, keys):
            await send_error(send, 401, "Incorrect API key provided.", {"WWW-Authenticate": "Bearer"})
            return
        await self.app(scope, receive, send)


class _BodyTooLarge(HTTPException):
    """An HTTPException so FastAPI's body parsing re-raises it (it turns other errors into 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(status_code=413, detail=message)


class BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length or by counting a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"Request body too large: the limit is {self.max_bytes} bytes."
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False
                if too_large:
                    await send_error(send, 413, message)
                    return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(message)
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:  # raised outside FastAPI's handlers (e.g. a streaming read)
            if not started:
                await send_error(send, 413, message)
