"""systemd's notify protocol (`sd_notify`), implemented here in a few lines.

A datagram of `KEY=VALUE` lines sent to the Unix socket named by `$NOTIFY_SOCKET` (a path, or
`@name` for the abstract namespace). No library: python-systemd needs libsystemd headers to
build and sdnotify is unmaintained; the protocol is stable and tiny. Without `NOTIFY_SOCKET`
every call is a no-op, so the server runs the same outside systemd.
"""

from __future__ import annotations

import logging
import os
import socket
import time

logger = logging.getLogger("llm_gateway.notify")


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *lines: str) -> None:
        if self._sock is None or not self.address:
            return
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            self._sock.sendto("\n".join(lines).encode(), target)
        except OSError as exc:  # systemd gone or socket full: never fatal for serving
            logger.debug("sd_notify failed: %s", exc)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def reloading(self, status: str) -> None:
        # MONOTONIC_USEC lets systemd >= 253 match the reload; older versions ignore it.
        usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1_000_000)
        self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def watchdog_interval_s(self) -> float | None:
        """Half of systemd's WatchdogSec, when the watchdog is on for this process."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 1_000_000 / 2
        except ValueError:
            return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
