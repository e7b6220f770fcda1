"""Incremental Server-Sent Events decoder.

Network chunks split anywhere: inside a multi-byte UTF-8 character, inside a line, between the
`\\r` and `\\n` of a line end. Bytes go through an incremental UTF-8 decoder first, then complete
lines are parsed; only complete events (ended by a blank line) come out.
"""

from __future__ import annotations

import codecs


class SSEDecoder:
    """Feed bytes, get the `data` payloads of the events completed so far."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._pending += self._utf8.decode(chunk)
        return self._drain_lines()

    def close(self) -> list[str]:
        """End of stream: an event without its closing blank line still counts (lenient, like browsers do not)."""
        self._pending += self._utf8.decode(b"", final=True)
        events = self._drain_lines()
        if self._pending:
            self._line(self._pending)
            self._pending = ""
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _drain_lines(self) -> list[str]:
        events: list[str] = []
        while (end := self._pending.find("\n")) >= 0:
            line = self._pending[:end].removesuffix("\r")
            self._pending = self._pending[end + 1:]
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            else:
                self._line(line)
        return events

    def _line(self, line: str) -> None:
        if line.startswith(":"):
            return  # comment / keep-alive ping
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
