"""One streamed choice whose output is read for tool calls: content goes out as it arrives, and
each call as the model writes it.

Text is sent until the tool parser's call opener (`start_marker`, e.g. `<tool_call>`) may
begin: a trailing piece that is a prefix of the opener waits for the next delta, and from the
opener on the text is held. While it is held, the parser's `call_prefixes` reader (hermes,
gemma4) recognises the calls being written: a call's first piece carries its id and name, later
pieces more of its arguments, each only a prefix that the finished parse's arguments are certain
to begin with (`server.engine.tool_call_prefix` says how). When the choice finishes, the whole
text is read with `read_tool_calls` (the non-streamed parse, so the calls, content and finish
reason are the non-streamed response's): each streamed call gets the rest of its arguments
(`final[len(sent):]`), calls not streamed go whole, and what the parse calls content beyond what
was sent goes out. When the parse finds no calls, the held text is content after all, unless a
call already streamed (a call cut by max_tokens stays the cut call that went out, as in `vllm
serve` and OpenAI's streams). Like `vllm serve`'s streaming parsers (hermes), the text before the
opener is sent as it is, even where the finished parse drops it (whitespace before a call).

A finished parse that does not begin with what was streamed (never expected: it would take
text that no prefix rule foresaw) is logged and counted in `mismatches`; that call gets nothing
more.

A choice is held whole when there is no fixed opener (the parser has none) or when the output
is JSON (`required` and a named function forced into the tools' schema, without a parser that
reads them from the model's own syntax). A named function's JSON is its call's arguments as
written, so it streams as it comes (from its first character that is not whitespace); the
`required` array's calls go whole at the finish, as do the calls of a parser without a
`call_prefixes` reader.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from server.engine import CallPrefixReader, TokenLogprob
from server.protocol.openai import ToolCall
from server.serving.tools import ToolPlan, new_tool_call_id, read_tool_calls

log = logging.getLogger(__name__)


def _marker_prefix_at_end(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker` (0: none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


@dataclass
class CallPiece:
    """A piece of one call: the first carries the call's id and name (arguments may be "")."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ToolStreamRelease:
    """What one delta lets out: content to send now and the logprobs of the tokens it came in,
    then pieces of calls."""

    content: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: list[CallPiece] = field(default_factory=list)


@dataclass
class ToolStreamEnd:
    """A finished choice's rest: content not yet sent, the calls (the finished parse's, with the
    ids that streamed), the call pieces not yet sent, the finish reason, and the logprobs not yet
    sent."""

    content: str
    calls: list[ToolCall]
    pieces: list[CallPiece]
    finish_reason: str | None
    logprobs: list[TokenLogprob]


@dataclass
class _Streamed:
    id: str
    name: str
    sent: str = ""
    broken: bool = False


