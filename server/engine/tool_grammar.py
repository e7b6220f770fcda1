"""Grammars that force a tool call in a tool parser's own call syntax.

`tool_choice: "required"` and a named function promise a call (OpenAI's contract). vLLM keeps that
promise with a constraint: a JSON schema for parsers that read JSON, a structural tag for the
parsers it has one for (hermes, ...). For Gemma 4 (`gemma4`, vLLM 0.26 and 0.32) it sets none:
the model writes `<|tool_call>call:name{key:<|"|>text<|"|>,n:3}<tool_call|>` and the parser reads
that, so nothing makes it write a call at all. The grammars here make it: the output is one or
more calls (`required`) or exactly one call of the named function, in the parser's own syntax, so
the parser reads them back as it reads any call.

The grammars are xgrammar EBNF (`StructuredOutputsParams.grammar`), which vLLM's xgrammar backend
compiles on the CPU and the GPU builds alike, and which needs no special tokens: `<|tool_call>`
and `<|"|>` are plain text to the grammar, which lets the model write them as one special token
where its vocabulary has one (xgrammar reads their text) and as text pieces where it has not
(SmolLM2's on the CPU); vLLM's parser reads the decoded text (`skip_special_tokens` off).
"""

from __future__ import annotations

import json
from typing import Any

GEMMA4_STRING = '<|"|>'
# Gemma 4's strings are raw text between two `<|"|>`: no escapes. A string must not hold a
# Gemma 4 marker, or vLLM's parser reads it as one: every marker starts with `<|` or ends with
# `|>` (`<|"|>`, `<tool_call|>`, `<|channel>`), so strings hold neither pair, while `<`, `>` and
# `|` alone or doubled (`a < b`, `x || y`, `cout << x`, `<div>`) stay possible; a run of three
# (`|||`) or `|<` does not. Only fixed-length alternatives: xgrammar precomputes the token mask
# of such a rule, while repeats (`"|"+`, `"|"?`) left it checking most of a 262k vocabulary at
# every step, 0.1-0.5 s a token (seen on the H200 as forced calls taking seconds).
_GEMMA4_STRING_BODY = (
    '( [^<|] | "<" [^<|] | "|" [^<|>] | "||" [^<|>] | "<<" [^<|] )* ( "<" | "|" | "||" | "<<" )?'
)
# Digits are capped: a JSON number beyond 16 significant digits loses precision in most clients
# anyway, and a bound keeps a model that will not stop (random weights) from writing digits until
# max_tokens, with no call read back.
_GEMMA4_PRIMITIVES = {
    "string": f'"<|\\"|>" {_GEMMA4_STRING_BODY} "<|\\"|>"',
    "integer": '"-"? ( "0" | [1-9] [0-9]{0,15} )',
    "number": '"-"? ( "0" | [1-9] [0-9]{0,15} ) ( "." [0-9]{1,16} )? ( [eE] [+-]? [0-9]{1,3} )?',
    "boolean": '"true" | "false"',
    "null": '"null"',
    # Keys of objects whose schema names none (free-form objects): an identifier, as Gemma 4
    # writes keys bare and vLLM's parser reads a key up to its `:`.
    "key": '[A-Za-z_] [A-Za-z0-9_]*',
    "any": "string | number | boolean | null | anyobject | anyarray",
    "anyobject": '"{" ( key ":" any ( "," key ":" any )* )? "}"',
    "anyarray": '"[" ( any ( "," any )* )? "]"',
}


