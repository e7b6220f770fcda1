"""Tool calls read while the model writes them: each call's name and a prefix of its arguments
that the finished parse (`extract`, vLLM's `extract_tool_calls`) is certain to begin with.

A prefix is only ever built from what the finished parse will serialise the same way:

- the members of the arguments object completed so far (a top-level `,` follows them) are run
  through the parser itself, as a complete call of those members (a "probe"): vLLM's hermes
  (0.26, 0.32) reads the call with `json.loads` and writes the arguments with
  `json.dumps(..., ensure_ascii=False)`; gemma4 (0.26, 0.32) converts its `key:value` syntax and
  coerces values to the tool's schema types before `json.dumps(..., ensure_ascii=False)`. The
  probe's text less its closing `}` is the prefix: later members only add to it;
- the string value being written (the last member) adds its characters so far, escaped as
  `json.dumps(..., ensure_ascii=False)` escapes them, character by character; its key and the
  separator come from a probe of that member with an empty string (its text less `"}`). Gemma 4
  coerces a string to the schema's type (`"42"` may become `42`), so its open string streams
  only where the schema leaves the value a string;
- anything else (numbers, literals, nested objects and arrays, an escape or a surrogate pair
  cut in two) waits until its member completes; the object's close waits until the call's own
  syntax closes (hermes: its JSON object; gemma4: `}<tool_call|>`), so that a call is whole
  before the next one begins. What is left goes when the choice finishes, from the finished parse.

Probes run once per member, so a call costs a few parses of its own text. A call whose text
breaks the syntax (a raw control character in a JSON string, arguments that are not an object,
gemma4's parenthesised arguments) streams nothing more; the finished parse still decides.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.engine.types import ParsedToolCall, PartialCall

GEMMA_DELIM = '<|"|>'


def _json_string_prefix(raw: str) -> str:
    """The decoded characters of a JSON string's raw content so far, cut where the next
    characters could still change them (inside an escape; after a high surrogate escape, which
    may pair with the next one)."""
    for end in range(len(raw), max(len(raw) - 12, -1), -1):
        try:
            decoded = json.loads('"' + raw[:end] + '"')
        except ValueError:
            continue
        if decoded and "\ud800" <= decoded[-1] <= "\udbff":
            decoded = decoded[:-1]
        return decoded
    return ""


def escaped(text: str) -> str:
    """`text` as `json.dumps(..., ensure_ascii=False)` writes it inside the quotes."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


@dataclass
class _Scan:
    """Where one call's text stands (indices into the text after the call opener)."""

    text: str = ""
    pos: int = 0
    name: str | None = None  # the name as written (hermes: the JSON string literal), complete
    args_start: int | None = None  # just after the arguments' `{`
    last_comma: int | None = None  # the last top-level `,` of the arguments
    value_start: int | None = None  # the current member's string value: its opening quote
    value_content: int | None = None  # ... and its first character
    value_end: int | None = None  # ... and its closing quote, once written
    args_end: int | None = None  # the arguments' closing `}`
    closed: bool = False  # the call is written whole: the probe of all its members is its arguments
    dead: bool = False  # nothing more streams for this call


