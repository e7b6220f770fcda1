"""sd_notify as systemd sees it: the real gateway started with NOTIFY_SOCKET pointing at a
datagram socket the test listens on (tests/e2e/conftest.NotifyListener), with the sender's pid
taken from SCM_CREDENTIALS the way systemd checks NotifyAccess=main.

These tests run after the nginx and observability tests (file order), which use the same process
as their second instance; the last one here stops it.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import SERVED_NAME, descendants, engine_core_processes, kill_tree
from tests.e2e.conftest import NotifiedGateway, NotifyListener, launch_notified_gateway


def alive(gw: NotifiedGateway) -> bool:
    return gw.server.proc.poll() is None


def wait_for_live(gw: NotifiedGateway, key: str, value: str, *, after: int, timeout: float):
    """NotifyListener.wait_for, failing at once (with the log) if the process exits meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return gw.listener.wait_for(key, value, after=after, timeout=1)
        except TimeoutError:
            if not alive(gw):
                pytest.fail(f"the gateway exited with {gw.server.proc.returncode} before {key}={value}; "
                            f"messages: {[m.raw for m in gw.listener.messages[after:]]}\n{gw.server.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise


def test_ready_is_sent_once_serving_and_only_then(notified_gateway: NotifiedGateway) -> None:
    gw = notified_gateway
    index, ready = gw.listener.wait_for("READY", "1", timeout=10)
    first = gw.listener.messages[0]
    assert first.fields == {"STATUS": "starting the engine"}, first.raw
    assert all("READY" not in m.fields for m in gw.listener.messages[:index])
    # At the moment READY=1 arrived, /ready already answered 200 ...
    assert ready.ready_status == 200
    assert ready.fields["STATUS"].startswith(f"serving {SERVED_NAME} on http://127.0.0.1:{gw.server.port}")
    # ... and before it, while the engine loaded, the HTTP server was up and said 503.
    assert any(status == 503 and at < ready.at for at, status in gw.ready_polls), gw.ready_polls
    # Every message came from the main process: NotifyAccess=main is enough.
    assert {m.pid for m in gw.listener.messages} == {gw.server.proc.pid}


def test_watchdog_pings_every_half_watchdog_interval(notified_gateway: NotifiedGateway) -> None:
    gw = notified_gateway
    start = len(gw.listener.messages)
    i, a = wait_for_live(gw, "WATCHDOG", "1", after=start, timeout=5)
    _, b = wait_for_live(gw, "WATCHDOG", "1", after=i + 1, timeout=5)
    interval = b.at - a.at
    assert abs(interval - gw.watchdog_usec / 1e6 / 2) < 0.5, interval


def test_reload_sends_reloading_then_ready(notified_gateway: NotifiedGateway) -> None:
    """SIGHUP (what ExecReload= sends): RELOADING=1 with MONOTONIC_USEC, then READY=1 once the
    gateway serves again (/ready 200 at that moment), and completions answer afterwards."""
    gw = notified_gateway
    assert alive(gw)
    start = len(gw.listener.messages)
    children = descendants(gw.server.proc.pid)
    gw.server.proc.send_signal(signal.SIGHUP)
    try:
        i, reloading = wait_for_live(gw, "RELOADING", "1", after=start, timeout=30)
        assert "MONOTONIC_USEC" in reloading.fields
        assert all("READY" not in m.fields for m in gw.listener.messages[start:i])
        _, ready = wait_for_live(gw, "READY", "1", after=i + 1, timeout=300)
        assert ready.ready_status == 200
        assert reloading.pid == ready.pid == gw.server.proc.pid
        resp = httpx.post(gw.server.base_url + "/v1/completions", timeout=60,
                          json={"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 4})
        assert resp.status_code == 200, resp.text
    finally:
        if not alive(gw):  # died on SIGHUP: its engine process may be left orphaned; end it
            for pid in children:
                kill_tree(pid)


@pytest.mark.timing
def test_watchdog_pings_follow_engine_progress(notified_gateway: NotifiedGateway) -> None:
    """With the gateway's own stall rule off (health.stall_timeout_s: 0), WatchdogSec= still
    catches a stall: pings go on through the engine start (a long first start cannot trip the
    watchdog; TimeoutStartSec bounds it) and while requests stream, stop while the engine core is
    stopped (SIGSTOP) with requests pending, and resume once it moves again."""
    gw = notified_gateway
    assert alive(gw)
    interval = gw.watchdog_usec / 1e6 / 2
    cores = engine_core_processes(gw.server.proc.pid)
    try:
        ready_index, ready = gw.listener.wait_for("READY", "1", timeout=10)
        messages = gw.listener.messages
        start_s = ready.at - messages[0].at
        pings_in_start = [m for m in messages[:ready_index] if m.fields.get("WATCHDOG") == "1"]
        assert len(pings_in_start) >= int(start_s / interval) - 1, (start_s, len(pings_in_start))

        results: list[str] = []

        def stream(i: int) -> None:
            body = {"model": SERVED_NAME, "prompt": f"Tell story {i}.", "max_tokens": 200, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", gw.server.base_url + "/v1/completions", json=body, timeout=120) as r:
                results.append(r.read().decode().rstrip()[-12:])

        workers = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for w in workers:
            w.start()
        time.sleep(2.0)  # streaming: pings go on
        before = len(gw.listener.messages)
        for core in cores:
            core.suspend()
        stopped_at = time.monotonic()
        try:
            time.sleep(7.0)
            health = httpx.get(gw.server.base_url + "/health", timeout=5)
        finally:
            for core in cores:
                core.resume()
        resumed_at = time.monotonic()
        pings = [m.at - stopped_at for m in gw.listener.messages[before:] if m.fields.get("WATCHDOG") == "1"]
        # At most the pings of the first ~2 intervals (quiet < one interval), none after.
        assert not [t for t in pings if 2 * interval + 0.5 < t < resumed_at - stopped_at], pings
        assert health.status_code == 200  # the rule is off: only the watchdog notices
        _, resumed = wait_for_live(gw, "WATCHDOG", "1", after=len(gw.listener.messages), timeout=5)
        assert resumed.at - resumed_at < 3 * interval
        for w in workers:
            w.join(120)
        assert results == ["data: [DONE]"] * 4, results
    finally:
        for core in cores:
            try:
                core.resume()
            except Exception:
                pass


def test_stopping_on_sigterm_while_a_request_drains(
    notified_gateway: NotifiedGateway, tmp_path: Path
) -> None:
    """SIGTERM (what `systemctl stop` sends to the main process, KillMode=mixed): STOPPING=1 at once,
    /ready turns 503, the in-flight stream still completes, the process exits 0."""
    gw = notified_gateway
    relaunched = None
    if not alive(gw):  # the reload test's SIGHUP ended it (no reload support): start another
        relaunched = gw = launch_notified_gateway(tmp_path / "relaunched")
    try:
        result: dict[str, object] = {}

        def stream() -> None:
            body = {"model": SERVED_NAME, "prompt": "Tell a story.", "max_tokens": 48, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", gw.server.base_url + "/v1/completions", json=body, timeout=120) as r:
                result["status"] = r.status_code
                result["body"] = r.read().decode()

        start = len(gw.listener.messages)
        worker = threading.Thread(target=stream)
        worker.start()
        time.sleep(1.0)  # the request is generating (48 tokens take ~3 s here)
        signalled = time.monotonic()
        gw.server.proc.send_signal(signal.SIGTERM)
        _, stopping = gw.listener.wait_for("STOPPING", "1", after=start, timeout=10)
        assert stopping.at - signalled < 2.0
        assert stopping.pid == gw.server.proc.pid
        assert httpx.get(gw.server.base_url + "/ready", timeout=5).status_code == 503
        worker.join(120)
        assert result.get("status") == 200
        assert str(result["body"]).rstrip().endswith("data: [DONE]")
        assert gw.server.proc.wait(60) == 0
    finally:
        if relaunched is not None:
            relaunched.server.stop()
            relaunched.listener.close()


def test_listener_sees_credentials(tmp_path: Path) -> None:
    """The test's stand-in for systemd reads the sender pid like systemd does (sanity check)."""
    import os
    import socket

    listener = NotifyListener(tmp_path / "n.sock")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"READY=1\nSTATUS=x", str(listener.path))
        _, note = listener.wait_for("READY", "1", timeout=5)
        assert note.pid == os.getpid() and note.fields == {"READY": "1", "STATUS": "x"}
    finally:
        listener.close()
