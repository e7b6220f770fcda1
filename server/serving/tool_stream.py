"""One streamed choice whose output is read for tool calls: content goes out as it arrives,
the calls once the choice finishes.

Text is sent until the tool parser's call opener (`start_marker`, e.g. `<tool_call>`) may
begin: a trailing piece that is a prefix of the opener waits for the next delta, and from the
opener on the text is held. When the choice finishes, the whole text is read with
`read_tool_calls` (the non-streamed parse, so the calls and finish reason are the non-streamed
response's); what the parse calls content beyond what was sent goes out, then the calls. When
the parse finds no calls, the held text is content after all. Like `vllm serve`'s streaming
parsers (hermes), the text before the opener is sent as it is, even where the finished parse
drops it (whitespace before a call).

A choice is held whole when there is no fixed opener (the parser has none) or when the output
is JSON (`required` and a named function forced into the tools' schema, without a parser that
reads them from the model's own syntax).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from server.engine import TokenLogprob
from server.protocol.openai import ToolCall
from server.serving.tools import ToolPlan, read_tool_calls


def _marker_prefix_at_end(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker` (0: none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


@dataclass
class ToolStreamRelease:
    """What one delta lets out: content to send now and the logprobs of the tokens it came in."""

    content: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class ToolStreamEnd:
    """A finished choice's rest: content not yet sent, the calls, the finish reason, and the
    logprobs not yet sent."""

    content: str
    calls: list[ToolCall]
    finish_reason: str | None
    logprobs: list[TokenLogprob]


class ToolCallStream:
    """The tool-call view of one streamed choice (feed each delta, then `finish`)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        parser = plan.parser if plan.reads_own_syntax or plan.mode == "none" else None
        self.marker = parser.start_marker if parser is not None else None
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.holding = self.marker is None  # True: nothing more goes out until the choice ends
        self.pending: list[TokenLogprob] = []

    def feed(self, text: str, logprobs: list[TokenLogprob] | None = None) -> ToolStreamRelease:
        self.text += text
        self.pending.extend(logprobs or [])
        if self.holding:
            return ToolStreamRelease()
        assert self.marker is not None
        opener = self.text.find(self.marker, self.sent)
        if opener >= 0:
            self.holding = True
            end = opener
        else:
            end = len(self.text) - _marker_prefix_at_end(self.text[self.sent:], self.marker)
        if end <= self.sent:
            return ToolStreamRelease()
        # The tokens seen so far go with the content they (at least partly) made.
        release = ToolStreamRelease(self.text[self.sent:end], self.pending)
        self.sent, self.pending = end, []
        return release

    def finish(self, finish_reason: str | None) -> ToolStreamEnd:
        content, calls, finish_reason = read_tool_calls(self.plan, self.text, finish_reason)
        content = content or ""
        sent = self.text[: self.sent]
        if content.startswith(sent):
            rest = content[len(sent):]
        else:  # the parse dropped some of what went out (whitespace before a call): no more
            rest = "" if calls else self.text[self.sent:]
        end = ToolStreamEnd(rest, calls, finish_reason, self.pending)
        self.pending = []
        return end
