"""server/routes/openai.cancel_on_disconnect: the generation work runs in the request's own task
(no task and no wait of its own, which cost a new request two turns of the event loop), and a
client that leaves cancels it, as before: the work sees the cancellation at the await it was
waiting on (so it releases what it holds), and the route gets ClientDisconnected; a cancellation
from outside (shutdown) stays one; the task is left with no cancellation pending either way."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from server.routes.openai import ClientDisconnected, cancel_on_disconnect


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def request_with(messages: asyncio.Queue[dict[str, Any]]) -> Request:
    async def receive() -> dict[str, Any]:
        return await messages.get()

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


@pytest.mark.anyio
async def test_the_work_runs_in_this_task_and_its_result_comes_back() -> None:
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    me = asyncio.current_task()
    ran_in: list[asyncio.Task[Any] | None] = []

    async def work() -> str:
        ran_in.append(asyncio.current_task())
        await asyncio.sleep(0)
        return "done"

    assert await cancel_on_disconnect(request_with(messages), work()) == "done"
    assert ran_in == [me]
    assert me is not None and me.cancelling() == 0
    await asyncio.sleep(0.01)  # nothing pending for this task: it goes on normally


@pytest.mark.anyio
async def test_a_client_that_leaves_cancels_the_work() -> None:
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    seen: list[str] = []

    async def work() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")  # where the work releases what it holds
            raise
        return "never"

    asyncio.get_running_loop().call_later(0.05, messages.put_nowait, {"type": "http.disconnect"})
    with pytest.raises(ClientDisconnected):
        await cancel_on_disconnect(request_with(messages), work())
    assert seen == ["cancelled"]
    me = asyncio.current_task()
    assert me is not None and me.cancelling() == 0
    await asyncio.sleep(0.01)


@pytest.mark.anyio
async def test_the_client_leaving_as_the_work_ends_is_still_a_disconnect() -> None:
    """The watcher runs first in the turn where the work's future also completes: the work sees
    the cancellation at that await (as a cancelled task did before), never later in the route."""
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def work() -> str:
        try:
            return await ready
        except asyncio.CancelledError:
            seen.append(f"cancelled, result {ready.result()!r} to hand back")
            raise

    def both() -> None:
        messages.put_nowait({"type": "http.disconnect"})  # the watcher wakes first
        ready.set_result("granted")

    asyncio.get_running_loop().call_later(0.02, both)
    with pytest.raises(ClientDisconnected):
        await cancel_on_disconnect(request_with(messages), work())
    assert seen == ["cancelled, result 'granted' to hand back"]
    me = asyncio.current_task()
    assert me is not None and me.cancelling() == 0


@pytest.mark.anyio
async def test_a_cancellation_from_outside_stays_one_and_errors_pass_through() -> None:
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    task = asyncio.ensure_future(cancel_on_disconnect(request_with(messages), asyncio.sleep(30)))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def failing() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await cancel_on_disconnect(request_with(messages), failing())
    # a disconnect and an outside cancellation together: the outside one wins
    both = asyncio.ensure_future(cancel_on_disconnect(request_with(messages), asyncio.sleep(30)))
    await asyncio.sleep(0.02)
    messages.put_nowait({"type": "http.disconnect"})
    both.cancel()
    with pytest.raises(asyncio.CancelledError):
        await both
