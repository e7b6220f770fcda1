"""End-to-end fixtures: the shipped nginx site in front of real gateways, and a gateway that
speaks sd_notify to a socket the test listens on.

nginx runs as the Debian binary with its own prefix, pid, logs and temp paths under a tmp dir,
on free loopback ports; the shipped files are used verbatim except for the lines a test must
change (listen ports, upstream addresses, the snippet include path, the log directory), and
`render_site` checks that each of those lines is found exactly where expected.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.replicas import front
from tests.conftest import ServerProcess, free_port, start_gateway, wait_ready

NGINX_DIR = front.NGINX_DIR
SITE = front.SITE
SNIPPET = front.SNIPPET
TLS_EXAMPLE = NGINX_DIR / "llm-gateway-tls.conf.example"
SNIPPET_INSTALL_PATH = front.SNIPPET_INSTALL_PATH
SNIPPET_INCLUDE = front.SNIPPET_INCLUDE


def nginx_binary() -> str:
    found = front.nginx_binary()
    if not found:
        pytest.fail("nginx is not installed (CI installs it: .ci/run apt-installs nginx-light)")
    return found


# --------------------------------------------------------------------------------------------
# templating the shipped files


def render_site(
    tmp: Path,
    *,
    upstreams: list[int],
    listen_port: int,
    **site: Any,
) -> str:
    """llm-gateway.conf with test ports; everything else as shipped (server/replicas/front.py, which
    `serve --replicas` uses too; `site`: its other options, e.g. fill_first, count_failures)."""
    return front.render_site(upstreams=upstreams, listen=f"127.0.0.1:{listen_port}",
                             snippet=tmp / "llm-gateway-proxy.conf", log_dir=tmp, **site)


def render_tls(tmp: Path, *, https_port: int, http_port: int, cert: Path, key: Path) -> str:
    text = TLS_EXAMPLE.read_text()
    text = front.replace_exactly(text, "    listen 443 ssl http2;\n", f"    listen 127.0.0.1:{https_port} ssl http2;\n", 1, "listen 443")
    text = front.replace_exactly(text, "    listen [::]:443 ssl http2;\n", "", 1, "listen ipv6 443")
    text = front.replace_exactly(text, "    listen 80;\n", f"    listen 127.0.0.1:{http_port};\n", 1, "listen 80")
    text = front.replace_exactly(text, "    listen [::]:80;\n", "", 1, "listen ipv6 80")
    text = front.replace_exactly(text, "/etc/letsencrypt/live/llm.example.com/fullchain.pem", str(cert), 1, "cert")
    text = front.replace_exactly(text, "/etc/letsencrypt/live/llm.example.com/privkey.pem", str(key), 1, "key")
    text = front.replace_exactly(text, SNIPPET_INCLUDE, f"include {tmp}/llm-gateway-proxy.conf;", 1, "snippet")
    text = front.replace_exactly(text, "/var/log/nginx/", f"{tmp}/", 1, "log dir")
    return text


def write_wrapper(tmp: Path, site_files: list[str]) -> Path:
    """A minimal nginx.conf (what Debian's /etc/nginx/nginx.conf provides) including the site."""
    return front.write_nginx_conf(tmp, site_files)


def nginx_test(tmp: Path, conf: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [nginx_binary(), "-t", "-p", str(tmp), "-c", str(conf)], capture_output=True, text=True, timeout=30
    )


@dataclass
class Nginx:
    tmp: Path
    conf: Path
    port: int
    proc: subprocess.Popen[bytes]
    extra_ports: dict[str, int] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def access_log(self) -> str:
        path = self.tmp / "llm-gateway.access.log"
        return path.read_text() if path.exists() else ""

    def error_log(self) -> str:
        path = self.tmp / "error.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            subprocess.run([nginx_binary(), "-s", "quit", "-p", str(self.tmp), "-c", str(self.conf)],
                           capture_output=True, timeout=10)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(10)


