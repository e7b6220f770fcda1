"""A scripted OpenAI-compatible streaming server on loopback, for measuring the load tester itself.

Raw asyncio HTTP/1.1 (keep-alive, chunked transfer) in its own process, so neither the GIL nor
the client's event loop shifts its timing: each response follows its script (time to first
token, gap between tokens, failures after the 200, abrupt disconnects, multi-byte characters
split across writes). Request i gets scripts[i % len(scripts)]. Token writes are time-stamped
with perf_counter, which is CLOCK_MONOTONIC on Linux and so comparable with the client's clock;
GET /_served returns them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
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


class _Handler:
    """The server side, run by `python -m tests.loadtest.fake_server SCRIPTS_JSON`."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = scripts
        self.served: list[Served] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
                if method == "GET" and path == "/_served":
                    await self._json(writer, 200, [asdict(s) for s in self.served])
                    continue
                body = json.loads(raw) if raw else {}
                served = Served(body=body, headers=headers, received=time.perf_counter())
                script = self.scripts[len(self.served) % len(self.scripts)]
                self.served.append(served)
                if not await self._respond(writer, script, body, served):
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


class FakeOpenAIServer:
    """Client-side handle: starts the server process, reads back what it served."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = scripts
        self.port = 0
        self._proc: subprocess.Popen[str] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeOpenAIServer:
        arg = json.dumps([asdict(s) for s in self.scripts])
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.loadtest.fake_server", arg],
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()  # the server prints its port once it listens
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"fake server did not start: {line!r}")
        self.port = int(line)
        return self

    @property
    def served(self) -> list[Served]:
        import httpx

        rows = httpx.get(self.base_url + "/_served", timeout=10).json()
        return [Served(**row) for row in rows]

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(10)


async def _serve(scripts: list[Script]) -> None:
    handler = _Handler(scripts)
    server = await asyncio.start_server(handler.handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_serve([Script(**s) for s in json.loads(sys.argv[1])]))
