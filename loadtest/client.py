"""Send one request to an OpenAI-compatible endpoint and measure it (TTFT, chunk gaps, E2E, usage)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from loadtest.records import RequestRecord, RequestSpec
from loadtest.sse import SSEDecoder

Api = Literal["completions", "chat"]


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    model: str
    api: Api = "completions"
    stream: bool = True
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return base + ("/chat/completions" if self.api == "chat" else "/completions")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": spec.max_tokens,
                                "temperature": self.temperature, "stream": self.stream}
        if self.api == "chat":
            body["messages"] = spec.messages or [{"role": "user", "content": _as_text(spec.prompt)}]
        else:
            body["prompt"] = spec.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            # Fixed output length makes runs comparable. Not min_tokens as well: its logits
            # processor costs vLLM's CPU engine ~30% throughput, and `vllm bench` sends only this.
            body["ignore_eos"] = True
        body.update(self.extra_body or {})
        return body


def _as_text(prompt: str | list[int]) -> str:
    if isinstance(prompt, str):
        return prompt
    raise ValueError("the chat endpoint needs text prompts: pass --tokenizer or use /v1/completions")


def _error_message(payload: Any) -> str:
    if isinstance(payload, dict):
        err = payload.get("error", payload)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(payload)


def _carries_token(choice: dict[str, Any], api: Api) -> bool:
    if api == "completions":
        # Like `vllm bench serve`: any choice chunk is a token step (text may be empty for special tokens).
        return True
    delta = choice.get("delta") or {}
    # The chat role header chunk carries no token; counting it would flatter TTFT.
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                or delta.get("tool_calls"))


def _text_length(choice: dict[str, Any]) -> int:
    """Characters of text a choice (a streamed chunk or a whole answer) carries."""
    text = choice.get("text")
    if isinstance(text, str):  # completions: the common case first, as this runs once per event
        return len(text)
    part = choice.get("delta") or choice.get("message") or {}
    pieces = [part.get("content"), part.get("reasoning_content") or part.get("reasoning")]
    pieces += [(call.get("function") or {}).get("arguments") for call in part.get("tool_calls") or ()]
    return sum(len(p) for p in pieces if isinstance(p, str))


class _StreamState:
    """Accumulates one streamed response; `error` set means the request failed."""

    def __init__(self, record: RequestRecord, start: float, api: Api) -> None:
        self.record = record
        self.start = start
        self.last = start
        self.api = api
        self.done = False

    def event(self, data: str, now: float) -> None:
        rec = self.record
        if data == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            rec.error = rec.error or f"bad SSE payload: {data[:200]!r}"
            return
        if "error" in obj:
            # Servers report failures after the 200 header as an error event (then [DONE]).
            rec.error = rec.error or f"stream error: {_error_message(obj)}"
            return
        choices = obj.get("choices") or []
        if choices and _carries_token(choices[0], self.api):
            if rec.ttft_s is None:
                rec.ttft_s = now - self.start
            else:
                rec.itl_s.append(now - self.last)
            self.last = now
            rec.chunks += 1
            rec.output_chars += _text_length(choices[0])
        if usage := obj.get("usage"):
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.completion_tokens = usage.get("completion_tokens")


async def send_request(client: httpx.AsyncClient, endpoint: Endpoint, spec: RequestSpec,
                       record: RequestRecord, clock_zero: float) -> RequestRecord:
    """Fill `record` with what happened; never raises for server or network failures."""
    record.input_tokens_requested = spec.input_tokens
    record.max_tokens = spec.max_tokens
    try:
        body = endpoint.body(spec)
    except ValueError as exc:
        record.error = str(exc)
        return record
    start = time.perf_counter()
    record.sent_s = start - clock_zero
    state = _StreamState(record, start, endpoint.api)
    try:
        async with client.stream("POST", endpoint.url, json=body, headers=endpoint.headers()) as resp:
            record.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                record.error = f"HTTP {resp.status_code}: {_error_message(_json_or_text(raw))}"
            elif endpoint.stream:
                decoder = SSEDecoder()
                async for chunk in resp.aiter_raw():
                    now = time.perf_counter()
                    for data in decoder.feed(chunk):
                        state.event(data, now)
                for data in decoder.close():
                    state.event(data, time.perf_counter())
                if not state.done and record.error is None:
                    record.error = "stream ended without [DONE]"
            else:
                _fill_plain(record, _json_or_text(await resp.aread()), time.perf_counter() - start)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    record.latency_s = time.perf_counter() - start
    return record


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]


def _fill_plain(record: RequestRecord, payload: Any, elapsed: float) -> None:
    if not isinstance(payload, dict) or "error" in payload or not payload.get("choices"):
        record.error = f"bad response: {_error_message(payload)}"[:500]
        return
    # Without streaming the first token is only seen with the whole answer.
    record.ttft_s = elapsed
    record.chunks = 1
    record.output_chars = _text_length(payload["choices"][0])
    usage = payload.get("usage") or {}
    record.prompt_tokens = usage.get("prompt_tokens")
    record.completion_tokens = usage.get("completion_tokens")