class _HermesScan(_Scan):
    """`{"name": "...", "arguments": {...}}`, JSON (keys in either order)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.str_start = -1
        self.key: str | None = None  # the depth-1 key whose value comes next
        self.last_key = ""
        self.awaiting: int | None = None  # depth where a value begins at the next character
        self.name_start: int | None = None

    def advance(self) -> None:
        text = self.text
        while self.pos < len(text) and not self.dead:
            i, c = self.pos, text[self.pos]
            self.pos += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    self._string_end(i)
                elif c < " ":  # json.loads (strict) refuses it: the call will not parse
                    self.dead = True
                continue
            if c in " \t\n\r":
                continue
            if self.awaiting is not None:
                self._value_begins(i, c)
            if c == '"':
                self.in_str, self.str_start = True, i
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.args_start is not None and self.args_end is None and self.depth == 1:
                    self.args_end = i
                elif self.args_end is not None and self.depth == 0:
                    self.closed = True
            elif c == ":":
                if self.depth == 1:
                    self.key, self.awaiting = self.last_key, 1
                elif self.depth == 2 and self._in_args():
                    self.awaiting = 2
            elif c == "," and self.depth == 2 and self._in_args():
                self.last_comma = i
                self.value_start = self.value_content = self.value_end = None

    def _in_args(self) -> bool:
        return self.args_start is not None and self.args_end is None

    def _value_begins(self, i: int, c: str) -> None:
        depth, self.awaiting = self.awaiting, None
        if depth == 1 and self.key == "arguments" and self.args_start is None:
            if c != "{":  # arguments that are not an object: left to the finished parse
                self.dead = True
            self.args_start = i + 1
        elif depth == 1 and self.key == "name" and c == '"':
            self.name_start = i
        elif depth == 2 and c == '"':
            self.value_start, self.value_content = i, i + 1

    def _string_end(self, i: int) -> None:
        if self.depth == 1:
            if self.name_start == self.str_start:
                self.name = self.text[self.str_start:i + 1]
            else:
                self.last_key = self.text[self.str_start + 1:i]
        elif self.depth == 2 and self.value_start == self.str_start and self._in_args():
            self.value_end = i

    def open_value(self) -> str | None:
        if self.value_content is None:
            return None
        end = self.value_end if self.value_end is not None else len(self.text)
        return _json_string_prefix(self.text[self.value_content:end])

    def call(self, members: str) -> str:
        return f'<tool_call>{{"name": {self.name}, "arguments": {{{members}}}}}</tool_call>'

    empty_string = '""'


class _GemmaScan(_Scan):
    """`call:name{key:<|"|>value<|"|>,n:1,o:{...},l:[...]}` (the text after `<|tool_call>`)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.in_str = False
        self.awaiting = False

    def advance(self) -> None:
        text = self.text
        if self.args_start is None:
            brace = text.find("{")
            if brace < 0:
                if "(" in text or "<tool_call|>" in text:
                    self.dead = True  # parenthesised (0.32) or no arguments: left to the parse
                return
            head = text[:brace]
            if head.startswith("call:"):
                self.name = head[len("call:"):]
            else:
                self.dead = True
                return
            self.args_start = self.pos = brace + 1
        if self.args_end is not None:
            self.closed = text[self.args_end + 1:].lstrip().startswith("<tool_call|>")
            return
        while self.pos < len(text) and not self.dead and self.args_end is None:
            i = self.pos
            if text.startswith("<", i) and len(text) - i < len(GEMMA_DELIM) and GEMMA_DELIM.startswith(text[i:]):
                return  # maybe a string delimiter: wait for the rest
            if text.startswith(GEMMA_DELIM, i):
                self.pos += len(GEMMA_DELIM)
                if self.awaiting and self.depth == 0:
                    self.value_start, self.value_content = i, i + len(GEMMA_DELIM)
                elif self.in_str and self.depth == 0 and self.value_start is not None and self.value_end is None:
                    self.value_end = i
                self.awaiting = False
                self.in_str = not self.in_str
                continue
            c = text[i]
            self.pos += 1
            if self.in_str:
                continue
            if self.awaiting and c not in " \n\t":
                self.awaiting = False
            if c in "{[":
                self.depth += 1
            elif c in "}]":
                if self.depth == 0:
                    if c == "}":
                        self.args_end = i
                        self.advance()
                    else:
                        self.dead = True
                    return
                self.depth -= 1
            elif c == ":" and self.depth == 0 and self.value_start is None:
                self.awaiting = True
            elif c == "," and self.depth == 0:
                self.last_comma = i
                self.value_start = self.value_content = self.value_end = None
                self.awaiting = False

    def open_value(self) -> str | None:
        if self.value_content is None:
            return None
        if self.value_end is not None:
            return self.text[self.value_content:self.value_end]
        value = self.text[self.value_content:]
        for k in range(len(GEMMA_DELIM) - 1, 0, -1):  # a delimiter cut in two is not text
            if value.endswith(GEMMA_DELIM[:k]):
                return value[:-k]
        return value

    def call(self, members: str) -> str:
        return f"<|tool_call>call:{self.name}{{{members}}}<tool_call|>"

    empty_string = GEMMA_DELIM + GEMMA_DELIM


SCANS: dict[str, tuple[str, type[_HermesScan] | type[_GemmaScan]]] = {
    "hermes": ("<tool_call>", _HermesScan),
    "gemma4": ("<|tool_call>", _GemmaScan),
}


