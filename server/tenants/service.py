"""`Tenancy`: one gateway's keys directory, rate limiter and usage store, and their background work
(writing usage). The middleware is its only caller on the request path; the runner (`server.runner.gateway`) starts,
reloads and stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from server.settings import AuthSettings, Settings
from server.settings.keys_file import Tenant
from server.tenants.directory import KeyDirectory, load_directory
from server.tenants.fair_queue import FairQueue
from server.tenants.limiter import Decision, MemoryRateLimiter, RateLimiter, period_of
from server.tenants.redis_limiter import RedisRateLimiter
from server.tenants.usage import UsageRow, UsageStore, totals

logger = logging.getLogger("llm_gateway.tenants")


def make_limiter(auth: AuthSettings, clock: Callable[[], float] = time.time) -> RateLimiter:
    if auth.redis_url:
        return RedisRateLimiter(auth.redis_url, prefix=auth.redis_key_prefix, timeout_s=auth.redis_timeout_s,
                                retry_s=auth.redis_retry_s, lease_s=auth.concurrency_lease_s, clock=clock)
    return MemoryRateLimiter(clock)


class Tenancy:
    """Built from the settings; `enabled` only with a keys file (otherwise every request is the
    unlimited tenant `unnamed` and nothing is stored)."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time) -> None:
        self.auth = settings.auth
        self.clock = clock
        self._api_keys = self.auth.resolved_api_keys()
        self._admin_keys = self.auth.resolved_admin_keys()
        self.directory: KeyDirectory = load_directory(self.auth.keys_file, self._api_keys, self._admin_keys)
        self.enabled = self.auth.keys_file is not None
        self.limiter: RateLimiter | None = make_limiter(self.auth, clock) if self.enabled else None
        self.usage: UsageStore | None = (
            UsageStore(self.auth.usage_path(settings.server.state_dir), clock) if self.enabled else None)
        self.fair: FairQueue | None = (
            FairQueue(lambda: settings.engine.max_num_seqs) if self.enabled and self.auth.fair_share else None)
        """The engine's places shared fairly between tenants (auth.fair_share); its capacity
        follows the serving profile once the app is built (`server.app.build_app`)."""
        self._flusher: asyncio.Task[None] | None = None
        self._directory_listeners: list[Callable[[KeyDirectory], None]] = []
        self._keys_reload_listeners: list[Callable[[str], None]] = []

    # -- the request path ------------------------------------------------------------------

    @property
    def unnamed(self) -> Tenant:
        return self.directory.unnamed

    async def admit(self, tenant: Tenant, tokens: int) -> Decision | None:
        """The limiter's decision, or None for a tenant without limits (nothing to count)."""
        if self.limiter is None or not tenant.limits.any:
            return None
        return await self.limiter.acquire(tenant, tokens)

    def refused(self, tenant: Tenant) -> None:
        if self.usage is not None:
            self.usage.record(tenant.name, error=True)

    async def finish(self, tenant: Tenant, decision: Decision | None, prompt_tokens: int,
                     completion_tokens: int, *, error: bool, queue_s: float | None = None) -> int | None:
        """An admitted request ended: record its usage (and its wait for a place in a full
        engine, None when it did not wait), settle its decision; the budget's count after it
        (None when there is nothing new to say)."""
        if self.usage is not None:
            self.usage.record(tenant.name, error=error, prompt_tokens=prompt_tokens,
                              completion_tokens=completion_tokens, queue_s=queue_s)
        if decision is None or self.limiter is None or decision.settled:
            return None
        decision.settled = True
        used = prompt_tokens + completion_tokens
        if decision.slot is None and used == decision.reserved:
            # Nothing to give back or take: spare Redis the round trip. The count at admission
            # may be stale by now (other requests since), so nothing new is said.
            return None
        return await self.limiter.settle(decision, used)

    # -- keys file -------------------------------------------------------------------------

    def add_directory_listener(self, listener: Callable[[KeyDirectory], None]) -> None:
        self._directory_listeners.append(listener)
        listener(self.directory)

    def add_keys_reload_listener(self, listener: Callable[[str], None]) -> None:
        self._keys_reload_listeners.append(listener)

    def _warn_about_keys(self) -> None:
        if self.directory.refuses_all:
            logger.warning("keys file %s lists no key: every API request is refused (401) until keys "
                           "are added (`llm-gateway keys add`) and reloaded", self.auth.keys_file)
        if self.directory.plain_key_names:
            logger.warning("keys file %s holds plain keys (tenants: %s): store their SHA-256 instead "
                           "(`llm-gateway keys add` writes one)", self.auth.keys_file,
                           ", ".join(self.directory.plain_key_names))

    async def reload_keys(self) -> bool:
        """Re-read the keys file (SIGHUP, POST /admin/reload); an invalid one is refused and the
        previous keys stay. The counts of the tenants that stay are kept: they are by name."""
        if not self.enabled:
            return True
        try:
            directory = load_directory(self.auth.keys_file, self._api_keys, self._admin_keys)
        except (ValueError, OSError) as exc:
            logger.error("keys file not reloaded, the previous keys stay: %s", exc)
            outcome = "failure"
        else:
            self.directory = directory
            logger.info("keys file reloaded: %d tenant(s)", len(directory.tenants) - 1)
            self._warn_about_keys()
            await self._seed_budgets()
            for listener in self._directory_listeners:
                listener(directory)
            outcome = "success"
        for reload_listener in self._keys_reload_listeners:
            reload_listener(outcome)
        return outcome == "success"

    # -- usage -----------------------------------------------------------------------------

    async def _seed_budgets(self) -> None:
        """Budgets start from the usage store, so a restart does not hand out a new period."""
        if self.usage is None or self.limiter is None:
            return
        now = self.clock()
        for tenant in self.directory.tenants.values():
            limits = tenant.limits
            if limits.budget_tokens:
                period = period_of(now, limits.budget_period)
                used = await self.usage.period_tokens(period)
                await self.limiter.seed_budget(tenant.name, period, used.get(tenant.name, 0))

    async def _flush_every(self, interval: float) -> None:
        assert self.usage is not None
        while True:
            await asyncio.sleep(interval)
            await self.usage.flush()

    async def usage_report(self, tenant: str | None, start: str | None, end: str | None) -> dict[str, Any]:
        """Daily rows and per-tenant totals for GET /admin/usage."""
        if self.usage is None:
            return {"object": "list", "data": [], "tenants": {}}
        rows = await self.usage.rows(tenant, start, end)
        summed = totals(rows)
        report: dict[str, Any] = {}
        names = [name for name in self.directory.tenants if tenant in (None, name)]
        for name in names + sorted(set(summed) - set(names)):  # and tenants since removed from the file
            known = self.directory.tenants.get(name)
            report[name] = {"limits": known.limits.model_dump() if known else None,
                            **summed.get(name, UsageRow(name, "").counts())}
        return {"object": "list", "data": [r.as_dict() for r in rows], "tenants": report}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.enabled:
            return
        count = len(self.directory.tenants) - 1
        if isinstance(self.limiter, RedisRateLimiter):
            reachable = await self.limiter.ping()
            logger.info("tenants: %d, limits shared through Redis (%s)", count,
                        "reachable" if reachable else "UNREACHABLE: counted per instance until it is")
        else:
            logger.info("tenants: %d, limits counted per instance (no auth.redis_url)", count)
        self._warn_about_keys()
        await self._seed_budgets()
        self._flusher = asyncio.ensure_future(self._flush_every(self.auth.usage_flush_interval_s))

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        if self.usage is not None:
            await self.usage.close()
        if self.limiter is not None:
            await self.limiter.close()
