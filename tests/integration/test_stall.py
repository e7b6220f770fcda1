"""A stalled engine on the real CPU engine: the engine core is stopped with SIGSTOP under load.

- detected within the stall timeout (+5 s): /health 503 with the reason, every client gets an
  error (none hangs), the gateway exits 3 and leaves no engine process behind;
- a stop shorter than the timeout, an idle gateway (before the stop above, on the same gateway), and
  prefill work that keeps requests without output for longer than the timeout are not stalls.
"""

from __future__ import annotations

import json
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.conftest import ServerProcess, descendants, engine_core_processes, running, start_gateway_with_own_config

pytestmark = pytest.mark.timing  # every test here bounds a detection time

SHORT_STALL_S = 6.0  # the stall test's gateway only decodes: engine steps of ~0.1 s on a quiet machine
STEP_TOKENS = 1024  # the module's engine's max_num_batched_tokens: a long prefill step of ~1-2 s here
LONG_PROMPT = 1000  # tokens: one prompt is one engine step
PREFILLS = 6  # long prompts sent at once (at least): the last answer waits for all their steps
PREFILL_STALL_STEPS = 4  # the timeout in steps: above any one step even if the machine slows 4x


# One stream of prompts for the whole module: with --timing-rounds a test runs again on the same
# engine, and a prompt drawn again would be a prefix-cache hit, a step that does no work.
PROMPTS = random.Random(7)


def fresh_prompt() -> list[int]:
    return [PROMPTS.randrange(1000, 40000) for _ in range(LONG_PROMPT)]  # no prefix-cache hits


