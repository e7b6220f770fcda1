"""A scripted engine behind the `Engine` Protocol, for fast tests of the HTTP layer only."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.engine import (
    ChoiceOutput,
    EngineInfo,
    EngineProgress,
    GenerationOutput,
    ParsedToolCall,
    SamplingOptions,
    TokenLogprob,
    ToolCallExtraction,
)
from server.engine.tool_call_prefix import CallPrefixes
from server.errors import EngineDeadError, InvalidRequestError, ServiceUnavailableError


@dataclass
class FakeToolParser:
    """Hermes-like: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` is a call.
    `own_syntax`: like gemma4, required/named are read from this syntax, not forced into JSON."""

    own_syntax: bool = False
    start_marker: str | None = "<tool_call>"

    @property
    def forced_by_schema(self) -> bool:
        return not self.own_syntax

    @property
    def strips_calls_without_tools(self) -> bool:
        return self.own_syntax

    structured: dict[str, Any] | None = None
    skip_special_tokens: bool = False

    def extract(self, text: str) -> ToolCallExtraction:
        parts = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
        if not parts:
            return ToolCallExtraction(content=text, calls=[])
        calls = [json.loads(p) for p in parts]
        content = text[: text.index("<tool_call>")] or None
        return ToolCallExtraction(content=content, calls=[
            ParsedToolCall("", c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls])

    def call_prefixes(self) -> CallPrefixes:
        """Calls while they are written, read as vLLM's hermes syntax (this parser's)."""
        return CallPrefixes("hermes", lambda text: self.extract(text).calls)


class FakeReasoningParser:
    """`<think>reasoning</think>content`; streamed, a trailing piece that may begin a marker
    waits for the next delta (as vLLM's parsers hold a split marker back)."""

    keeps_special_tokens: bool = True
    START, END = "<think>", "</think>"

    made: list[FakeReasoningParser] = []  # every parser the fake engines gave out, newest last

    def __init__(self) -> None:
        self.text = ""
        self.sent = ("", "")
        self.ended_on_stop_token = False
        FakeReasoningParser.made.append(self)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if not text.startswith(self.START):
            return ("", "") if not final and self.START.startswith(text) else ("", text)
        body = text[len(self.START):]
        if self.END in body:
            reasoning, content = body.split(self.END, 1)
            return reasoning, content
        if not final:
            body = next((body[:-k] for k in range(len(self.END) - 1, 0, -1)
                         if body.endswith(self.END[:k])), body)
        return body, ""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self._split(text, True)
        return reasoning or None, content or None

    def stream(self, delta_text: str, delta_token_ids: Sequence[int], *, finished: bool = False,
               ended_on_stop_token: bool = False) -> tuple[str | None, str | None]:
        self.ended_on_stop_token = ended_on_stop_token
        self.text += delta_text
        reasoning, content = self._split(self.text, finished)
        out = (reasoning[len(self.sent[0]):] or None, content[len(self.sent[1]):] or None)
        self.sent = (reasoning, content)
        return out


@dataclass
class FakeEngine:
    """Echoes words: token i of the output is the word `w{i}`; fails on request when told to."""

    info: EngineInfo = field(default_factory=lambda: EngineInfo(
        served_model_name="fake", model_path="/fake", max_model_len=64, vocab_size=1000,
        vllm_version="0.0-fake", max_logprobs=5, kv_sharing_fast_prefill=False))
    delay_s: float = 0.0
    fail_after: int | None = None
    dead: bool = False
    aborted: list[str] = field(default_factory=list)
    running: int = 0
    abort_message: str | None = None
    closed: bool = False
    stalled: bool = False  # True: generation waits without output (a stopped engine core)
    last_output_at: float = 0.0
    busy_since: float = 0.0
    paused: bool = False
    weights_loaded: list[str] = field(default_factory=list)  # paths, in order
    fail_weights: set[str] = field(default_factory=set)  # paths whose reload raises
    reload_delay_s: float = 0.0
    weights_prefetched: list[str] = field(default_factory=list)
    reply: str | None = None  # set: every completion is this text, finish "stop" (two pieces when streamed)
    reply_pieces: list[str] | None = None  # set: streamed as these deltas (one per token), joined otherwise
    rendered_tools: list[Any] = field(default_factory=list)  # `tools` of each render_chat call
    sampled: list[SamplingOptions] = field(default_factory=list)  # options of each make_sampling call

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return [len(w) % 1000 for w in text.split()]

    def decode(self, token_ids: Sequence[int]) -> str:
        return " ".join(f"t{t}" for t in token_ids)

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                    continue_final_message: bool, tools: list[dict[str, Any]] | None = None) -> str:
        self.rendered_tools.append(tools)
        return " ".join(f"{m['role']}: {m['content']}" for m in messages) + (" assistant:" if add_generation_prompt else "")

    def make_sampling(self, options: SamplingOptions) -> SamplingOptions:
        self.sampled.append(options)
        if options.temperature < 0:
            raise InvalidRequestError("temperature must be non-negative", param="temperature")
        return options

    def tool_parser(self, tools: list[dict[str, Any]], tool_choice: Any,
                    parallel_tool_calls: bool | None, response_format: dict[str, Any] | None = None) -> FakeToolParser:
        assert self.info.tool_call_parser, "tool_parser asked of an engine without one"
        return FakeToolParser(own_syntax=self.info.tool_call_parser == "own-syntax")

    def reasoning_parser(self, prompt_token_ids: Sequence[int]) -> FakeReasoningParser | None:
        return FakeReasoningParser() if self.info.reasoning_parser else None

    def tool_choice_schema(self, tools: list[dict[str, Any]], tool_choice: Any,
                           parallel_tool_calls: bool | None) -> dict[str, Any] | None:
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            return next(t["function"].get("parameters") or {"type": "object"}
                        for t in tools if t["function"]["name"] == name)
        return {"type": "array", "minItems": 1} if tool_choice == "required" else None

    async def _reply(self, request_id: str, prompt_token_ids: list[int], sampling: Any,
                     reply: str) -> AsyncIterator[GenerationOutput]:
        pieces = [reply[: len(reply) // 2], reply[len(reply) // 2:]] if sampling.stream else [reply]
        if self.reply_pieces is not None:
            pieces = list(self.reply_pieces) if sampling.stream else ["".join(self.reply_pieces)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            ids, logprobs = [i], None
            if self.reply_pieces is not None:  # one token per piece, each with a logprob when asked
                ids = list(range(len(self.reply_pieces))) if not sampling.stream else [i]
                texts = self.reply_pieces if not sampling.stream else [piece]
                if sampling.logprobs is not None:
                    logprobs = [TokenLogprob(t, text, -0.5, []) for t, text in zip(ids, texts, strict=True)]
            choices = [ChoiceOutput(k, piece, ids, logprobs, "stop" if last else None, None)
                       for k in range(sampling.n)]
            yield GenerationOutput(request_id, prompt_token_ids, None, choices, last)

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: Any) -> AsyncIterator[GenerationOutput]:
        if self.reply is not None or self.reply_pieces is not None:
            async for out in self._reply(request_id, prompt_token_ids, sampling, self.reply or ""):
                yield out
            return
        if self.running == 0:
            self.busy_since = time.monotonic()
        self.running += 1
        finished = False
        try:
            n = sampling.max_tokens
            for i in range(n):
                while (self.stalled or self.paused) and self.abort_message is None:
                    await asyncio.sleep(0.01)
                if self.abort_message is not None:
                    raise ServiceUnavailableError(self.abort_message)
                self.last_output_at = time.monotonic()
                if self.fail_after is not None and i >= self.fail_after:
                    raise EngineDeadError("scripted engine failure")
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == n - 1
                if sampling.stream:
                    choices = [ChoiceOutput(k, f" w{i}", [i], None, "length" if last else None, None)
                               for k in range(sampling.n)]
                    finished = last
                    yield GenerationOutput(request_id, prompt_token_ids, None, choices, last)
            if not sampling.stream:
                text = "".join(f" w{i}" for i in range(n))
                choices = [ChoiceOutput(k, text, list(range(n)), None, "length", None) for k in range(sampling.n)]
                finished = True
                yield GenerationOutput(request_id, prompt_token_ids, None, choices, True)
        finally:
            self.running -= 1
            if not finished:
                self.aborted.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def abort_all(self, message: str) -> int:
        self.abort_message = message
        return self.running

    def is_dead(self) -> bool:
        return self.dead

    def progress(self) -> EngineProgress:
        quiet = time.monotonic() - max(self.last_output_at, self.busy_since) if self.running else 0.0
        return EngineProgress(self.running, quiet, self.last_output_at)

    async def num_unfinished_requests(self) -> int:
        return self.running

    async def pause_generation(self) -> None:
        self.paused = True

    async def prefetch_weights(self, weights_path: str, timeout_s: float) -> str | None:
        assert not self.paused, "weights prefetched while the engine was paused"
        self.weights_prefetched.append(weights_path)
        return None

    async def reload_weights(self, weights_path: str) -> None:
        assert self.paused, "weights reloaded while the engine was not paused"
        await asyncio.sleep(self.reload_delay_s)
        if weights_path in self.fail_weights:
            raise RuntimeError(f"scripted weight reload failure: {weights_path}")
        self.weights_loaded.append(weights_path)

    async def resume_generation(self) -> None:
        self.paused = False

    async def shutdown(self) -> None:
        self.closed = True