def start_nginx(tmp: Path, upstreams: list[int], *, tls: dict[str, Path] | None = None, **site: Any) -> Nginx:
    """The shipped site (and optionally the TLS example) on free loopback ports, nginx in the
    foreground; `site`: render_site's options (as `serve --replicas` renders it)."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (tmp / "llm-gateway.conf").write_text(render_site(tmp, upstreams=upstreams, listen_port=port, **site))
    sites = [str(tmp / "llm-gateway.conf")]
    extra: dict[str, int] = {}
    if tls:
        extra = {"https": free_port(), "redirect": free_port()}
        (tmp / "llm-gateway-tls.conf").write_text(
            render_tls(tmp, https_port=extra["https"], http_port=extra["redirect"], cert=tls["cert"], key=tls["key"]))
        sites.append(str(tmp / "llm-gateway-tls.conf"))
    conf = write_wrapper(tmp, sites)
    checked = nginx_test(tmp, conf)
    assert checked.returncode == 0, checked.stderr
    log = (tmp / "nginx.out").open("wb")
    proc = subprocess.Popen([nginx_binary(), "-p", str(tmp), "-c", str(conf), "-g", "daemon off;"],
                            stdout=log, stderr=subprocess.STDOUT)
    nginx = Nginx(tmp, conf, port, proc, extra)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited {proc.returncode}: {(tmp / 'error.log').read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return nginx
        except OSError:
            time.sleep(0.05)
    nginx.stop()
    raise TimeoutError("nginx did not listen")


def port_of(server: ServerProcess) -> int:
    """The port of a gateway fixture (also one given by LLM_GATEWAY_TEST_URL, which has no .port)."""
    port = httpx.URL(server.base_url).port
    assert port is not None, server.base_url
    return port


@pytest.fixture(scope="session")
def nginx_single(gateway: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    """The shipped site with the session gateway as its only upstream."""
    nginx = start_nginx(tmp_path_factory.mktemp("nginx-single"), [port_of(gateway)])
    yield nginx
    nginx.stop()


# --------------------------------------------------------------------------------------------
# a gateway with NOTIFY_SOCKET


@dataclass
class Notification:
    at: float  # time.monotonic() on receipt
    pid: int  # sender, from SCM_CREDENTIALS
    fields: dict[str, str]
    raw: str
    ready_status: int | None = None  # GET /ready, made on receipt of READY=1


class NotifyListener:
    """A datagram socket like systemd's: records every message with its sender's pid.

    On READY=1 it asks the server's /ready at once, before reading on: systemd would consider
    the service started at that moment, so /ready must already answer 200.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.settimeout(0.2)
        self.messages: list[Notification] = []
        self.base_url: str | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        creds_size = socket.CMSG_SPACE(12)  # struct ucred: pid, uid, gid
        while not self._stop:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(4096, creds_size)
            except TimeoutError:
                continue
            except OSError:
                return
            pid = -1
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = int.from_bytes(payload[:4], "little")
            raw = data.decode()
            fields = dict(line.split("=", 1) for line in raw.split("\n") if "=" in line)
            note = Notification(time.monotonic(), pid, fields, raw)
            if fields.get("READY") == "1" and self.base_url:
                try:
                    note.ready_status = httpx.get(self.base_url + "/ready", timeout=5).status_code
                except httpx.HTTPError:
                    note.ready_status = -1
            with self._cond:
                self.messages.append(note)
                self._cond.notify_all()

    def wait_for(self, key: str, value: str, *, after: int = 0, timeout: float = 60) -> tuple[int, Notification]:
        """The first message from index `after` on with key=value: (index, message)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, note in enumerate(self.messages[after:], start=after):
                    if note.fields.get(key) == value:
                        return i, note
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {key}={value} after message {after}: {[m.raw for m in self.messages]}")
                self._cond.wait(left)

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


@dataclass
class NotifiedGateway:
    server: ServerProcess
    listener: NotifyListener
    ready_polls: list[tuple[float, int]]  # (time, /ready status) seen while it started
    tmp: Path
    watchdog_usec: int


WATCHDOG_USEC = 2_000_000  # WatchdogSec=2: pings expected every second


def launch_notified_gateway(tmp: Path, env: dict[str, str] | None = None) -> NotifiedGateway:
    """`llm-gateway serve` with NOTIFY_SOCKET (and WATCHDOG_USEC), as systemd would start it."""
    tmp.mkdir(parents=True, exist_ok=True)
    listener = NotifyListener(tmp / "notify.sock")
    server = start_gateway(
        tmp, wait=False,
        env={"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": str(WATCHDOG_USEC), **(env or {})},
    )
    listener.base_url = server.base_url
    polls: list[tuple[float, int]] = []
    deadline = time.monotonic() + 420  # ~40 s alone; much more on a shared, busy CPU
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        try:
            status = httpx.get(server.base_url + "/ready", timeout=2).status_code
            polls.append((time.monotonic(), status))
            if status == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    wait_ready(server, timeout=5)
    return NotifiedGateway(server, listener, polls, tmp, WATCHDOG_USEC)


@pytest.fixture(scope="session")
def notified_gateway(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NotifiedGateway]:
    """A second gateway process, started with NOTIFY_SOCKET: the notify tests watch it, and the
    nginx and observability tests use it as their second instance (before the notify tests stop
    it). Its own stall rule is off (health.stall_timeout_s: 0), so the watchdog test can show
    that WatchdogSec= alone catches a stopped engine."""
    gw = launch_notified_gateway(tmp_path_factory.mktemp("notified"), env={"LLM_GATEWAY_HEALTH__STALL_TIMEOUT_S": "0"})
    yield gw
    gw.server.stop()
    gw.listener.close()
