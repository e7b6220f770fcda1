"""Serving a request on an engine lease: take the lease, prepare the request on it (off the event
loop when the prompt is long), then stream or complete it and give the lease back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from typing import Any, TypeVar

from pydantic import BaseModel

from server.engine import Engine
from server.lifecycle.holder import EngineHolder
from server.request_state import RequestStats
from server.serving.sse import EventStream
from server.settings import LimitSettings

# Above this many characters of prompt text, the chat template and the tokenizer run in a worker
# thread: a 4,096-token prompt takes milliseconds to tokenize, and on the event loop that time
# stalls every other stream. Below it the thread hop costs more than the work. One thread, as in
# `vllm serve`: tokenizers release the GIL while they encode, and one queue keeps long prompts
# from crowding out the loop's own work.
OFFLOAD_PROMPT_CHARS = 4096
_PREPARE_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-tokenize")


def prompt_chars(value: Any) -> int:
    """Characters of text in a prompt-like value: strings, lists, dicts, request models; token
    ids count 0 (they need no tokenizer)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], int):
            return 0
        return sum(prompt_chars(v) for v in value)
    if isinstance(value, dict):
        return sum(prompt_chars(v) for v in value.values())
    if isinstance(value, BaseModel):
        return sum(prompt_chars(v) for v in value.__dict__.values())
    return 0


class GenerationService:
    """What the completions and chat services share: the engine holder and the profile's limits."""

    def __init__(self, holder: EngineHolder, *, fingerprint: str) -> None:
        self.holder = holder
        self.fingerprint = fingerprint

    @property
    def limits(self) -> LimitSettings:
        """The limits of the profile serving now (a reload may change them)."""
        return self.holder.settings.limits


Prepared = TypeVar("Prepared")
Result = TypeVar("Result")


async def serve_on_lease(
    holder: EngineHolder,
    prepare: Callable[[Engine], Prepared],
    stream: Callable[[Prepared], AsyncIterator[str]] | None,
    complete: Callable[[Prepared], Awaitable[Result]],
    *,
    text_chars: int = 0,
    stats: RequestStats | None = None,
) -> Result | EventStream:
    """Take an engine lease, `prepare` the request on it (client errors surface here, before any
    byte is sent), ask the tenant limits to admit the reservation `prepare` put in `stats` (a
    refusal surfaces here too, before the engine sees the request: the engine streams `prepare`
    made start only when read), wait for the tenant's turn in a full engine (`stats.turn`), then
    either hand the lease to the returned EventStream (released when the stream ends, however it
    ends) or `complete` the request and release it. `text_chars` (the
    prompt's text size) above OFFLOAD_PROMPT_CHARS moves `prepare` off the event loop."""
    lease = AsyncExitStack()
    engine = await lease.enter_async_context(holder.lease())
    try:
        if text_chars > OFFLOAD_PROMPT_CHARS:
            prepared = await asyncio.get_running_loop().run_in_executor(_PREPARE_THREAD, prepare, engine)
        else:
            prepared = prepare(engine)
        if stats is not None and stats.admit is not None:
            await stats.admit(stats.reserved_tokens)
        if stats is not None and stats.turn is not None:
            # Held until the lease ends: the request's places in a full engine.
            await lease.enter_async_context(stats.turn(stats))
    except BaseException:
        await lease.aclose()
        raise
    if stream is not None:
        return EventStream(stream(prepared), lease.aclose)
    try:
        return await complete(prepared)
    finally:
        await lease.aclose()
