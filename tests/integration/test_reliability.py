"""Overload, timeouts, cancellation storms, drain on SIGTERM and engine death, on real engines."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import ServerProcess, descendants, running, start_gateway, wait_ready

LIMIT = 16


@pytest.fixture(scope="module")
def launched(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """The module's two gateways, started together so that the engine-death test does not wait for
    a start of its own (here the pair was ready in 36-41 s, one alone in 21-23 s): `limited`, and
    a default one whose engine the last test kills."""
    tmp = tmp_path_factory.mktemp("reliability")
    servers: dict[str, ServerProcess] = {}
    try:
        for name, env in {"limited": {"LLM_GATEWAY_LIMITS__MAX_IN_FLIGHT": str(LIMIT),
                                      "LLM_GATEWAY_LIMITS__REQUEST_TIMEOUT_S": "20",
                                      "LLM_GATEWAY_SERVER__DRAIN_TIMEOUT_S": "120"},
                          "doomed": None}.items():
            (tmp / name).mkdir()
            servers[name] = start_gateway(tmp / name, env=env, wait=False)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def limited(launched: dict[str, ServerProcess]) -> ServerProcess:
    wait_ready(launched["limited"])
    return launched["limited"]


def wait_engine_idle(server: ServerProcess, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = httpx.get(server.base_url + "/admin/status", timeout=10).json()
        if status["engine_unfinished_requests"] == 0 and status["in_flight"] == 0:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout} s: {status}")
        time.sleep(0.1)


def read_stream(client: httpx.Client, body: dict) -> tuple[int, list[str]]:
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.text]
        return 200, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_overload_gets_complete_answers_or_429(limited: ServerProcess) -> None:
    results: list[httpx.Response | Exception] = []

    def one(i: int) -> None:
        try:
            results.append(httpx.post(limited.base_url + "/v1/completions", timeout=120,
                                      json={"prompt": f"Request {i}:", "max_tokens": 8, "temperature": 0}))
        except Exception as exc:
            results.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4 * LIMIT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert not [r for r in results if isinstance(r, Exception)]
    statuses = [r.status_code for r in results]  # type: ignore[union-attr]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= LIMIT // 2 and statuses.count(429) >= 1
    for r in results:
        assert isinstance(r, httpx.Response)
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in {"length", "stop"}
        else:
            assert r.headers["retry-after"]
            assert r.json()["error"]["type"] == "RateLimitError"
    metrics = httpx.get(limited.base_url + "/metrics").text
    assert 'gateway_rejections_total{reason="overload"}' in metrics
    wait_engine_idle(limited)


@pytest.mark.timing
def test_request_timeout_aborts_with_504_and_sse_error(limited: ServerProcess) -> None:
    """A plain and a streamed request past `limits.request_timeout_s`, at once (each waits out the
    timeout): 504, and a final SSE error event with code 504."""
    body = {"prompt": "Write a very long story:", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    plain: dict[str, object] = {}

    def post_plain() -> None:
        t0 = time.monotonic()
        plain["response"] = httpx.post(limited.base_url + "/v1/completions", json=body, timeout=120)
        plain["took"] = time.monotonic() - t0

    worker = threading.Thread(target=post_plain)
    worker.start()
    with httpx.Client(base_url=limited.base_url, timeout=120) as client:
        status, events = read_stream(client, body)
    worker.join(120)
    r = plain["response"]
    assert isinstance(r, httpx.Response) and r.status_code == 504
    assert "request_timeout_s" in r.json()["error"]["message"]
    assert plain["took"] < 45  # type: ignore[operator]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 504
    wait_engine_idle(limited)


@pytest.mark.timing
def test_cancellation_storm_leaves_the_engine_idle(gateway: ServerProcess) -> None:
    async def storm() -> None:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60, limits=limits) as client:
            async def one(i: int) -> None:
                async with client.stream("POST", "/v1/completions", json={
                    "prompt": f"Story {i}:", "max_tokens": 200, "stream": True, "ignore_eos": True,
                }) as r:
                    async for _ in r.aiter_lines():
                        pass

            tasks = [asyncio.create_task(one(i)) for i in range(200)]
            await asyncio.sleep(0.5)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def answer_time() -> float:
        t0 = time.monotonic()
        r = httpx.post(gateway.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        return time.monotonic() - t0

    # Against this machine as it runs now (a loaded CI machine answers slower): the storm's 200
    # streams of 200 tokens, had any been left running, would hold the engine for minutes.
    before = answer_time()
    asyncio.run(storm())
    wait_engine_idle(gateway, timeout=45)
    after = answer_time()
    assert after < 5 + 3 * before, (after, before)


def test_sigterm_drains_in_flight_streams_then_exits_0(limited: ServerProcess) -> None:
    results: list[tuple[int, list[str]]] = []
    started = threading.Barrier(17)

    def stream(i: int) -> None:
        with httpx.Client(base_url=limited.base_url, timeout=120) as client:
            started.wait()
            results.append(read_stream(client, {"prompt": f"Drain {i}:", "max_tokens": 24, "ignore_eos": True}))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    started.wait()
    deadline = time.monotonic() + 30
    while httpx.get(limited.base_url + "/admin/status").json()["in_flight"] < 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = descendants(limited.proc.pid)
    limited.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    during = httpx.post(limited.base_url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
    ready = httpx.get(limited.base_url + "/ready", timeout=10)
    for t in threads:
        t.join(120)
    code = limited.proc.wait(120)
    assert during.status_code == 503 and during.headers["retry-after"]
    assert ready.status_code == 503
    assert len(results) == 16
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert code == 0
    time.sleep(1)
    assert not [p for p in children if running(p)]


def test_engine_death_fails_requests_and_exits_nonzero(launched: dict[str, ServerProcess]) -> None:
    server = launched["doomed"]
    wait_ready(server)
    try:
        outcomes: list[int | str] = []

        def client(i: int) -> None:
            try:
                r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                               json={"prompt": f"Doomed {i}:", "max_tokens": 300, "ignore_eos": True})
                outcomes.append(r.status_code)
            except httpx.HTTPError as exc:
                outcomes.append(type(exc).__name__)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(2)
        cores = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
        assert cores, [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
        killed_at = time.monotonic()
        for p in cores:
            p.kill()
        saw_503 = None
        while time.monotonic() - killed_at < 5 and server.proc.poll() is None:
            try:
                if httpx.get(server.base_url + "/health", timeout=1).status_code == 503:
                    saw_503 = time.monotonic() - killed_at
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.1)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a client hung after the engine died"
        assert saw_503 is not None and saw_503 < 5
        assert all(o != 200 for o in outcomes), outcomes
        assert server.proc.wait(30) != 0
    finally:
        server.stop(signal.SIGKILL)
