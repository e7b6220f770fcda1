"""Tool calling for /v1/chat/completions: request checks, the tool-choice plan, and the calls.

As `vllm serve` does it: `auto` parses the model's own call syntax with the profile's vLLM tool
parser (`engine.tool_call_parser`); `required` and a named function constrain the output with
structured output (a JSON schema vLLM builds from the tools) and read the calls from that JSON,
or, for parsers that read the model's own syntax there too, constrain it to that syntax (vLLM's
structural tag, or the engine's grammar where vLLM has none, e.g. gemma4) and parse it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from server.engine import Engine, ParsedToolCall, ToolCallParser
from server.errors import InvalidRequestError
from server.protocol.openai import ChatCompletionRequest, ChatMessage, ToolCall, ToolCallFunction

Mode = Literal["none", "auto", "required", "named"]


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """What a request's `tools` and `tool_choice` make of generation and of its output."""

    tools: list[dict[str, Any]] | None = None
    """The tools as the chat template gets them (None: no tools)."""
    mode: Mode = "none"
    function_name: str | None = None
    """The named function (mode `named`)."""
    structured: dict[str, Any] | None = None
    """The output constraint (`SamplingOptions.structured`): the parser's (`ToolCallParser.structured`:
    vLLM's structural tag for hermes, vLLM's default strict tool calling; a JSON schema; the
    engine's grammar of Gemma 4 calls for `required`/named), or without a parser the JSON schema
    of `required`/named."""
    parser: ToolCallParser | None = None
    """The profile's vLLM tool parser (None without `engine.tool_call_parser`)."""
    single_call: bool = False
    """`parallel_tool_calls: false`: only the first call is kept, as `vllm serve` (0.26, 0.32) does."""

    @property
    def reads_own_syntax(self) -> bool:
        """The calls are read by the parser from the model's own syntax, not from forced JSON."""
        if self.parser is None:
            return False
        return self.mode == "auto" or (self.mode in ("required", "named") and not self.parser.forced_by_schema)

    def keeps_call(self, name: str) -> bool:
        """Whether a call of this name is kept: `required` keeps only the tools' names and a named
        choice only its function's (another is a call cut off by max_tokens inside its name, which
        no client could run); `auto` keeps any."""
        if self.mode == "named":
            return name == self.function_name
        if self.mode == "required":
            return any(t["function"]["name"] == name for t in self.tools or [])
        return True

    @property
    def skip_special_tokens(self) -> bool:
        return self.parser.skip_special_tokens if self.parser is not None else True

    @property
    def parses_output(self) -> bool:
        return self.mode != "none" or (self.parser is not None and self.parser.strips_calls_without_tools)


def _check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    checked = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"{where} must be an object.", param="tools")
        if tool.get("type", "function") != "function":
            raise InvalidRequestError(f"{where}.type must be \"function\" (the only tool type served).",
                                      param="tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequestError(f"{where}.function must be an object.", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}.function.name must be a non-empty string.", param="tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object.",
                                      param="tools")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise InvalidRequestError(f"{where}.function.description must be a string.", param="tools")
        checked.append({"type": "function", "function": function})
    return checked


def _named_choice(choice: dict[str, Any], names: set[str]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}.', param="tool_choice")
    if name not in names:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools.",
                                  param="tool_choice")
    return name


def plan_tools(engine: Engine, req: ChatCompletionRequest) -> ToolPlan:
    """Check `tools`/`tool_choice` and decide how the output is constrained and read."""
    tools = _check_tools(req.tools) if req.tools else None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's and vLLM's defaults
    if not tools:
        if choice != "none":
            raise InvalidRequestError("tool_choice needs tools: send tools or leave tool_choice out.",
                                      param="tool_choice")
        return ToolPlan()
    names = {t["function"]["name"] for t in tools}
    if isinstance(choice, dict):
        name = _named_choice(choice, names)
        plan = ToolPlan(tools=tools, mode="named", function_name=name)
    elif choice in ("none", "auto", "required"):
        plan = ToolPlan(tools=tools, mode=choice)
    else:
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or a named function.', param="tool_choice")
    if engine.info.tool_call_parser:
        response_format = req.response_format.model_dump(by_alias=True, exclude_none=True) if req.response_format else None
        try:
            plan.parser = engine.tool_parser(tools, choice, req.parallel_tool_calls, response_format)
        except ValueError as exc:  # vLLM's own checks of the tools ($defs conflicts, ...)
            raise InvalidRequestError(f"tools: {exc}", param="tools") from exc
        plan.structured = plan.parser.structured
    elif plan.mode == "auto":
        raise InvalidRequestError(
            'tool_choice "auto" needs a tool-call parser, and this deployment has none '
            '(engine.tool_call_parser); send tool_choice "required", a named function or "none".',
            param="tool_choice")
    elif plan.mode != "none":
        try:
            schema = engine.tool_choice_schema(tools, choice, req.parallel_tool_calls)
        except ValueError as exc:
            raise InvalidRequestError(f"tools: {exc}", param="tools") from exc
        plan.structured = {"json": schema} if schema is not None else None
    plan.single_call = req.parallel_tool_calls is False
    return plan


