"""The replicas' front door (server/replicas/front.py) in real nginx, over two scripted upstreams
that hold each request until told to answer, so the test knows what every replica has open:

- `server.replicas_fill_first`: the first replica takes requests until it has that many open, the
  overflow goes to the other one (`max_conns` counted in the upstream's zone, across nginx's
  workers), a lone request always goes to the first, and a first replica that is gone sends its
  requests on to the other;
- a replica that refuses with 503 (a reloading replica: the supervisor gives each one a reload
  queue of 0) has each request sent on to the other one, is not counted as failed (`max_fails=0`),
  and gets the next request again once it answers.

The whole supervisor (real gateways, real engines, the rolling reload under load) runs in
test_replicas.py; this checks the routing rules themselves, where counting matters."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_for
from tests.e2e.conftest import Nginx, start_nginx

FILL = 3


class Upstream:
    """A loopback HTTP server standing in for one replica: each POST waits until `release` is set
    (at most 30 s), then answers `status` (200) with this upstream's port."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.status = 200
        self.arrived = 0
        self.open = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    outer.arrived += 1
                    outer.open += 1
                try:
                    outer.release.wait(30)
                    body = json.dumps({"port": outer.port}).encode()
                    self.send_response(outer.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                finally:
                    with lock:
                        outer.open -= 1

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def start_front(tmp: Path, ups: tuple[Upstream, Upstream]) -> Nginx:
    """nginx with the site over the upstreams as the replicas' supervisor renders it (fill-first, no
    failure counting; per-client limits off, as for a load test from one address)."""
    return start_nginx(tmp, [u.port for u in ups], fill_first=FILL, count_failures=False, client_limits=False)


@pytest.fixture
def upstreams() -> Iterator[tuple[Upstream, Upstream]]:
    first, second = Upstream(), Upstream()
    yield first, second
    first.close()
    second.close()


def post(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=60)


class Held:
    """Requests sent one at a time, each left open (its upstream holds it) before the next goes."""

    def __init__(self, url: str, ups: tuple[Upstream, ...]) -> None:
        self.url, self.ups = url, ups
        self.threads: list[threading.Thread] = []
        self.answers: list[httpx.Response] = []

    def send(self, count: int) -> None:
        for _ in range(count):
            before = sum(u.arrived for u in self.ups)
            thread = threading.Thread(target=lambda: self.answers.append(post(self.url)), daemon=True)
            thread.start()
            self.threads.append(thread)
            assert wait_for(lambda: sum(u.arrived for u in self.ups) == before + 1, timeout=10, interval=0.01)

    def finish(self) -> list[int]:
        for u in self.ups:
            u.release.set()
        for thread in self.threads:
            thread.join(30)
        assert all(r.status_code == 200 for r in self.answers), [r.text for r in self.answers]
        return [r.json()["port"] for r in self.answers]


def test_fill_first_fills_the_first_replica_then_spills(tmp_path: Path, upstreams: tuple[Upstream, Upstream]) -> None:
    first, second = upstreams
    nginx = start_front(tmp_path, upstreams)
    url = nginx.base_url
    try:
        lines = [ln.strip() for ln in (tmp_path / "llm-gateway.conf").read_text().splitlines() if "server 127" in ln]
        assert lines == [f"server 127.0.0.1:{first.port} max_fails=0 max_conns={FILL};",
                         f"server 127.0.0.1:{second.port} max_fails=0 backup;"], lines
        # one request at a time: always the first replica (least_conn would alternate)
        first.release.set()
        second.release.set()
        assert {post(url).json()["port"] for _ in range(6)} == {first.port}
        first.release.clear()
        second.release.clear()
        # open requests: the first FILL on the first replica, the rest on the other one
        held = Held(url, upstreams)
        held.send(FILL)
        assert (first.open, second.open) == (FILL, 0)
        held.send(2)
        assert (first.open, second.open) == (FILL, 2)
        ports = held.finish()
        assert sorted(ports) == sorted([first.port] * FILL + [second.port] * 2)
        # once the first has room again, it takes the next request
        first.release.clear()
        held = Held(url, upstreams)
        held.send(1)
        assert (first.open, second.open) == (1, 0)
        held.finish()
        # the first replica gone (connection refused): its requests go to the other one, none fails
        first.close()
        assert {post(url).json()["port"] for _ in range(4)} == {second.port}
    finally:
        nginx.stop()


def test_a_refusing_first_replica_sends_its_requests_to_the_other(
        tmp_path: Path, upstreams: tuple[Upstream, Upstream]) -> None:
    first, second = upstreams
    nginx = start_front(tmp_path, upstreams)
    url = nginx.base_url
    try:
        first.release.set()
        second.release.set()
        first.status = 503  # reloading
        answers = [post(url) for _ in range(6)]
        assert [r.status_code for r in answers] == [200] * 6
        assert {r.json()["port"] for r in answers} == {second.port}
        # each request asked the first replica, and none of its refusals left it out
        assert first.arrived == 6, first.arrived
        first.status = 200  # its new engine serves: the very next request is its
        assert post(url).json()["port"] == first.port
    finally:
        nginx.stop()
