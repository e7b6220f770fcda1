"""Helpers for async streams: merge several engine streams (keeping their order per source), and
the engine stream under the configured first-token and total timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from server.engine import GenerationOutput
from server.errors import RequestTimeoutError
from server.settings import LimitSettings

T = TypeVar("T")

_DONE = object()


async def merge_streams(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yield `(source index, item)` as items arrive from any stream.

    Closing the merged iterator cancels the pumps and closes every source, so engine requests
    behind the sources are aborted when the consumer goes away.
    """
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return

    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, _DONE))
        except BaseException as exc:  # handed to the consumer, which re-raises
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]


async def with_deadlines(
    stream: AsyncIterator[T],
    *,
    first_item_timeout: float | None,
    total_timeout: float | None,
    on_timeout: Callable[[str], BaseException],
) -> AsyncIterator[T]:
    """Re-yield `stream`, raising `on_timeout(which)` when the first item or the whole stream is late.

    The source is closed either way, which aborts its engine request.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total_timeout if total_timeout else None
    first = True
    iterator = stream.__aiter__()
    try:
        while True:
            first_limit = first_item_timeout if first else None
            total_left = deadline - loop.time() if deadline is not None else None
            binding = "first_token" if first_limit is not None and (
                total_left is None or first_limit <= total_left) else "total"
            timeout = first_limit if binding == "first_token" else total_left
            try:
                item = await asyncio.wait_for(iterator.__anext__(), timeout)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise on_timeout(binding) from None
            first = False
            yield item
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def guarded(stream: AsyncIterator[GenerationOutput], limits: LimitSettings) -> AsyncIterator[GenerationOutput]:
    """The engine stream under the configured first-token and total timeouts (504 when late)."""
    if limits.first_token_timeout_s is None and limits.request_timeout_s is None:
        return stream

    def timeout_error(which: str) -> RequestTimeoutError:
        if which == "first_token":
            return RequestTimeoutError(
                f"no token within {limits.first_token_timeout_s} s (limits.first_token_timeout_s); aborted")
        return RequestTimeoutError(f"generation took longer than {limits.request_timeout_s} s "
                                   "(limits.request_timeout_s); aborted")

    return with_deadlines(
        stream,
        first_item_timeout=limits.first_token_timeout_s,
        total_timeout=limits.request_timeout_s,
        on_timeout=timeout_error,
    )
