"""Long text prompts are templated and tokenized off the event loop; short ones inline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from server.serving.lease import OFFLOAD_PROMPT_CHARS, prompt_chars
from testbed.fakes import FakeEngine
from tests.unit.test_http_fake_engine import make

BLOCK_S = 1.5  # a slow tokenizer: a blocked loop is unmistakable, and a third of it (0.5 s) is
# far above the scheduling hiccups of a loaded 2-core CI machine (0.22 s seen at load 3 with 0.6 s)


class SlowTokenizerEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.encoded_on: list[str] = []

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        self.encoded_on.append(threading.current_thread().name)
        if len(text) > OFFLOAD_PROMPT_CHARS:
            time.sleep(BLOCK_S)  # holds the GIL-free part of a real tokenizer's time, as a sleep
        return super().encode(text[:200], add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        return super().decode(token_ids)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def longest_loop_stall(work: asyncio.Future) -> float:
    """The longest gap between 5 ms ticks of the event loop while `work` runs."""
    worst, last = 0.0, time.monotonic()
    while not work.done():
        await asyncio.sleep(0.005)
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    await work
    return worst


LONG = "word " * (OFFLOAD_PROMPT_CHARS // 4)
REQUESTS = {
    "/v1/completions": {"model": "fake", "prompt": LONG, "max_tokens": 2},
    "/v1/chat/completions": {"model": "fake", "messages": [{"role": "user", "content": LONG}], "max_tokens": 2},
    "/v1/responses": {"model": "fake", "input": LONG, "max_output_tokens": 2},
    "/tokenize": {"model": "fake", "prompt": LONG},
}


@pytest.mark.timing
@pytest.mark.anyio
@pytest.mark.parametrize("route", sorted(REQUESTS))
async def test_a_long_prompt_does_not_stall_the_event_loop(route: str) -> None:
    engine = SlowTokenizerEngine()
    client, holder = make(engine)
    await holder.start()
    work = asyncio.ensure_future(client.post(route, json=REQUESTS[route]))
    stall = await longest_loop_stall(work)
    assert work.result().status_code == 200, work.result().text
    assert engine.encoded_on and all(name.startswith("gateway-tokenize") for name in engine.encoded_on)
    assert stall < BLOCK_S / 3, f"the event loop stalled {stall:.3f} s"


@pytest.mark.anyio
async def test_short_prompts_and_token_ids_stay_on_the_loop() -> None:
    engine = SlowTokenizerEngine()
    client, holder = make(engine)
    await holder.start()
    r = await client.post("/v1/chat/completions", json={
        "model": "fake", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2})
    assert r.status_code == 200
    assert engine.encoded_on == [threading.current_thread().name]
    assert prompt_chars([1, 2, 3] * 5000) == 0  # token ids need no tokenizer
    assert prompt_chars([{"role": "user", "content": "abc"}, {"content": ["de", "f"]}]) == 10


@pytest.mark.anyio
async def test_a_bad_long_request_is_still_a_clean_400() -> None:
    engine = SlowTokenizerEngine()
    client, holder = make(engine)
    await holder.start()
    # raised inside the offloaded preparation (the prompt plus max_tokens exceed the context)
    r = await client.post("/v1/completions", json={"model": "fake", "prompt": LONG, "max_tokens": 10**7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert holder.in_flight == 0
