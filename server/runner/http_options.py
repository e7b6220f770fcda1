"""uvicorn's HTTP/1.1 protocol with a cap on the request head (request line + headers).

nginx refuses heads over `large_client_header_buffers` (4 x 8 KiB by default); uvicorn's httptools
protocol has no such limit and buffers a header of any size. The gateway answers a head over
`server.max_header_bytes` with 431 and an OpenAI-shaped body, then closes the connection.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from server.errors import error_body

logger = logging.getLogger("llm_gateway.http")

# While a head is still incomplete, bytes are counted per read; a read may also hold the end of
# the previous request's body, so this guard only bounds memory and stays well above the cap.
_INCOMPLETE_HEAD_FACTOR = 8
_INCOMPLETE_HEAD_MIN = 1024 * 1024


def head_too_large_response(limit: int) -> bytes:
    body = json.dumps(error_body(
        f"Request header fields too large: the request line and headers may hold at most {limit} bytes.",
        431,
    )).encode()
    return (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"connection: close\r\n\r\n" + body
    )


def uvicorn_http_options(max_header_bytes: int) -> dict[str, Any]:
    """`uvicorn.Config` keyword arguments that cap the request head at `max_header_bytes`."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn's h11 protocol has a limit of its own
        return {"http": "h11", "h11_max_incomplete_event_size": max_header_bytes}

    class HeadLimitedProtocol(HttpToolsProtocol):  # type: ignore[misc, valid-type]
        limit = max_header_bytes

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True
            self._incomplete_head_bytes = 0
            self._refused = False

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self._in_head and not self._refused:
                self._incomplete_head_bytes += len(data)
                if self._incomplete_head_bytes > max(_INCOMPLETE_HEAD_MIN, _INCOMPLETE_HEAD_FACTOR * self.limit):
                    self._refuse(self._incomplete_head_bytes)

        def on_headers_complete(self) -> None:
            size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
            if size > self.limit:
                self._refuse(size)
                return
            self._in_head = False
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refused:
                return
            super().on_message_complete()
            self._in_head = True
            self._incomplete_head_bytes = 0

        def _refuse(self, size: int) -> None:
            self._refused = True
            logger.warning("refused a request head of %d bytes or more (limit %d) from %s", size, self.limit,
                           self.client)
            if not self.transport.is_closing():
                self.transport.write(head_too_large_response(self.limit))
                self.transport.close()

    return {"http": HeadLimitedProtocol}