def _string_typed(tools: list[dict[str, Any]] | None, name: str, key: str) -> bool:
    """Whether gemma4's schema coercion leaves `key` of `name`'s arguments a string: a tool without
    properties, a key it does not list, or one typed `string` alone."""
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name") != name:
            continue
        properties = (function.get("parameters") or {}).get("properties")
        if not isinstance(properties, dict) or not properties:
            return True
        schema = properties.get(key)
        if schema is None:
            return True
        return isinstance(schema, dict) and schema.get("type") in ("string", ["string"]) and not any(
            k in schema for k in ("anyOf", "oneOf", "allOf", "$ref"))
    return False


class _Call:
    def __init__(self, scan: _Scan) -> None:
        self.scan = scan
        self.probed_members: int | None = None  # last_comma (or -1) of the members probe
        self.members = ""  # that probe's prefix
        self.whole = ""  # that probe's arguments
        self.name: str | None = None
        self.probed_value: int | None = None  # value_start of the open-member probe
        self.value_head: str | None = None  # its prefix, up to the open string's quote


class CallPrefixes:
    """The calls of one choice while it is written (feed the text from the first opener on)."""

    def __init__(self, syntax: str, probe: Callable[[str], list[ParsedToolCall]],
                 tools: list[dict[str, Any]] | None = None, coerces_strings: bool = False) -> None:
        self.opener, self.scan_type = SCANS[syntax]
        self.probe = probe
        self.tools = tools
        self.coerces_strings = coerces_strings
        self.calls: list[_Call] = []

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls recognised in `text` (which begins at the first opener), in order; the list
        stops at the first call not yet recognised."""
        segments = text.split(self.opener)[1:]
        out: list[PartialCall] = []
        for index, segment in enumerate(segments):
            if index == len(self.calls):
                self.calls.append(_Call(self.scan_type()))
            call = self.calls[index]
            if len(segment) > len(call.scan.text):
                call.scan.text = segment
                call.scan.advance()  # type: ignore[attr-defined]
            partial = self._partial(call)
            if partial is None:
                break
            out.append(partial)
        return out

    def _probe(self, scan: _Scan, members: str) -> ParsedToolCall | None:
        calls = self.probe(scan.call(members))  # type: ignore[attr-defined]
        return calls[0] if len(calls) == 1 else None

    def _partial(self, call: _Call) -> PartialCall | None:
        scan = call.scan
        if scan.name is None or scan.args_start is None:
            return None
        # The members certain so far end at the last top-level comma, or at the closing brace.
        members_end = scan.args_end if scan.args_end is not None else (
            scan.last_comma if scan.last_comma is not None else -1)
        if call.probed_members != members_end and not scan.dead:
            found = self._probe(scan, scan.text[scan.args_start:members_end] if members_end >= 0 else "")
            if found is None or not found.arguments.endswith("}"):
                if call.name is None:
                    return None
                scan.dead = True  # the probe disagrees with the scan: the finished parse decides
            else:
                call.probed_members, call.name = members_end, found.name
                call.members, call.whole = found.arguments[:-1], found.arguments
        if call.name is None:
            return None
        if scan.closed and not scan.dead and call.probed_members == scan.args_end:
            return PartialCall(call.name, call.whole)  # the next call may begin: this one is done
        arguments = call.members
        value = scan.open_value() if not scan.dead and scan.args_end is None else None  # type: ignore[attr-defined]
        if value is not None and scan.value_start is not None:
            if call.probed_value != scan.value_start:
                call.probed_value, call.value_head = scan.value_start, None
                head = scan.text[scan.args_start:scan.value_start] + scan.empty_string  # type: ignore[attr-defined]
                found = self._probe(scan, head)
                if found is not None and found.arguments.endswith('""}') and found.arguments.startswith(arguments):
                    key = _last_key(found.arguments)
                    if key is not None and (not self.coerces_strings or _string_typed(self.tools, call.name, key)):
                        call.value_head = found.arguments[:-2]
            if call.value_head is not None:
                arguments = call.value_head + escaped(value)
        return PartialCall(call.name, arguments)


def _last_key(arguments: str) -> str | None:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return None
    return list(parsed)[-1] if isinstance(parsed, dict) and parsed else None
