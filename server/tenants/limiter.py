"""The rate limiter: one small Protocol, and the in-memory implementation (one instance's view).

Every limit is a bucket the size of its per-minute limit, refilled continuously (limit / 60 per
second) and starting full: `requests_per_minute` takes 1 per request, `tokens_per_minute` takes
the request's reservation (`server.tenants.reservation`) at admission and gets back what the
request did not use when it ends. The monthly token quota is a counter of the same reservations
and settlements, per calendar month (UTC). A refused request takes nothing.

`server.tenants.redis_limiter` keeps the same state in Redis, shared by every instance.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol

from server.tenants.keys import Tenant

# Why a request was refused (Decision.reason).
REQUESTS = "requests"
TOKENS = "tokens"
QUOTA = "quota"
REASONS = (REQUESTS, TOKENS, QUOTA)


@dataclass(frozen=True)
class Bucket:
    """A per-minute limit's state after a decision, for the x-ratelimit-* headers."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again


@dataclass
class Decision:
    """A limiter's answer; when allowed, also the ticket `settle` takes back."""

    tenant: Tenant
    reserved: int
    allowed: bool
    reason: str | None = None  # REQUESTS, TOKENS or QUOTA when refused
    retry_after_s: float = 0.0
    never: bool = False  # the request alone exceeds the limit: retrying cannot help
    requests: Bucket | None = None
    tokens: Bucket | None = None
    quota_used: int | None = None  # tokens counted against the month, this request included
    period: str = ""
    backend: str = "memory"
    degraded: bool = False  # decided in memory because Redis failed
    settled: bool = field(default=False, repr=False)


class RateLimiter(Protocol):
    """What the middleware asks. Implementations: MemoryRateLimiter, RedisRateLimiter."""

    backend: str

    async def acquire(self, tenant: Tenant, tokens: int) -> Decision:
        """Admit one request reserving `tokens`, or refuse it without taking anything."""

    async def settle(self, decision: Decision, used_tokens: int) -> int | None:
        """Replace an admitted request's reservation by what it used; the quota used after it."""

    async def seed_quota(self, tenant: str, period: str, used: int) -> None:
        """Start a month's quota counter from the usage store, unless it is already counting."""

    async def close(self) -> None: ...


def period_of(now: float) -> str:
    """The quota period (calendar month, UTC) `now` falls in, e.g. "2026-12"."""
    return _period_of_minute(int(now // 60))


@functools.lru_cache(maxsize=4)
def _period_of_minute(minute: int) -> str:
    # Asked on every request; a month starts on a whole minute, so one answer serves a minute.
    return datetime.fromtimestamp(minute * 60, timezone.utc).strftime("%Y-%m")


def seconds_to_next_period(now: float) -> float:
    moment = datetime.fromtimestamp(now, timezone.utc)
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    return datetime(year, month, 1, tzinfo=timezone.utc).timestamp() - now


def refilled(level: float, since_s: float, limit: int) -> float:
    return min(float(limit), level + max(since_s, 0.0) * limit / 60.0)


def seconds_until(level: float, need: float, limit: int) -> float:
    return max(need - level, 0.0) * 60.0 / limit


def bucket_view(level: float, limit: int) -> Bucket:
    return Bucket(limit, max(math.floor(level), 0), seconds_until(level, limit, limit))


def refusal(tenant: Tenant, tokens: int, *, quota_used: int | None, now: float,
            request_wait: float | None, token_wait: float | None) -> tuple[str, float, bool] | None:
    """(reason, retry after, never) when the request cannot be admitted now, else None.

    The quota is checked first: a spent budget is the answer that matters (retrying soon cannot
    help). `request_wait` / `token_wait` are the seconds until the buckets hold enough (None: no
    such limit)."""
    limits = tenant.limits
    if limits.monthly_tokens is not None and quota_used is not None and quota_used + tokens > limits.monthly_tokens:
        return QUOTA, seconds_to_next_period(now), tokens > limits.monthly_tokens
    if limits.tokens_per_minute is not None and tokens > limits.tokens_per_minute:
        return TOKENS, 0.0, True
    request_wait, token_wait = request_wait or 0.0, token_wait or 0.0
    if request_wait > 0 or token_wait > 0:
        return (REQUESTS, request_wait, False) if request_wait >= token_wait else (TOKENS, token_wait, False)
    return None


class MemoryRateLimiter:
    """Buckets and quota counters in this process (asyncio: each call runs without interruption)."""

    backend = "memory"

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._levels: dict[tuple[str, str], tuple[float, float]] = {}  # (tenant, kind) -> (level, at)
        self._quota: dict[tuple[str, str], int] = {}  # (tenant, period) -> tokens

    def _level(self, tenant: str, kind: str, limit: int, now: float) -> float:
        level, at = self._levels.get((tenant, kind), (float(limit), now))
        return refilled(level, now - at, limit)

    async def acquire(self, tenant: Tenant, tokens: int) -> Decision:
        now = self.clock()
        limits, name = tenant.limits, tenant.name
        period = period_of(now)
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        req_level = self._level(name, REQUESTS, rpm, now) if rpm else None
        tok_level = self._level(name, TOKENS, tpm, now) if tpm else None
        quota_used = self._quota.get((name, period), 0) if limits.monthly_tokens else None
        refused = refusal(
            tenant, tokens, quota_used=quota_used, now=now,
            request_wait=seconds_until(req_level, 1, rpm) if rpm else None,
            token_wait=seconds_until(tok_level, tokens, tpm) if tpm else None)
        decision = Decision(tenant, tokens, allowed=refused is None, period=period, quota_used=quota_used)
        if refused is None:
            if rpm:
                req_level -= 1
                self._levels[(name, REQUESTS)] = (req_level, now)
            if tpm:
                tok_level -= tokens
                self._levels[(name, TOKENS)] = (tok_level, now)
            if quota_used is not None:
                decision.quota_used = self._quota[(name, period)] = quota_used + tokens
        else:
            decision.reason, decision.retry_after_s, decision.never = refused
        decision.requests = bucket_view(req_level, rpm) if rpm else None
        decision.tokens = bucket_view(tok_level, tpm) if tpm else None
        return decision

    async def settle(self, decision: Decision, used_tokens: int) -> int | None:
        name, limits = decision.tenant.name, decision.tenant.limits
        give_back = decision.reserved - used_tokens
        if limits.tokens_per_minute:
            now = self.clock()
            level = self._level(name, TOKENS, limits.tokens_per_minute, now)
            self._levels[(name, TOKENS)] = (min(level + give_back, float(limits.tokens_per_minute)), now)
        if limits.monthly_tokens:
            key = (name, decision.period)
            self._quota[key] = self._quota.get(key, 0) - give_back
            return self._quota[key]
        return None

    async def seed_quota(self, tenant: str, period: str, used: int) -> None:
        self._quota.setdefault((tenant, period), used)

    async def close(self) -> None:
        pass
