"""`Tenancy`: one gateway's keys directory, rate limiter and usage store, and their background work
(writing usage, watching the keys file). The middleware is its only caller on the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from server.settings import Settings, TenantSettings
from server.tenants.keys import KeyDirectory, Tenant, load_directory
from server.tenants.limiter import Decision, MemoryRateLimiter, RateLimiter, period_of
from server.tenants.redis_limiter import RedisRateLimiter
from server.tenants.usage import UsageRow, UsageStore

logger = logging.getLogger("llm_gateway.tenants")


def make_limiter(settings: TenantSettings, clock: Callable[[], float] = time.time) -> RateLimiter:
    if settings.limiter == "redis":
        assert settings.redis_url  # Settings refuses redis without a URL
        return RedisRateLimiter(settings.redis_url, prefix=settings.redis_key_prefix,
                                timeout_s=settings.redis_timeout_s, retry_s=settings.redis_retry_s,
                                on_error=settings.on_redis_error, clock=clock)
    return MemoryRateLimiter(clock)


class Tenancy:
    """Built from the settings; `enabled` only with a keys file (otherwise every request is the
    unlimited tenant `default` and nothing is stored)."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings.tenants
        self.clock = clock
        self._api_keys = settings.auth.resolved_api_keys()
        self._admin_keys = settings.auth.resolved_admin_keys()
        self.directory: KeyDirectory = load_directory(self.settings.keys_file, self._api_keys, self._admin_keys)
        self.enabled = self.settings.keys_file is not None
        self.limiter: RateLimiter | None = make_limiter(self.settings, clock) if self.enabled else None
        self.usage: UsageStore | None = (
            UsageStore(self.settings.usage_path(settings.server.state_dir), clock) if self.enabled else None)
        self._tasks: list[asyncio.Task[None]] = []
        self._keys_stamp = self._stamp()
        self._directory_listeners: list[Callable[[KeyDirectory], None]] = []
        self._keys_reload_listeners: list[Callable[[str], None]] = []

    # -- the request path ------------------------------------------------------------------

    @property
    def default(self) -> Tenant:
        return self.directory.default

    async def admit(self, tenant: Tenant, tokens: int) -> Decision | None:
        """The limiter's decision, or None for a tenant without limits (nothing to count)."""
        if self.limiter is None or not tenant.limits.any:
            return None
        return await self.limiter.acquire(tenant, tokens)

    async def finish(self, tenant: Tenant, decision: Decision | None, prompt_tokens: int,
                     completion_tokens: int) -> int | None:
        """An admitted request ended: settle its reservation, record its usage; the quota used after it."""
        if self.usage is not None:
            self.usage.record(tenant.name, requests=1, prompt_tokens=prompt_tokens,
                              completion_tokens=completion_tokens)
        if decision is None or self.limiter is None or decision.settled:
            return None
        decision.settled = True
        used = prompt_tokens + completion_tokens
        if used == decision.reserved or not decision.tenant.limits.counts_tokens:
            return decision.quota_used  # nothing to give back or take: spare Redis the round trip
        return await self.limiter.settle(decision, used)

    def refused(self, tenant: Tenant) -> None:
        if self.usage is not None:
            self.usage.record(tenant.name, rate_limited=1)

    # -- keys file -------------------------------------------------------------------------

    def add_directory_listener(self, listener: Callable[[KeyDirectory], None]) -> None:
        self._directory_listeners.append(listener)
        listener(self.directory)

    def add_keys_reload_listener(self, listener: Callable[[str], None]) -> None:
        self._keys_reload_listeners.append(listener)

    def _stamp(self) -> tuple[float, int] | None:
        path = self.settings.keys_file
        try:
            stat = Path(path).stat() if path is not None else None
        except OSError:
            return None
        return (stat.st_mtime, stat.st_size) if stat else None

    async def reload_keys(self) -> bool:
        """Re-read the keys file; an invalid one is refused and the previous keys stay."""
        try:
            directory = load_directory(self.settings.keys_file, self._api_keys, self._admin_keys)
        except (ValueError, OSError) as exc:
            logger.error("keys file not reloaded, the previous keys stay: %s", exc)
            outcome = "failure"
        else:
            self.directory = directory
            await self._seed_quotas()
            logger.info("keys file reloaded: %d tenant(s)", len(directory.tenants))
            for listener in self._directory_listeners:
                listener(directory)
            outcome = "success"
        for reload_listener in self._keys_reload_listeners:
            reload_listener(outcome)
        return outcome == "success"

    async def _watch_keys(self) -> None:
        while True:
            await asyncio.sleep(self.settings.watch_interval_s)
            stamp = self._stamp()
            if stamp is not None and stamp != self._keys_stamp:
                self._keys_stamp = stamp
                await self.reload_keys()

    # -- usage -----------------------------------------------------------------------------

    async def _seed_quotas(self) -> None:
        """Quota counters start from the usage store, so a restart does not hand out a new month."""
        if self.usage is None or self.limiter is None:
            return
        period = period_of(self.clock())
        with_quota = [t.name for t in self.directory.tenants.values() if t.limits.monthly_tokens]
        if not with_quota:
            return
        used = await self.usage.month_tokens(period)
        for name in with_quota:
            await self.limiter.seed_quota(name, period, used.get(name, 0))

    async def _flush_every(self, interval: float) -> None:
        assert self.usage is not None
        while True:
            await asyncio.sleep(interval)
            await self.usage.flush()

    async def usage_report(self, tenant: str | None, since: str | None, until: str | None) -> dict[str, Any]:
        """Daily rows and per-tenant totals for /admin/usage."""
        if self.usage is None:
            return {"object": "list", "data": [], "tenants": {}}
        rows = await self.usage.rows(tenant, since, until)
        names = [name for name in self.directory.tenants if tenant is None or name == tenant]
        names += sorted({row.tenant for row in rows} - set(names))  # tenants since removed from the file
        totals: dict[str, dict[str, Any]] = {}
        for name in names:
            known = self.directory.tenants.get(name)
            totals[name] = {"limits": known.limits.model_dump() if known else None, **UsageRow(name, "").counts()}
        for row in rows:
            for key, value in row.counts().items():
                totals[row.tenant][key] += value
        period = period_of(self.clock())
        month = await self.usage.month_tokens(period)
        for name, entry in totals.items():
            entry["month"] = {"period": period, "total_tokens": month.get(name, 0)}
        return {"object": "list", "data": [r.as_dict() for r in rows], "tenants": totals}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.enabled:
            return
        if isinstance(self.limiter, RedisRateLimiter):
            reachable = await self.limiter.ping()
            logger.info("tenants: %d, limiter: redis (%s)", len(self.directory.tenants),
                        "reachable" if reachable else "UNREACHABLE: deciding per instance until it is")
        else:
            logger.info("tenants: %d, limiter: memory (limits hold per instance)", len(self.directory.tenants))
        await self._seed_quotas()
        assert self.usage is not None
        self._tasks.append(asyncio.ensure_future(self._flush_every(self.settings.usage_flush_interval_s)))
        if self.settings.watch_keys_file:
            self._tasks.append(asyncio.ensure_future(self._watch_keys()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.usage is not None:
            await self.usage.close()
        if self.limiter is not None:
            await self.limiter.close()
