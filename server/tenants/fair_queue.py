"""A fair share of the engine between tenants: when the engine is full, the next free place goes
to the waiting tenant that has received the least service per unit of its `share`.

The gateway, not vLLM, is where this can live: vLLM sees requests, not tenants, and its queue is
first come first served (or by a per-request priority). So the gateway holds back the requests
that would only wait in vLLM's queue: at most `capacity()` engine sequences (the profile's
`max_num_seqs`) run at once, the rest wait here, one FIFO per tenant, and each free place goes to
the tenant with the lowest virtual counter — the Virtual Token Counter of Sheng et al.,
"Fairness in Serving Large Language Models" (OSDI 2024):

- a tenant's counter grows by the service it receives divided by its share: its prompt tokens
  when a request starts, `OUTPUT_WEIGHT` x its generated tokens when the request ends (a
  generated token costs the engine more than a prompt token);
- a tenant that becomes active (a request running or waiting) after an idle spell has its
  counter lifted to the lowest counter of the tenants already active, so idleness banks no
  credit (and costs none);
- equal counters go to the tenant holding fewer places per unit of share, then to the older
  request.

A light tenant therefore waits at most for the next place to free up, however many requests a
heavy tenant has queued; under contention active tenants receive service in proportion to their
shares. Below capacity nothing waits and nothing is reordered.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

OUTPUT_WEIGHT = 2.0
"""A generated token's cost against a prompt token's (the paper's w_q / w_p)."""


@dataclass(eq=False)
class Place:
    """Places held by one request, from `FairQueue.acquire` until `release`."""

    tenant: str
    share: float
    places: int
    order: int
    granted: asyncio.Future[None] = field(repr=False)
    prompt_tokens: int = 0
    released: bool = False
    queued: bool = False
    """Whether it waited (the engine was full, or others were waiting, when it asked)."""


class FairQueue:
    """Places in the engine, handed out fairly between tenants (see the module docstring)."""

    def __init__(self, capacity: Callable[[], int]) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._counters: dict[str, float] = {}
        self._waiting: dict[str, deque[Place]] = {}
        self._running: dict[str, int] = {}
        self._order = itertools.count()
        self.listeners: list[Callable[[str, int], None]] = []
        """Called with (tenant, requests waiting) whenever a tenant's queue changes length."""

    # -- what the metrics and tests read ----------------------------------------------------

    def waiting(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    # -- the request path -------------------------------------------------------------------

    async def acquire(self, tenant: str, share: float, places: int, prompt_tokens: int,
                      timeout: float | None = None) -> Place:
        """Wait for `places` engine sequences (at most the whole capacity) and return them;
        `asyncio.TimeoutError` after `timeout` seconds of waiting (nothing is held then)."""
        place = Place(tenant, share, max(1, min(places, self.capacity())), next(self._order),
                      asyncio.get_running_loop().create_future(), prompt_tokens)
        if not self._active(tenant):
            self._lift(tenant)
        if not self._waiting and self.in_use + place.places <= self.capacity():
            self._grant(place)
            return place
        place.queued = True
        self._waiting.setdefault(tenant, deque()).append(place)
        self._notify(tenant)
        self._dispatch()
        try:
            await asyncio.wait_for(asyncio.shield(place.granted), timeout)
        except BaseException:
            if place.granted.done() and not place.granted.cancelled():
                self.release(place, 0)  # granted as it gave up: hand the places on
            else:
                place.granted.cancel()
                self._forget(place)
            raise
        return place

    def release(self, place: Place, completion_tokens: int) -> None:
        """The request ended: free its places, charge what it generated, hand them on."""
        if place.released:
            return
        place.released = True
        self.in_use -= place.places
        left = self._running[place.tenant] - place.places
        if left:
            self._running[place.tenant] = left
        else:
            del self._running[place.tenant]
        self._charge(place.tenant, OUTPUT_WEIGHT * completion_tokens, place.share)
        self._dispatch()
        if not self.in_use and not self._waiting:
            # Nobody active: history no longer matters (and counters stay small).
            self._counters.clear()

    # -- inside -----------------------------------------------------------------------------

    def _active(self, tenant: str) -> bool:
        return tenant in self._waiting or tenant in self._running

    def _active_tenants(self) -> set[str]:
        return set(self._waiting) | set(self._running)

    def _lift(self, tenant: str) -> None:
        """A tenant becoming active starts level with the lowest of those already active."""
        counters = [self._counters.get(t, 0.0) for t in self._active_tenants()]
        if counters:
            self._counters[tenant] = max(self._counters.get(tenant, 0.0), min(counters))

    def _charge(self, tenant: str, tokens: float, share: float) -> None:
        self._counters[tenant] = self._counters.get(tenant, 0.0) + tokens / share

    def _grant(self, place: Place) -> None:
        self.in_use += place.places
        self._running[place.tenant] = self._running.get(place.tenant, 0) + place.places
        self._charge(place.tenant, place.prompt_tokens, place.share)
        place.granted.set_result(None)

    def _forget(self, place: Place) -> None:
        queue = self._waiting.get(place.tenant)
        if queue is not None and place in queue:
            queue.remove(place)
            if not queue:
                del self._waiting[place.tenant]
            self._notify(place.tenant)
            self._dispatch()  # a large request that left may unblock smaller ones

    def _next(self) -> Place | None:
        best: tuple[float, float, int] | None = None
        chosen: Place | None = None
        for tenant, queue in self._waiting.items():
            head = queue[0]
            key = (self._counters.get(tenant, 0.0), self._running.get(tenant, 0) / head.share, head.order)
            if best is None or key < best:
                best, chosen = key, head
        return chosen

    def _dispatch(self) -> None:
        while (place := self._next()) is not None and self.in_use + place.places <= self.capacity():
            queue = self._waiting[place.tenant]
            queue.popleft()
            if not queue:
                del self._waiting[place.tenant]
            self._grant(place)
            self._notify(place.tenant)

    def _notify(self, tenant: str) -> None:
        for listener in self.listeners:
            listener(tenant, self.waiting(tenant))