def _literal(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes are xgrammar's)."""
    return json.dumps(text)


def _gemma4_value_text(value: Any) -> str:
    """A JSON value (an `enum` or `const` member) as Gemma 4 writes it."""
    if isinstance(value, str):
        return GEMMA4_STRING + value + GEMMA4_STRING
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ",".join(_gemma4_value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_gemma4_value_text(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"not a JSON value: {value!r}")


class _Gemma4Grammar:
    """The rules of one request's grammar, built from its tools' JSON schemas."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = dict(_GEMMA4_PRIMITIVES)
        self._refs: dict[tuple[int, str], str] = {}

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        return name

    def value(self, schema: Any, root: dict[str, Any]) -> str:
        """The rule for a value of `schema` (JSON schema; `root` holds its `$defs`), as far as
        Gemma 4's syntax and a grammar allow: what a schema leaves open (patterns, bounds of
        numbers, extra properties of an object with named ones) is left out, not guessed."""
        if not isinstance(schema, dict) or not schema:
            return "any"  # `true`, `{}`: any value
        if "$ref" in schema:
            return self._ref(schema["$ref"], root)
        if "const" in schema:
            return self.rule(_literal(_gemma4_value_text(schema["const"])))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.rule(" | ".join(_literal(_gemma4_value_text(v)) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self.rule(" | ".join(self.value(s, root) for s in schema[key]))
        if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
            return self.value(schema["allOf"][0], root)
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.rule(" | ".join(self.value({**schema, "type": k}, root) for k in kind) or "any")
        if kind == "object" or (kind is None and "properties" in schema):
            return self._object(schema, root)
        if kind == "array" or (kind is None and "items" in schema):
            return self._array(schema, root)
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number", "boolean", "null"):
            return kind
        return "any"

    def _ref(self, ref: Any, root: dict[str, Any]) -> str:
        # One rule per definition, named before it is built, so a recursive schema is a
        # recursive rule rather than an endless expansion.
        target: Any = None
        if isinstance(ref, str) and ref.startswith("#/"):
            target = root
            for part in ref[2:].split("/"):
                target = target.get(part) if isinstance(target, dict) else None
        if not isinstance(target, dict):
            return "any"
        key = (id(root), ref)
        if key not in self._refs:
            name = self._refs[key] = self.rule("any")  # placeholder until built
            self.rules[name] = self.value(target, root)
        return self._refs[key]

    def _string(self, schema: dict[str, Any]) -> str:
        low, high = schema.get("minLength"), schema.get("maxLength")
        if not isinstance(low, int) and not isinstance(high, int):
            return "string"
        # With a length bound, one character is one unit: no `<` or `|` at all (the pairs the
        # general rule keeps out would make the count inexact).
        low = low if isinstance(low, int) and low > 0 else 0
        bound = f"{{{low},{high}}}" if isinstance(high, int) else f"{{{low},}}"
        return self.rule(f'"<|\\"|>" [^<|]{bound} "<|\\"|>"')

    def _array(self, schema: dict[str, Any], root: dict[str, Any]) -> str:
        item = self.value(schema.get("items", True), root)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        low = low if isinstance(low, int) and low > 0 else 0
        if isinstance(high, int) and high < low:
            high = low
        if isinstance(high, int) and high == 0:
            return self.rule('"[]"')
        rest_low = max(low - 1, 0)
        rest = f'( "," {item} ){{{rest_low},{high - 1}}}' if isinstance(high, int) else (
            f'( "," {item} ){{{rest_low},}}')
        items = f"{item} {rest}"
        return self.rule(f'"[" {items} "]"' if low else f'"[" ( {items} )? "]"')

    def _object(self, schema: dict[str, Any], root: dict[str, Any]) -> str:
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return self.rule('"{}"')
            value = self.value(extra, root) if isinstance(extra, dict) else "any"
            return self.rule(f'"{{" ( key ":" {value} ( "," key ":" {value} )* )? "}}"')
        required = set(schema.get("required") or [])
        fields = [(_literal(f"{name}:"), self.value(sub, root), name in required)
                  for name, sub in properties.items()]
        # The properties in the schema's order, the required ones always, the others maybe, with
        # a comma between two: built from the end, `after[i]` for the properties from i on once
        # one was written (each then starts with a comma), `first[i]` before any was.
        after, first = '""', '""'
        for key, value, needed in reversed(fields):
            pair = f"{key} {value}"
            if needed:
                after, first = self.rule(f'"," {pair} {after}'), self.rule(f"{pair} {after}")
            else:
                after, first = (self.rule(f'"," {pair} {after} | {after}'),
                                self.rule(f"{pair} {after} | {first}"))
        return self.rule(f'"{{" {first} "}}"')

    def function(self, tool: dict[str, Any]) -> str:
        """The rule for one call's name and arguments, `name{...}`."""
        function = tool["function"]
        parameters = function.get("parameters")
        # OpenAI: a function without `parameters` takes none, so its arguments are `{}`.
        if parameters is None:
            args = self.rule('"{}"')
        else:
            args = self.value(parameters if parameters else {"type": "object"}, parameters)
        return self.rule(f"{_literal(function['name'])} {args}")

    def text(self, root: str) -> str:
        """The grammar: `root` first, one rule a line (vLLM tells EBNF from Lark by its lines)."""
        lines = [f"root ::= {root}"]
        lines += [f"{name} ::= {body}" for name, body in self.rules.items()]
        return "\n".join(lines) + "\n"


def gemma4_call_grammar(tools: list[dict[str, Any]], function_name: str | None, single_call: bool) -> str:
    """The grammar of Gemma 4 output that is only tool calls: exactly one call of `function_name`
    (a named `tool_choice`), else one call of any of `tools` (`single_call`:
    `parallel_tool_calls: false`) or one or more back to back (`required`)."""
    grammar = _Gemma4Grammar()
    chosen = [t for t in tools if function_name is None or t["function"]["name"] == function_name]
    if not chosen:
        raise ValueError(f"tool_choice names the function {function_name!r}, which is not in tools")
    functions = " | ".join(grammar.function(t) for t in chosen)
    call = grammar.rule(f'"<|tool_call>call:" ( {functions} ) "<tool_call|>"')
    return grammar.text(call if function_name is not None or single_call else f"{call}+")


_BUILDERS = {"gemma4": gemma4_call_grammar}


def call_grammar(parser_name: str, tools: list[dict[str, Any]], function_name: str | None,
                 single_call: bool) -> str | None:
    """The grammar forcing `parser_name`'s own call syntax (see `gemma4_call_grammar`), or None
    when the gateway has none for that parser."""
    builder = _BUILDERS.get(parser_name)
    return builder(tools, function_name, single_call) if builder is not None else None
