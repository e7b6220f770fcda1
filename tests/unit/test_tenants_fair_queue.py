"""The tenants' fair queue (server.tenants.fair_queue) alone: who gets a full engine's next place."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from server.tenants.fair_queue import FairQueue, Place


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def settle() -> None:
    for _ in range(20):  # a granted wait returns after a few hops (wait_for, shield)
        await asyncio.sleep(0)


def test_below_capacity_nothing_waits() -> None:
    async def main() -> None:
        q = FairQueue(lambda: 3)
        places = [await q.acquire("a", 1.0, 1, 10) for _ in range(3)]
        assert q.in_use == 3
        for p in places:
            q.release(p, 5)
        assert q.in_use == 0
    run(main())


def test_a_light_tenant_gets_the_next_free_place_past_a_flood() -> None:
    """A fills the engine and queues 20 more; B's one request is granted at the first release."""
    async def main() -> None:
        q = FairQueue(lambda: 4)
        running = [await q.acquire("a", 1.0, 1, 100) for _ in range(4)]
        flood = [asyncio.ensure_future(q.acquire("a", 1.0, 1, 100)) for _ in range(20)]
        await settle()
        b = asyncio.ensure_future(q.acquire("b", 1.0, 1, 10))
        await settle()
        assert q.waiting("a") == 20 and q.waiting("b") == 1
        q.release(running[0], 50)
        await settle()
        assert b.done(), "B waited behind A's queue"
        assert sum(f.done() for f in flood) == 0
        for f in flood:
            f.cancel()
        await settle()
        assert q.waiting("a") == 0
    run(main())


async def saturate(q: FairQueue, shares: dict[str, float], grants: int, prompt: int = 20,
                   completion: int = 10, joins: dict[str, int] | None = None, depth: int = 3,
                   sizes: dict[str, int] | None = None) -> Counter[str]:
    """Every tenant keeps `depth` requests waiting on a full engine (from the `joins[name]`th
    grant on, 0 by default); count who gets the next `grants` places (the oldest running request
    ends each time a place is handed out). Counts of late joiners start when they join. A tenant
    in `sizes` sends requests of that many prompt and completion tokens."""
    joins = joins or {}
    sizes = sizes or {}
    held_sizes: dict[int, int] = {}

    def ask(name: str) -> asyncio.Future[Place]:
        return asyncio.ensure_future(q.acquire(name, shares[name], 1, sizes.get(name, prompt)))

    got: Counter[str] = Counter()
    held: list[Place] = []
    waiters: dict[str, list[asyncio.Future[Place]]] = {}

    def join_due() -> None:
        for name in shares:
            if name not in waiters and sum(got.values()) >= joins.get(name, 0):
                waiters[name] = [ask(name) for _ in range(depth)]

    join_due()
    await settle()
    while sum(got.values()) < grants:
        for name, futs in waiters.items():
            for fut in [f for f in futs if f.done()]:
                futs.remove(fut)
                held.append(fut.result())
                held_sizes[id(held[-1])] = sizes.get(name, completion)
                got[name] += 1
                futs.append(ask(name))
        join_due()
        await settle()
        if held:
            place = held.pop(0)
            q.release(place, held_sizes.pop(id(place)))
            await settle()
    for futs in waiters.values():
        for fut in futs:
            fut.cancel()
    await settle()
    for place in held:
        q.release(place, completion)
    return got


def test_weights_split_a_full_engine_in_proportion() -> None:
    async def main() -> None:
        got = await saturate(FairQueue(lambda: 2), {"a": 3.0, "b": 1.0}, 400)
        assert 2.7 <= got["a"] / got["b"] <= 3.3, got
    run(main())


def test_equal_shares_split_evenly_whatever_the_request_sizes() -> None:
    """Service, not requests, is what is shared: B's requests are 4x A's, so A gets ~4x the places."""
    async def main() -> None:
        got = await saturate(FairQueue(lambda: 2), {"a": 1.0, "b": 1.0}, 300, sizes={"a": 10, "b": 40})
        assert 3.4 <= got["a"] / got["b"] <= 4.6, got
    run(main())


def test_an_idle_spell_banks_no_credit() -> None:
    """B joins after A and C have shared a full engine for a long time: B is lifted to their
    counters, so it gets about its third from then on, not every place until it has caught up."""
    async def main() -> None:
        got = await saturate(FairQueue(lambda: 2), {"a": 1.0, "c": 1.0, "b": 1.0}, 150, joins={"b": 90})
        assert 10 <= got["b"] <= 30, got  # 20 of the 60 after it joined is a third
    run(main())


def test_a_wait_past_its_timeout_holds_nothing_and_the_next_one_goes() -> None:
    async def main() -> None:
        q = FairQueue(lambda: 1)
        p = await q.acquire("a", 1.0, 1, 10)
        with pytest.raises(asyncio.TimeoutError):
            await q.acquire("b", 1.0, 1, 10, timeout=0.05)
        assert q.waiting("b") == 0
        c = asyncio.ensure_future(q.acquire("c", 1.0, 1, 10))
        await settle()
        q.release(p, 1)
        await settle()
        assert c.done() and q.in_use == 1
    run(main())


def test_a_request_cancelled_as_it_is_granted_hands_its_place_on() -> None:
    async def main() -> None:
        q = FairQueue(lambda: 1)
        p = await q.acquire("a", 1.0, 1, 10)
        b = asyncio.ensure_future(q.acquire("b", 1.0, 1, 10))
        c = asyncio.ensure_future(q.acquire("c", 1.0, 1, 10))
        await settle()
        q.release(p, 1)  # grants B's future; B's task has not run yet
        b.cancel()
        await settle()
        assert b.cancelled()
        assert c.done() and not c.cancelled()
        assert q.in_use == 1
        q.release(c.result(), 1)
        assert q.in_use == 0
    run(main())


def test_several_places_wait_for_room_and_are_capped_at_the_capacity() -> None:
    async def main() -> None:
        q = FairQueue(lambda: 4)
        p = await q.acquire("a", 1.0, 3, 10)
        big = asyncio.ensure_future(q.acquire("b", 1.0, 2, 10))
        await settle()
        assert not big.done()  # 3 + 2 > 4
        q.release(p, 1)
        await settle()
        assert big.done() and q.in_use == 2
        q.release(big.result(), 1)
        huge = await q.acquire("c", 1.0, 16, 10)  # n above max_num_seqs runs alone, not never
        assert huge.places == 4
        q.release(huge, 1)
        assert q.in_use == 0 and q.counter("c") == 0  # idle: counters forgotten
    run(main())


def test_the_capacity_follows_the_profile() -> None:
    async def main() -> None:
        capacity = [1]
        q = FairQueue(lambda: capacity[0])
        p = await q.acquire("a", 1.0, 1, 10)
        waiting = asyncio.ensure_future(q.acquire("a", 1.0, 1, 10))
        await settle()
        assert not waiting.done()
        capacity[0] = 2  # a reload to a profile with more seqs: the next dispatch sees it
        b = asyncio.ensure_future(q.acquire("b", 1.0, 1, 10))
        await settle()
        # B (holding nothing) goes first on equal counters; one of the two got the new place.
        assert b.done() and not waiting.done() and q.in_use == 2
        q.release(p, 1)
        await settle()
        assert waiting.done()
    run(main())
