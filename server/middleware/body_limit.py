"""413 for request bodies over `limits.max_body_bytes`, by Content-Length or by counting a
chunked body as it is read."""

from __future__ import annotations

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.middleware.asgi import send_error
from server.request_state import request_state


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
                    await send_error(send, 413, message, path=scope["path"])
                    return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge(message)
            return msg

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:  # raised outside FastAPI's handlers (e.g. a streaming read)
            # The access middleware (outermost) notes the status as a response starts; reading it
            # here spares every streamed chunk a send wrapper of this middleware's own.
            if request_state(scope).status is None:
                await send_error(send, 413, message, path=scope["path"])
