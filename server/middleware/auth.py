"""API keys: `Authorization: Bearer <key>` (or `x-api-key: <key>`) on the API names the request's
tenant; a separate admin key guards /admin/*."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from server.middleware.asgi import header, send_error
from server.request_state import request_state
from server.tenants.service import Tenancy


def _bearer(scope: Scope) -> bytes | None:
    """The key of `Authorization: Bearer <key>`, else of `x-api-key: <key>` (how the anthropic
    SDK and Anthropic-API clients send it)."""
    value = header(scope, b"authorization")
    if value is not None:
        scheme, _, token = value.partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            return token.strip()
    value = header(scope, b"x-api-key")
    return value.strip() if value is not None and value.strip() else None


def key_matches(token: bytes, keys: list[bytes]) -> bool:
    """Constant time in the token's content: every key is compared, no early exit."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched


class AuthMiddleware:
    """`Authorization: Bearer <key>` or `x-api-key: <key>` on the API, naming the request's tenant;
    a separate admin key on /admin/*. Refusals are in the dialect of the route asked for.

    No API key configured (no keys file, no `auth.api_keys`) means the API is open and every
    request is tenant `unnamed`. /admin/* takes an admin key; without one it is open only while
    the API is open too, and refused (403) otherwise.
    """

    def __init__(self, app: ASGIApp, tenancy: Tenancy, admin_keys: list[str], open_paths: list[str]) -> None:
        self.app = app
        self.tenancy = tenancy
        self.admin_keys = [k.encode() for k in admin_keys]
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        directory = self.tenancy.directory  # read once: a keys-file reload swaps it whole
        if path.startswith("/admin"):
            if not self.admin_keys:
                if not directory.open:
                    await send_error(send, 403, "Admin routes are disabled: set auth.admin_keys to use them.")
                    return
                await self.app(scope, receive, send)
                return
            token = await self._bearer_or_401(scope, send)
            if token is None:
                return
            if not key_matches(token, self.admin_keys):
                await send_error(send, 401, "Incorrect API key provided.", {"WWW-Authenticate": "Bearer"})
                return
            await self.app(scope, receive, send)
            return
        if path in self.open_paths or directory.open:
            request_state(scope).tenant = directory.unnamed
            await self.app(scope, receive, send)
            return
        token = await self._bearer_or_401(scope, send)
        if token is None:
            return
        tenant = directory.lookup(token)
        if tenant is None:
            await send_error(send, 401, "Incorrect API key provided.", {"WWW-Authenticate": "Bearer"}, path=path)
            return
        request_state(scope).tenant = tenant
        await self.app(scope, receive, send)

    @staticmethod
    async def _bearer_or_401(scope: Scope, send: Send) -> bytes | None:
        token = _bearer(scope)
        if token is None:
            await send_error(send, 401, "Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.",
                             {"WWW-Authenticate": "Bearer"}, path=scope["path"])
        return token
