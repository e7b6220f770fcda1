"""A real redis-server (Debian package `redis-server`) for the tests: its own free loopback port and
temp directory, no persistence, stopped by the test that started it."""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from server.replicas import shared_limits
from server.runner.processes import stop_child
from tests.conftest import free_port


def redis_binary() -> str:
    found = shared_limits.redis_binary()
    if not found:
        pytest.fail("redis-server is not installed (CI installs it: .ci/run apt-installs redis-server)")
    return found


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        log = (self.directory / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start:\n{(self.directory / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        stop_child(self.proc)
        self.proc = None


def start_redis(directory: Path) -> RedisServer:
    directory.mkdir(parents=True, exist_ok=True)
    return RedisServer(free_port(), directory).start()
