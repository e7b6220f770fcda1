"""A scripted OpenAI-compatible streaming server on loopback, for measuring the load tester itself.

Raw asyncio HTTP/1.1 (keep-alive, chunked transfer) in its own thread and event loop, so each
response follows its script exactly: time to first token, gap between tokens, failures after
the 200, abrupt disconnects, multi-byte characters split across writes. Every token write is
time-stamped with the same perf_counter clock the client uses.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["ok", "http_error", "error_event", "disconnect", "no_done"]


@dataclass(frozen=True)
class Script:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    tokens: int = 4
    mode: Mode = "ok"
    fail_after: int = 2  # tokens sent before error_event / disconnect / no_done
    text: str = "tok"
    split_writes: bool = False  # each event in two TCP writes, cut inside its UTF-8 bytes


@dataclass
class Served:
    """What the server did for one request (perf_counter seconds)."""

    body: dict[str, Any]
    headers: dict[str, str]
    received: float
    token_writes: list[float] = field(default_factory=list)


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _event(obj: Any) -> bytes:
    # ensure_ascii=False: non-ASCII text travels as raw UTF-8, as real servers send it.
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class FakeOpenAIServer:
    def __init__(self, script: Callable[[int, dict[str, Any]], Script] | None = None) -> None:
        self.script = script or (lambda n, body: Script())
        self.served: list[Served] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._count = 0
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeOpenAIServer:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            self._server.close()
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-openai", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                raw = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET" and path.endswith("/models"):
                    await self._json(writer, 200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                    continue
                body = json.loads(raw) if raw else {}
                served = Served(body=body, headers=headers, received=time.perf_counter())
                with self._lock:
                    n = self._count
                    self._count += 1
                    self.served.append(served)
                if not await self._respond(writer, self.script(n, body), body, served):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _json(self, writer: asyncio.StreamWriter, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        await writer.drain()

    async def _respond(self, writer: asyncio.StreamWriter, script: Script, body: dict[str, Any], served: Served) -> bool:
        """Returns False when the connection was dropped on purpose."""
        if script.mode == "http_error":
            await self._json(writer, 500, {"error": {"message": "scripted failure", "type": "InternalServerError"}})
            return True
        chat = "messages" in body
        if not body.get("stream"):
            await asyncio.sleep(script.ttft_s + script.itl_s * (script.tokens - 1))
            served.token_writes.append(time.perf_counter())
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": script.text * script.tokens}} if chat
                          else {"text": script.text * script.tokens})
            await self._json(writer, 200, {"choices": [choice], "usage": _usage(body, script.tokens)})
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        if chat:  # role header chunk before any token, as vLLM and OpenAI send it
            writer.write(_chunk(_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})))
        await writer.drain()
        start = served.received
        limit = script.fail_after if script.mode in ("error_event", "disconnect", "no_done") else script.tokens
        for i in range(limit):
            # Absolute deadlines: sleep overshoot does not accumulate over the tokens.
            await asyncio.sleep(max(0.0, start + script.ttft_s + i * script.itl_s - time.perf_counter()))
            delta = {"delta": {"content": script.text}} if chat else {"text": script.text}
            event = _event({"choices": [{"index": 0, **delta, "finish_reason": None}]})
            if script.split_writes:
                cut = len(event) - 6  # inside the text's multi-byte characters when near the end
                writer.write(_chunk(event[:cut]))
                await writer.drain()
                await asyncio.sleep(0.002)
                served.token_writes.append(time.perf_counter())
                writer.write(_chunk(event[cut:]))
            else:
                served.token_writes.append(time.perf_counter())
                writer.write(_chunk(event))
            await writer.drain()
        if script.mode == "disconnect":
            writer.transport.abort()
            return False
        if script.mode == "error_event":
            writer.write(_chunk(_event({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})))
        elif script.mode == "ok" and body.get("stream_options", {}).get("include_usage"):
            writer.write(_chunk(_event({"choices": [], "usage": _usage(body, script.tokens)})))
        if script.mode != "no_done":
            writer.write(_chunk(b"data: [DONE]\n\n"))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


def _usage(body: dict[str, Any], tokens: int) -> dict[str, int]:
    prompt = body.get("prompt")
    n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt or body.get("messages")).split())
    return {"prompt_tokens": n_prompt, "completion_tokens": tokens, "total_tokens": n_prompt + tokens}
