"""Tenant limits that hold across the replicas of `serve --replicas N`.

Each replica is its own gateway, and without `auth.redis_url` each counts its tenants' requests,
tokens and budgets on its own: behind least_conn, a tenant would get up to N times its limits. So
with a keys file and no `auth.redis_url`, the supervisor runs a private redis-server (Debian
package `redis-server`) on a Unix socket only it and its replicas can open, and gives the
replicas its URL; with `auth.redis_url` set, the replicas share that Redis as any instances do.

The private Redis keeps nothing on disk: the budgets' counts start again from the usage store
(one SQLite file in the shared state dir) whenever a replica starts, as they do without Redis.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from server.runner.processes import stop_child

UNIX_PATH_MAX = 100  # sun_path holds 108 bytes on Linux; a longer path goes to a short temp dir


def redis_binary() -> str | None:
    return shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)


def _pong(path: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(1.0)
            sock.connect(str(path))
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class PrivateRedis:
    """redis-server on `<directory>/redis.sock` (mode 0700, no TCP port, no persistence)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.socket_dir = directory
        if len(str(directory / "redis.sock")) > UNIX_PATH_MAX:
            self.socket_dir = Path(tempfile.mkdtemp(prefix="llm-gateway-redis-"))  # created 0700
        self.socket_path = self.socket_dir / "redis.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self, timeout_s: float = 20.0) -> None:
        """Start it and wait for its PONG; RuntimeError (saying why) when it cannot start."""
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("--replicas with a keys file shares the tenants' limits between the replicas through "
                               "Redis: install redis-server (Debian: apt install redis-server), or set auth.redis_url")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        log_path = self.directory / "redis.log"
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [binary, "--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
                 "--dir", str(self.directory), "--save", "", "--appendonly", "no", "--daemonize", "no"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not _pong(self.socket_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start: {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        stop_child(self.proc)
        self.proc = None
        self.socket_path.unlink(missing_ok=True)
        if self.socket_dir != self.directory:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