def prefill_s(server: ServerProcess, prompt: list[int]) -> float:
    t0 = time.monotonic()
    r = httpx.post(server.base_url + "/v1/completions", timeout=300,
                   json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


@dataclass
class Watched:
    server: ServerProcess
    config: Path  # its own profile file, which holds health.stall_timeout_s
    stall_s: float | None  # the health.stall_timeout_s a test set (None: the profile's)
    start: Callable[[], tuple[ServerProcess, Path]]  # another gateway like it, with its own profile file

    def alive(self) -> ServerProcess:
        """The module's gateway; a new one if an earlier round of `make test-timing` ended it.
        Each test sets the stall timeout it needs, measured on this machine right then."""
        if self.server.proc.poll() is None and self._stalled():
            self.server.proc.wait(60)  # a stalled gateway exits by itself (code 3)
        if self.server.proc.poll() is not None:
            self.server, self.config = self.start()
            self.stall_s = None
        return self.server

    def _stalled(self) -> bool:
        try:
            r = httpx.get(self.server.base_url + "/health", timeout=5)
        except httpx.HTTPError:
            return False
        return r.status_code == 503 and r.json().get("state") == "stalled"

    def set_stall_timeout(self, seconds: float) -> float:
        """A new health.stall_timeout_s through a reload: the engine keeps serving (only the
        stall rule changes), so the module's one gateway serves every test here."""
        profile = yaml.safe_load(self.config.read_text())
        profile.setdefault("health", {})["stall_timeout_s"] = seconds
        self.config.write_text(yaml.safe_dump(profile))
        r = httpx.post(self.server.base_url + "/admin/reload", timeout=60)
        assert r.status_code == 200 and r.json()["engine_reloaded"] is False, r.text
        self.stall_s = seconds
        return seconds


@pytest.fixture(scope="module")
def watched(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watched]:
    """The module's gateway, on its own copy of the CPU profile; each test sets the stall timeout
    from engine steps it measures itself (a fixed timeout would either not be close to a step here
    or trip on a slower machine). The last test stalls it."""
    def start() -> tuple[ServerProcess, Path]:
        return start_gateway_with_own_config(tmp_path_factory.mktemp("stall"),
                                             engine={"max_num_batched_tokens": STEP_TOKENS})

    server, config = start()
    watched = Watched(server, config, None, start)
    yield watched
    watched.server.stop()


def engine_cores(server: ServerProcess) -> list[psutil.Process]:
    return engine_core_processes(server.proc.pid)


class Streams:
    """`n` streaming clients in threads; `started` once each received its first chunk."""

    def __init__(self, server: ServerProcess, n: int, max_tokens: int) -> None:
        self.results: list[tuple[str, float, list[dict]]] = []  # outcome, seconds, chunks
        self._first = threading.Semaphore(0)
        self.n = n
        self.threads = [threading.Thread(target=self._one, args=(server, i, max_tokens)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, server: ServerProcess, i: int, max_tokens: int) -> None:
        t0 = time.monotonic()
        chunks: list[dict] = []
        first = False
        try:
            body = {"prompt": f"Story {i}:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
                if r.status_code != 200:
                    r.read()
                    self.results.append((f"http {r.status_code}", time.monotonic() - t0, [r.json()]))
                    return
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
                        if not first:
                            first = True
                            self._first.release()
            outcome = "error event" if chunks and "error" in chunks[-1] else "complete"
            self.results.append((outcome, time.monotonic() - t0, chunks))
        except httpx.HTTPError as exc:
            self.results.append((type(exc).__name__, time.monotonic() - t0, chunks))
        finally:
            if not first:
                self._first.release()

    def wait_started(self, timeout: float = 120) -> None:
        for _ in range(self.n):
            assert self._first.acquire(timeout=timeout), "a stream did not start"

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not [t for t in self.threads if t.is_alive()], "a client hung"


def health(server: ServerProcess) -> httpx.Response:
    return httpx.get(server.base_url + "/health", timeout=5)


def stays_idle_and_healthy(server: ServerProcess, seconds: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        assert health(server).json() == {"status": "ok", "state": "serving"}
        assert httpx.get(server.base_url + "/ready", timeout=5).status_code == 200
        time.sleep(0.5)
    assert httpx.get(server.base_url + "/admin/status", timeout=5).json()["engine_quiet_s"] == 0


def burst_s(server: ServerProcess) -> float:
    """Seconds until 8 new streams all have their first token: the engine steps of this machine
    now (a loaded machine makes them many times slower than a quiet one)."""
    t0 = time.monotonic()
    streams = Streams(server, 8, max_tokens=8)
    streams.wait_started()
    took = time.monotonic() - t0
    streams.join(120)
    assert [outcome for outcome, _, _ in streams.results] == ["complete"] * 8, streams.results
    return took


def test_a_stop_shorter_than_the_timeout_is_not_a_stall(watched: Watched) -> None:
    """The engine stopped for half the timeout under 4 streams: they all complete, /health stays
    200. The timeout is 6 s, or 4 times what 8 new streams take to their first token on this
    machine now (as in the idle test below), so the rest of the timeout after the stop still
    holds two such bursts of engine steps."""
    server = watched.alive()
    stall_s = watched.set_stall_timeout(round(max(SHORT_STALL_S, 4 * burst_s(server)), 1))
    cores = engine_cores(server)
    streams = Streams(server, 4, max_tokens=120)
    streams.wait_started()
    for core in cores:
        core.suspend()
    stopped_at = time.monotonic()
    try:
        while time.monotonic() - stopped_at < stall_s / 2:
            assert health(server).status_code == 200
            time.sleep(0.2)
    finally:
        for core in cores:
            core.resume()
    streams.join(120)
    for outcome, _, chunks in streams.results:
        assert outcome == "complete", (outcome, chunks[-1:])
        assert chunks[-1]["usage"]["completion_tokens"] == 120
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert health(server).status_code == 200
    assert server.proc.poll() is None


def test_long_prefills_are_not_a_stall(watched: Watched) -> None:
    """Fresh 1,000-token prompts at once: each is one engine step (the module's engine takes at
    most STEP_TOKENS a step) of about a quarter of the timeout, without any output, and the last
    answer waits for all of them, longer than the timeout, while the engine reports every step.

    The timeout is set from a step measured just before (a shared machine's speed drifts over a
    module). If the machine then sped up so much that the last answer came within the timeout,
    the check was not real: it runs once more on a new measurement."""
    server = watched.alive()
    watched.set_stall_timeout(0)  # off while one step is measured (an earlier test left it short)
    for attempt in range(2):
        step_s = prefill_s(server, fresh_prompt())
        stall_s = watched.set_stall_timeout(round(max(SHORT_STALL_S, PREFILL_STALL_STEPS * step_s), 1))
        # enough steps to outlast the timeout by half again, where the floor sets it (a fast machine)
        prefills = min(30, max(PREFILLS, math.ceil(1.5 * stall_s / step_s)))
        answers, health_seen = prefills_at_once(server, [fresh_prompt() for _ in range(prefills)])
        assert len(answers) == prefills, server.log()[-3000:]
        print(f"engine step of one {LONG_PROMPT}-token prefill: {step_s:.1f} s; timeout {stall_s} s; "
              f"{prefills} at once: first answer {min(answers):.1f} s, last {max(answers):.1f} s")
        assert set(health_seen) == {200}
        if max(answers) > stall_s:
            break
        assert attempt == 0, f"not a real check: the last answer took only {max(answers):.1f} s"
    metrics = httpx.get(server.base_url + "/metrics", timeout=5).text
    assert "gateway_engine_stalls_total 0.0" in metrics


def prefills_at_once(server: ServerProcess, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    """Each prompt's answer time, and the /health codes seen meanwhile (every 0.2 s)."""
    answers: list[float] = []
    health_seen: list[int] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            health_seen.append(health(server).status_code)
            time.sleep(0.2)

    prober = threading.Thread(target=probe)
    prober.start()
    threads = [threading.Thread(target=lambda p=p: answers.append(prefill_s(server, p))) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    done.set()
    prober.join(10)
    return answers, health_seen


def test_idle_then_a_stopped_engine_core_is_detected_failed_and_the_gateway_exits(watched: Watched) -> None:
    """First two timeouts of idleness (a watchdog that counted idle time would trip after the
    first), then work that starts after them must not count them either, then the real stall.
    On a short timeout the idle spell costs seconds, not minutes of CI per vLLM. Last in the
    module: it ends the module's gateway.

    The timeout must stay well above the slowest step this machine takes right now: it is 6 s,
    or 4 times the time 8 new streams take to their first token on this (warm) gateway when
    that is longer (a loaded CI machine). That burst also takes the engine past its first-use
    work for these shapes, which on a starved machine alone outlasted a fixed 6 s."""
    server = watched.alive()
    stall_s = watched.set_stall_timeout(round(max(SHORT_STALL_S, 4 * burst_s(server)), 1))
    cores = engine_cores(server)
    try:
        stays_idle_and_healthy(server, 2 * stall_s)
        streams = Streams(server, 8, max_tokens=3000)
        streams.wait_started()
        working_since = time.monotonic()
        while time.monotonic() - working_since < 1.5:  # streams after an idle spell are not a stall
            assert health(server).status_code == 200
            time.sleep(0.2)
        engine_pids = descendants(server.proc.pid)
        for core in cores:
            core.suspend()
        stopped_at = time.monotonic()
        stalled: httpx.Response | None = None
        while time.monotonic() - stopped_at < stall_s + 5 and server.proc.poll() is None:
            r = health(server)
            if r.status_code == 503:
                stalled = r
                break
            assert r.status_code == 200
            time.sleep(0.2)
        detected_s = time.monotonic() - stopped_at
        assert stalled is not None, f"/health still 200 after {detected_s:.1f} s"
        # Not earlier than the timeout allows: the quiet clock starts at the last output before
        # the stop (an engine step here is ~0.1 s), not at the idle spell before the streams.
        assert detected_s >= stall_s - 1, f"stalled after only {detected_s:.1f} s"
        body = stalled.json()
        assert body["status"] == "stalled" and body["state"] == "stalled"
        assert "8 request(s) pending" in body["reason"], body
        assert httpx.get(server.base_url + "/ready", timeout=5).status_code == 503
        late = httpx.post(server.base_url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and "stalled" in late.json()["error"]["message"]
        streams.join(30)
        assert len(streams.results) == 8
        for outcome, _, chunks in streams.results:
            assert outcome == "error event", (outcome, chunks[-1:])
            assert "stalled" in chunks[-1]["error"]["message"]
        code = server.proc.wait(60)
        assert code == 3
        # Gone soon after (a starved machine takes seconds to reap them; the rule is none left).
        deadline = time.monotonic() + 15
        while (left := [p for p in engine_pids if running(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, [(p, psutil.Process(p).name()) for p in left if psutil.pid_exists(p)]
        log = server.log()
        stall_lines = [line for line in log.splitlines() if "the engine stalled" in line and " ERROR " in line]
        assert len(stall_lines) == 1, stall_lines
        assert "8 request(s) pending" in stall_lines[0]
        assert "exit code 3" in log
        print(f"stall detected after {detected_s:.1f} s (timeout {stall_s} s)")
    finally:
        for core in cores:
            try:
                core.kill()
            except psutil.NoSuchProcess:
                pass
        server.stop(signal.SIGKILL)