def tool_message_fields(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Per message, the tool fields for the chat template: an assistant's `tool_calls` (arguments
    as objects, as vLLM hands them to templates) and a tool result's `tool_call_id`, which must
    answer an earlier call."""
    known_ids: set[str] = set()
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        extra: dict[str, Any] = {}
        if m.tool_calls and m.role == "assistant":
            calls = []
            for j, call in enumerate(m.tool_calls):
                where = f"messages[{i}].tool_calls[{j}]"
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise InvalidRequestError(f"{where}.function.name must be a string.", param="messages")
                arguments = function.get("arguments", {})
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments) if arguments.strip() else {}
                    except ValueError as exc:
                        raise InvalidRequestError(f"{where}.function.arguments is not valid JSON.",
                                                  param="messages") from exc
                if isinstance(call.get("id"), str):
                    known_ids.add(call["id"])
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": function["name"], "arguments": arguments}})
            extra["tool_calls"] = calls
        elif m.tool_calls:
            raise InvalidRequestError(f"messages[{i}].tool_calls is only allowed on assistant messages.",
                                      param="messages")
        if m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequestError(f"messages[{i}] (role tool) needs a tool_call_id.", param="messages")
            if m.tool_call_id not in known_ids:
                raise InvalidRequestError(
                    f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no earlier assistant tool call.",
                    param="messages")
            extra["tool_call_id"] = m.tool_call_id
        out.append(extra)
    return out


def _calls(parsed: list[ParsedToolCall]) -> list[ToolCall]:
    return [ToolCall(id=c.id if c.id.startswith("call_") else new_tool_call_id(),
                     function=ToolCallFunction(name=c.name, arguments=c.arguments)) for c in parsed]


def _required_calls(text: str) -> list[ToolCall]:
    """The `required` output (a JSON array of {name, parameters}); nothing when it is not one,
    as `vllm serve` answers a malformed array (e.g. cut off by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list) or not all(
        isinstance(x, dict) and isinstance(x.get("name"), str) for x in items
    ):
        return []
    return [ToolCall(id=new_tool_call_id(), function=ToolCallFunction(
        name=x["name"], arguments=json.dumps(x.get("parameters"), ensure_ascii=False))) for x in items]


def read_tool_calls(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[str | None, list[ToolCall], str | None]:
    content, calls, finish_reason = _read_tool_calls(plan, text, finish_reason)
    return content, calls[:1] if plan.single_call else calls, finish_reason


def _read_tool_calls(
    plan: ToolPlan, text: str, finish_reason: str | None
) -> tuple[str | None, list[ToolCall], str | None]:
    """(content, tool calls, finish reason) of one finished choice, as `vllm serve` gives them:
    `tool_calls` when `auto` found calls or `required` stopped normally; a named call keeps the
    engine's reason; with `required` or a named function the content is "" (not null)."""
    if plan.mode == "none":
        if not plan.parses_output:
            return text, [], finish_reason
        assert plan.parser is not None
        return plan.parser.extract(text).content, [], finish_reason
    if plan.reads_own_syntax:
        assert plan.parser is not None
        extracted = plan.parser.extract(text)
        calls = _calls(extracted.calls)
        if plan.mode == "auto":
            return extracted.content, calls, "tool_calls" if calls else finish_reason
        # required/named from the model's own syntax (parsers that are not forced into JSON,
        # constrained to their syntax): content is "" rather than null, `required` ends `tool_calls`.
        # The constraint lets only the tools' names through (the named one's for a named choice).
        calls = [c for c in calls if plan.keeps_call(c.function.name)]
        required_stop = plan.mode == "required" and finish_reason == "stop"
        return extracted.content or "", calls, "tool_calls" if required_stop else finish_reason
    if plan.mode == "required":
        return "", _required_calls(text), "tool_calls" if finish_reason == "stop" else finish_reason
    # named, forced into the function's JSON schema ("auto" without a parser is refused at planning)
    assert plan.mode == "named" and plan.function_name is not None
    calls = [ToolCall(id=new_tool_call_id(), function=ToolCallFunction(
        name=plan.function_name, arguments=text))] if text.strip() else []
    return "", calls, finish_reason
