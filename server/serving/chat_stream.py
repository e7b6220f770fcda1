"""One streamed choice of /v1/chat/completions as OpenAI's deltas: the reasoning (when the
profile has a reasoning parser), the content as it comes (read for tool calls when the request
has tools, `server.serving.tool_stream`), the calls as they are written, and the finish.

A call's first delta carries its index, id, type and name (and the arguments so far, maybe ""),
later ones its index and more arguments, as OpenAI streams them."""

from __future__ import annotations

from server.engine import ChoiceOutput, ReasoningParser, TokenLogprob
from server.protocol.openai import (
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobContent,
    ChatLogprobs,
    ChatLogprobTop,
    ChatStreamChoice,
    ToolCallDelta,
    ToolCallFunctionDelta,
)
from server.request_state import RequestStats
from server.serving.tool_stream import CallPiece, ToolCallStream
from server.serving.tools import ToolPlan


def chat_logprobs(entries: list[TokenLogprob], top: int) -> ChatLogprobs:
    content = []
    for e in entries:
        logprob = e.logprob if e.logprob is not None else -9999.0
        tops = [
            ChatLogprobTop(token=c.token, logprob=c.logprob, bytes=list(c.token.encode("utf-8", "replace")))
            for c in (e.candidates or [])[:top]
        ]
        content.append(ChatLogprobContent(
            token=e.token, logprob=logprob, bytes=list(e.token.encode("utf-8", "replace")), top_logprobs=tops
        ))
    return ChatLogprobs(content=content)


class ChatChoiceStream:
    """Feed each engine delta of one choice; get the `ChatStreamChoice`s to send, in order.

    Logprobs go with the first piece sent after their tokens came; tokens that only made
    held text (a split marker, a tool call) go with the held part or the finish.
    """

    def __init__(self, index: int, req: ChatCompletionRequest, plan: ToolPlan,
                 reasoning: ReasoningParser | None, stats: RequestStats) -> None:
        self.index = index
        self.req = req
        self.reasoning = reasoning
        self.tools = ToolCallStream(plan) if plan.parses_output else None
        self.stats = stats
        self.pending: list[TokenLogprob] = []

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs | None:
        return chat_logprobs(entries, self.req.top_logprobs or 0) if self.req.logprobs else None

    def _take(self) -> list[TokenLogprob]:
        entries, self.pending = self.pending, []
        return entries

    def _piece(self, delta: ChatDelta, logprobs: list[TokenLogprob] | None = None,
               finish_reason: str | None = None, stop_reason: int | str | None = None) -> ChatStreamChoice:
        entries = self._logprobs(logprobs) if logprobs is not None else None
        return ChatStreamChoice(index=self.index, delta=delta, logprobs=entries,
                                finish_reason=finish_reason, stop_reason=stop_reason)

    def feed(self, c: ChoiceOutput) -> list[ChatStreamChoice]:
        finished = c.finish_reason is not None
        if self.reasoning is None and self.tools is None:  # plain text: each delta as it comes
            if c.finish_reason is not None:
                self.stats.finish_reasons.append(c.finish_reason)
            return [self._piece(ChatDelta(content=c.text), c.logprobs or [],
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)]
        self.pending.extend(c.logprobs or [])
        reasoning, content = None, c.text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.stream(c.text, c.token_ids, finished=finished,
                                                       ended_on_stop_token=c.ended_on_stop_token)
        pieces = []
        if reasoning:
            pieces.append(self._piece(ChatDelta(reasoning=reasoning), self._take()))
        if self.tools is not None:
            release = self.tools.feed(content or "", self._take())
            if release.content:
                pieces.append(self._piece(ChatDelta(content=release.content), release.logprobs))
            pieces += [self._call(p) for p in release.calls]
            if finished:
                pieces += self._finish_tools(c)
            return pieces
        if content or finished:
            pieces.append(self._piece(ChatDelta(content=content or ""), self._take(),
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        if c.finish_reason is not None:
            self.stats.finish_reasons.append(c.finish_reason)
        return pieces

    def _call(self, piece: CallPiece) -> ChatStreamChoice:
        return self._piece(ChatDelta(tool_calls=[ToolCallDelta(
            index=piece.index, id=piece.id, type="function" if piece.id is not None else None,
            function=ToolCallFunctionDelta(name=piece.name, arguments=piece.arguments),
        )]))

    def _finish_tools(self, c: ChoiceOutput) -> list[ChatStreamChoice]:
        assert self.tools is not None
        end = self.tools.finish(c.finish_reason)
        if end.finish_reason:
            self.stats.finish_reasons.append(end.finish_reason)
        logprobs: list[TokenLogprob] | None = end.logprobs
        pieces = []
        if end.content:
            pieces.append(self._piece(ChatDelta(content=end.content), logprobs))
            logprobs = None
        pieces += [self._call(p) for p in end.pieces]
        pieces.append(self._piece(ChatDelta(), logprobs, finish_reason=end.finish_reason, stop_reason=c.stop_reason))
        return pieces
