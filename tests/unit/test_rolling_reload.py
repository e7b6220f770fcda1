"""`llm-gateway reload URL...` (server/lifecycle/rolling_reload.py): instances reloaded one at a
time, each back on /ready before the next, never the last ready one taken out, and a failed
reload stops the roll. The instances here are scripted behind httpx's MockTransport; the e2e
nginx test runs the command against two real gateways."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from server.lifecycle.rolling_reload import RollError, roll
from tests.conftest import ROOT, free_port

A, B, C = "http://a:1", "http://b:2", "http://c:3"


class Instances:
    """Scripted instances: a reload makes its instance unready for `unready_polls` /ready polls."""

    def __init__(self, urls: list[str], unready_polls: int = 2) -> None:
        self.unready = {u: 0 for u in urls}
        self.unready_polls = unready_polls
        self.fail: dict[str, tuple[int, dict]] = {}
        self.events: list[tuple[str, str]] = []
        self.headers: list[httpx.Headers] = []
        self.bodies: list[bytes] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/ready":
            ready = self.unready[url] == 0
            self.unready[url] = max(0, self.unready[url] - 1)
            self.events.append((url, "ready" if ready else "unready"))
            return httpx.Response(200 if ready else 503, json={"ready": ready})
        assert request.method == "POST" and request.url.path == "/admin/reload"
        # no instance is reloaded while another one is not ready
        assert all(n == 0 for u, n in self.unready.items() if u != url), self.unready
        self.events.append((url, "reload"))
        self.headers.append(request.headers)
        self.bodies.append(request.content)
        if url in self.fail:
            status, body = self.fail[url]
            return httpx.Response(status, json=body)
        self.unready[url] = self.unready_polls
        return httpx.Response(200, json={"outcome": "success", "strategy": "in-place", "duration_s": 1.25,
                                         "engine_reloaded": True})

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self.handler))


def test_instances_reload_one_at_a_time_each_ready_before_the_next() -> None:
    inst = Instances([A, B, C])
    lines: list[str] = []
    steps = roll([A, B + "/", C], client=inst.client(), poll_s=0, report=lines.append, admin_key="k")
    assert [s.url for s in steps] == [A, B, C] and all(s.detail.startswith("success") for s in steps)
    reloads = [i for i, (_, what) in enumerate(inst.events) if what == "reload"]
    for before, after in zip(reloads, reloads[1:]):
        # between two reloads, the first instance answered ready again
        url = inst.events[before][0]
        assert (url, "ready") in inst.events[before:after], inst.events
    assert lines[1] == f"[1/3] {A}: success (in-place, 1.2 s), ready after {steps[0].seconds:.1f} s"
    assert all(h["authorization"] == "Bearer k" for h in inst.headers)
    assert inst.bodies == [b""] * 3  # no body: each instance reloads its own profile


def test_the_report_says_how_many_requests_waited_for_a_new_engine() -> None:
    inst = Instances([A, B])
    inst.fail[B] = (200, {"outcome": "success", "strategy": "drain-swap", "duration_s": 17.04, "queued": 3,
                          "max_queue_wait_s": 16.52, "engine_reloaded": True})
    lines: list[str] = []
    roll([A, B], client=inst.client(), poll_s=0, report=lines.append)
    assert lines[1].startswith(f"[1/2] {A}: success (in-place, 1.2 s), ready after"), lines
    assert lines[3].startswith(f"[2/2] {B}: success (drain-swap, 17.0 s, 3 request(s) waited up to 16.5 s), "
                               "ready after"), lines


def test_a_failed_reload_stops_the_roll() -> None:
    inst = Instances([A, B, C])
    inst.fail[B] = (422, {"error": {"message": "reload rolled_back: engine failed to start; the previous "
                                               "profile is serving", "type": "invalid_request_error"}})
    with pytest.raises(RollError, match=r"http://b:2: HTTP 422: reload rolled_back: engine failed.*"
                                        r"remaining instances were not reloaded"):
        roll([A, B, C], client=inst.client(), poll_s=0, report=lambda _: None, config="/etc/x.yaml")
    assert [u for u, what in inst.events if what == "reload"] == [A, B]
    assert inst.bodies[0] == b'{"config":"/etc/x.yaml"}'


def test_the_last_ready_instance_is_never_taken_out() -> None:
    inst = Instances([A, B])
    inst.unready[B] = 10**6  # B is down
    with pytest.raises(RollError, match=r"not reloading http://a:1: http://b:2 not ready"):
        roll([A, B], client=inst.client(), poll_s=0, report=lambda _: None)
    assert not [e for e in inst.events if e[1] == "reload"]


def test_an_instance_that_does_not_come_back_stops_the_roll() -> None:
    inst = Instances([A, B], unready_polls=10**6)
    with pytest.raises(RollError, match=r"http://a:1: reloaded .* but not ready after 0 s"):
        roll([A, B], client=inst.client(), poll_s=0, ready_timeout_s=0, report=lambda _: None)


def test_the_command_names_an_unreachable_instance_and_exits_1() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-m", "server", "reload", url], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 1
    assert f"reload: {url}: reload request failed (ConnectError" in done.stderr
    assert "Traceback" not in done.stderr