class ToolCallStream:
    """The tool-call view of one streamed choice (feed each delta, then `finish`)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        parser = plan.parser if plan.reads_own_syntax or plan.mode == "none" else None
        self.marker = parser.start_marker if parser is not None else None
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.holding = self.marker is None  # True: no more content goes out until the choice ends
        self.pending: list[TokenLogprob] = []
        self.opener: int | None = None  # where the first call opener is in `text`
        self.reader: CallPrefixReader | None = None
        if self.marker is not None and plan.reads_own_syntax and plan.parser is not None:
            self.reader = plan.parser.call_prefixes()
        # A named function forced into its JSON schema: the arguments are the output as written
        # (`read_tool_calls`), so each delta of it is more of them.
        self.raw_named = plan.mode == "named" and not plan.reads_own_syntax and plan.function_name is not None
        self.streamed: list[_Streamed] = []
        self.mismatches: list[str] = []

    def _mismatch(self, what: str) -> None:
        log.warning("streamed tool call disagrees with the finished parse: %s", what)
        self.mismatches.append(what)

    def _raw_named_pieces(self) -> list[CallPiece]:
        if not self.streamed:
            if not self.text.strip():  # no call until the output holds more than whitespace
                return []
            assert self.plan.function_name is not None
            self.streamed.append(_Streamed(new_tool_call_id(), self.plan.function_name, self.text))
            return [CallPiece(0, self.text, self.streamed[0].id, self.plan.function_name)]
        streamed = self.streamed[0]
        if len(self.text) == len(streamed.sent):
            return []
        piece = CallPiece(0, self.text[len(streamed.sent):])
        streamed.sent = self.text
        return [piece]

    def _call_pieces(self) -> list[CallPiece]:
        if self.raw_named:
            return self._raw_named_pieces()
        if self.reader is None or self.opener is None:
            return []
        pieces = []
        for index, call in enumerate(self.reader.partial_calls(self.text[self.opener:])):
            if self.plan.single_call and index > 0:
                break
            if index == len(self.streamed):
                if not self.plan.keeps_call(call.name):  # as the finished parse
                    break
                self.streamed.append(_Streamed(new_tool_call_id(), call.name, call.arguments))
                pieces.append(CallPiece(index, call.arguments, self.streamed[index].id, call.name))
                continue
            streamed = self.streamed[index]
            if streamed.broken or len(call.arguments) <= len(streamed.sent):
                continue
            if not call.arguments.startswith(streamed.sent):
                streamed.broken = True
                self._mismatch(f"call {index}: {call.arguments!r} does not extend {streamed.sent!r}")
                continue
            pieces.append(CallPiece(index, call.arguments[len(streamed.sent):]))
            streamed.sent = call.arguments
        return pieces

    def feed(self, text: str, logprobs: list[TokenLogprob] | None = None) -> ToolStreamRelease:
        self.text += text
        self.pending.extend(logprobs or [])
        if self.holding:
            return ToolStreamRelease(calls=self._call_pieces())
        assert self.marker is not None
        opener = self.text.find(self.marker, self.sent)
        if opener >= 0:
            self.holding = True
            self.opener = end = opener
        else:
            end = len(self.text) - _marker_prefix_at_end(self.text[self.sent:], self.marker)
        if end <= self.sent:
            return ToolStreamRelease(calls=self._call_pieces())
        # The tokens seen so far go with the content they (at least partly) made.
        release = ToolStreamRelease(self.text[self.sent:end], self.pending)
        self.sent, self.pending = end, []
        release.calls = self._call_pieces()
        return release

    def finish(self, finish_reason: str | None) -> ToolStreamEnd:
        content, calls, finish_reason = read_tool_calls(self.plan, self.text, finish_reason)
        content = content or ""
        sent = self.text[: self.sent]
        if content.startswith(sent):
            rest = content[len(sent):]
        else:  # the parse dropped some of what went out (whitespace before a call): no more
            rest = "" if calls or self.streamed else self.text[self.sent:]
        if self.streamed and not calls:
            rest = ""  # the held text went out as the calls (cut by max_tokens): not as content too
        end = ToolStreamEnd(rest, calls, self._rest_of_calls(calls, finish_reason), finish_reason, self.pending)
        self.pending = []
        return end

    def _rest_of_calls(self, calls: list[ToolCall], finish_reason: str | None) -> list[CallPiece]:
        pieces = []
        for index, call in enumerate(calls):
            arguments = call.function.arguments
            if index >= len(self.streamed):
                pieces.append(CallPiece(index, arguments, call.id, call.function.name))
                continue
            streamed = self.streamed[index]
            call.id = streamed.id  # the id the client already has
            if streamed.broken:
                continue
            if call.function.name != streamed.name or not arguments.startswith(streamed.sent):
                self._mismatch(f"call {index}: sent {streamed.name} {streamed.sent!r}, "
                               f"parsed {call.function.name} {arguments!r}")
                continue
            if len(arguments) > len(streamed.sent):
                pieces.append(CallPiece(index, arguments[len(streamed.sent):]))
        if len(self.streamed) > len(calls) and finish_reason != "length":
            self._mismatch(f"{len(self.streamed)} calls streamed, the parse found {len(calls)}")
        return pieces
