"""vLLM's tool-call parsers and tool-choice schemas behind plain data.

The serving layer sends tools as the OpenAI JSON dicts and gets `ToolCallExtraction`s back; the
vLLM `ChatCompletionRequest` the parsers need is built here. vLLM 0.26 and 0.32 both keep the
parsers in `vllm.tool_parsers` and the request model in
`vllm.entrypoints.openai.chat_completion.protocol`; their differences are in `compat`.

`required` and a named `tool_choice` always get a constraint that forces a call: vLLM's own (a
JSON schema, or a structural tag in the parser's syntax), else a grammar in the parser's syntax
(`tool_grammar`, Gemma 4), else vLLM's JSON schema, read by the gateway instead of the parser.
"""

from __future__ import annotations

from typing import Any

from server.engine import compat, tool_grammar
from server.engine.tool_call_prefix import SCANS, CallPrefixes
from server.engine.types import ParsedToolCall, ToolCallExtraction


def available_tool_parsers() -> list[str]:
    """The names `engine.tool_call_parser` may take (vLLM's registry, lazy entries included)."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def _vllm_request(tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool | None,
                  response_format: dict[str, Any] | None = None) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body: dict[str, Any] = {
        "model": "gateway", "messages": [{"role": "user", "content": ""}],
        "tools": tools, "tool_choice": tool_choice,
    }
    if parallel_tool_calls is not None:
        body["parallel_tool_calls"] = parallel_tool_calls
    if response_format is not None:
        body["response_format"] = response_format
    return ChatCompletionRequest.model_validate(body)


def tool_choice_json_schema(
    tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool | None
) -> dict[str, Any] | None:
    """The JSON schema `vllm serve` constrains `required` or a named `tool_choice` to (None for
    `auto`/`none`, and on vLLM 0.26 for a named function without parameters)."""
    request = _vllm_request(tools, tool_choice, parallel_tool_calls)
    schema = compat.tool_choice_json_schema(request)
    if isinstance(schema, str):  # vLLM's type allows a JSON text
        import json

        schema = json.loads(schema)
    return schema


def _start_marker(parser: Any) -> str | None:
    """The call opener: classic parsers name it `tool_call_start_token` (hermes: `<tool_call>`);
    engine-based ones (gemma4) keep it among their config's terminals as TOOL_START (0.26, 0.32)."""
    marker = getattr(parser, "tool_call_start_token", None)
    if isinstance(marker, str) and marker:
        return marker
    engine = getattr(parser, "_parser_engine", None)
    config = getattr(engine, "parser_engine_config", None)
    terminals = getattr(config, "terminals", None) or {}
    marker = terminals.get("TOOL_START")
    return marker if isinstance(marker, str) and marker else None


class VllmToolCallParser:
    """One request's vLLM tool parser (parsers keep streaming state: one per request).

    Built as `vllm serve` builds it: vLLM's unified parser (`ParserManager.get_parser`, 0.26 and
    0.32) adjusts the request, which decides the output constraint (`structured`: e.g. the
    hermes structural tag that vLLM applies by default, VLLM_ENFORCE_STRICT_TOOL_CALLING) and
    whether special tokens stay in the text; its tool parser then reads the calls.
    """

    def __init__(self, name: str, tokenizer: Any, tools: list[dict[str, Any]], tool_choice: Any,
                 parallel_tool_calls: bool | None, response_format: dict[str, Any] | None = None) -> None:
        from vllm.parser import ParserManager

        self._request = _vllm_request(tools, tool_choice, parallel_tool_calls, response_format)
        self._name, self._tools = name, tools
        unified_cls = ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True)
        unified = unified_cls(tokenizer, self._request.tools)
        self._parser = unified._tool_parser
        parser_cls = type(self._parser)
        # Read after construction: vLLM turns supports_required_and_named off for parsers with a
        # structural tag when strict tool calling is on (its default), in __init_subclass__.
        self.forced_by_schema = bool(getattr(parser_cls, "supports_required_and_named", True))
        self.strips_calls_without_tools = bool(getattr(parser_cls, "engine_based_streaming", False))
        self.start_marker = _start_marker(self._parser)
        if tool_choice != "none":  # as vLLM's renderer: no adjustment when tools are off
            self._request = unified.adjust_request(self._request)
        self.structured = compat.structured_outputs_fields(self._request.structured_outputs)
        self.skip_special_tokens = bool(self._request.skip_special_tokens)
        forces_call = tool_choice == "required" or isinstance(tool_choice, dict)
        if forces_call and not self.forced_by_schema:
            if self.structured is None:
                self._force_a_call(name, tools, tool_choice, parallel_tool_calls)
            elif "json" in self.structured:
                # vLLM 0.26's ToolParser.adjust_request forces the tools' JSON schema also on
                # parsers that read their own syntax for required/named (inkling; 0.32 leaves
                # them free): the output is that JSON, so it is read as for a forced parser.
                self.forced_by_schema = True

    def _force_a_call(self, name: str, tools: list[dict[str, Any]], tool_choice: Any,
                      parallel_tool_calls: bool | None) -> None:
        """Constrain `required`/named output where vLLM's parser left it free (gemma4, 0.26 and
        0.32: `vllm serve` then answers whatever the model writes, often no call at all)."""
        function = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        grammar = tool_grammar.call_grammar(name, tools, function, parallel_tool_calls is False)
        if grammar is not None:  # the parser's own syntax: the parser reads the calls as usual
            self.structured = {"grammar": grammar}
            return
        # No grammar for this syntax: vLLM's JSON schema, whose calls the gateway reads itself.
        # vLLM 0.26 gives a named function without parameters no schema (0.32 `{"type":
        # "object"}`, see compat): an object still, so the output is arguments.
        schema = tool_choice_json_schema(tools, tool_choice, parallel_tool_calls)
        self.forced_by_schema = True
        self.structured = {"json": schema if schema is not None else {"type": "object"}}

    def extract(self, text: str) -> ToolCallExtraction:
        info = self._parser.extract_tool_calls(text, request=self._request)
        if not info.tools_called:
            return ToolCallExtraction(content=text if info.content is None else info.content, calls=[])
        calls = [
            ParsedToolCall(id=getattr(tc, "id", None) or "", name=tc.function.name,
                           arguments=tc.function.arguments)
            for tc in info.tool_calls
        ]
        content = info.content
        if content is not None and not content.strip():
            content = None
        return ToolCallExtraction(content=content, calls=calls)

    def call_prefixes(self) -> CallPrefixes | None:
        """The calls while they are written, for the syntaxes `tool_call_prefix` reads (hermes,
        gemma4); their members are probed with this parser. Gemma 4's engine-based parser
        (0.26, 0.32) coerces string values to the schema's types, hermes never does."""
        if self._name not in SCANS:
            return None
        return CallPrefixes(self._name, lambda text: self.extract(text).calls, self._tools,
                            coerces_strings=self._name == "gemma4")
