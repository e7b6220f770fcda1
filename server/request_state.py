"""What the middleware and the routes share about one request, named and typed once.

Starlette keeps a request's state in `scope["state"]`. The outermost middleware
(`server.middleware.access`) puts one `RequestState` there under `STATE_KEY` when the request
arrives; every inner layer reads and writes its typed fields through `request_state(scope)`,
never a bare string key.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from server.protocol.openai import Usage
from server.settings.keys_file import Tenant

STATE_KEY = "llm_gateway"
"""The one key the gateway uses in `scope["state"]`."""


Admission = Callable[[int], Awaitable[None]]
"""Reserve this many tokens from the tenant's limits, or raise the 429 (a `GatewayError`) that
refuses the request."""


Turn = Callable[["RequestStats"], AbstractAsyncContextManager[None]]
"""Wait for the request's places in the engine (`RequestStats.sequences`) and hold them while the
context lasts (the tenants' fair queue, auth.fair_share); raises the 504 that ends a wait past
limits.first_token_timeout_s."""


@dataclass(eq=False, slots=True)
class RequestStats:
    """Filled in by serving while a generation request runs; read by the routes (metrics), the
    tenant limits (what to charge) and the access log."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    completed: bool = False
    reserved_tokens: int = 0
    """The most the request may use (`server.tenants.reservation`): set by serving once the
    prompt is tokenized, before the engine sees it."""
    admit: Admission | None = None
    """The tenant limits' decision on `reserved_tokens` (None when the tenant counts no tokens):
    serving awaits it between tokenizing and generating."""
    sequences: int = 1
    """Engine sequences the request runs at once (prompts x n): the places it takes in the engine."""
    turn: Turn | None = None
    """The tenant's turn in a full engine (None without a keys file or with auth.fair_share
    off): serving enters it after admission, before the engine sees the request, and leaves it
    when the request ends."""
    queue_s: float | None = None
    """How long the request waited in its turn for a place in a full engine (None: it did not
    wait): the tenant's usage records it."""

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
        )


@dataclass(eq=False, slots=True)
class RequestState:
    """One request as the gateway's layers see it."""

    started: float
    """`time.monotonic()` when the request arrived: TTFT and the duration count from here."""

    request_id: str
    """`X-Request-ID`: the client's, or one made up; echoed on the response."""

    status: int | None = None
    """The response's status once it started (None before): for layers that count after the app."""

    response_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    """Headers inner layers add to the response's start (a tenant's `x-ratelimit-*`): one send
    wrapper, the access middleware's, instead of one per layer on every streamed chunk."""

    tenant: Tenant | None = None
    """Who sent it (set by the auth middleware)."""

    stats: RequestStats | None = None
    """Tokens and finish reasons of a generation request (set by its route)."""

    completion_id: str | None = None
    """The id of the completion or response object made (`cmpl-...`), for the access log."""

    admission: Admission | None = None
    """Set by the tenant limits when the tenant counts tokens: the route hands it to serving
    (`RequestStats.admit`), which calls it with the exact reservation once the prompt is tokenized."""

    turn: Turn | None = None
    """Set by the tenant limits when the fair queue is on: the route hands it to serving
    (`RequestStats.turn`)."""

    rejection_reason: str | None = None
    """Why a tenant limit refused it (`rate_limit`, `budget`), for `gateway_rejected_requests_total`."""


def request_state(scope: MutableMapping[str, Any]) -> RequestState:
    """The request's state (the access middleware made it)."""
    return scope["state"][STATE_KEY]
