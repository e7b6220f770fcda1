"""vLLM's own gemma4 tool parser behind the engine seam (`server/engine/tool_parsing.py`), with the
synthetic Gemma 4 tokenizer the GPU runs use: what the H200 profiles' `tool_call_parser: gemma4`
does with Gemma 4's call syntax, checked on the CPU with vLLM 0.26 and 0.32 (no engine needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fixtures import synth_tokenizer
from server.engine.tool_parsing import VllmToolCallParser, tool_choice_json_schema

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from vllm.tokenizers import get_tokenizer

    out: Path = synth_tokenizer.build(tmp_path_factory.mktemp("gemma") / "m", vocab_size=20000)
    return get_tokenizer(str(out))


def parser(tokenizer, choice: object = "auto") -> VllmToolCallParser:  # type: ignore[no-untyped-def]
    return VllmToolCallParser("gemma4", tokenizer, [WEATHER], choice, None)


def test_gemma4_reads_its_own_call_syntax_and_keeps_the_text_before(tokenizer) -> None:  # type: ignore[no-untyped-def]
    p = parser(tokenizer)
    assert p.start_marker == "<|tool_call>"
    out = p.extract("Checking." + CALL)
    [call] = out.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert out.content == "Checking."
    two = parser(tokenizer).extract(CALL + CALL.replace("Paris", "Rome"))
    assert [json.loads(c.arguments)["city"] for c in two.calls] == ["Paris", "Rome"]
    plain = parser(tokenizer).extract("no call here")
    assert plain.calls == [] and plain.content == "no call here"


def test_the_constraint_and_special_tokens_come_from_vllms_parser(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """As `vllm serve` sets them: gemma4 is never forced into JSON (required/named are read from
    its own syntax), keeps special tokens, and runs on `tool_choice: none` to drop call syntax;
    hermes gets vLLM's structural tag (strict tool calling, on by default) for auto and required.
    Where vLLM leaves gemma4's required/named free, the gateway's grammar of its calls forces one
    (server/engine/tool_grammar.py); auto stays free."""
    p = parser(tokenizer, "required")
    assert p.forced_by_schema is False and p.strips_calls_without_tools is True
    assert p.skip_special_tokens is False
    assert p.structured is not None and list(p.structured) == ["grammar"]
    assert '"<|tool_call>call:"' in p.structured["grammar"] and '"get_weather"' in p.structured["grammar"]
    named = parser(tokenizer, {"type": "function", "function": {"name": "get_weather"}})
    assert named.structured is not None and named.forced_by_schema is False
    assert parser(tokenizer, "auto").structured is None
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tools, choice in (([WEATHER], "required"), ([WEATHER], named), ([strict], "auto")):
        hermes = VllmToolCallParser("hermes", tokenizer, tools, choice, None)
        assert hermes.start_marker == "<tool_call>" and hermes.strips_calls_without_tools is False
        assert hermes.forced_by_schema is False and hermes.skip_special_tokens is False
        assert hermes.structured is not None
        tag = json.loads(hermes.structured["structural_tag"])
        assert "<tool_call>" in json.dumps(tag) and "get_weather" in json.dumps(tag), tag
    assert VllmToolCallParser("hermes", tokenizer, [WEATHER], "auto", None).structured is None  # not strict
    none = VllmToolCallParser("hermes", tokenizer, [WEATHER], "none", None)
    assert none.structured is None and none.skip_special_tokens is True
    assert tool_choice_json_schema([WEATHER], "required", None) is not None  # without a parser


def test_the_synthetic_template_renders_tools_and_calls_in_gemma4_syntax(tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert "<|tool>declaration:get_weather" in text and '<|tool_call>call:get_weather{"city": "Oslo"}' in text
    assert "<|tool_response>sunny<tool_response|>" in text and text.endswith("<|turn>model\n")
    ids = tokenizer.encode("<|tool_call>", add_special_tokens=False)
    assert len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == "<|tool_call>"


def test_required_and_named_are_constrained_for_every_parser(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Issue 39: `required` and a named function force a call whatever the parser: a JSON schema
    the gateway reads (then `forced_by_schema`), vLLM's structural tag or the gateway's grammar
    in the parser's syntax. Parsers this tokenizer or environment cannot build (their own tokens,
    an optional package) are skipped."""
    from server.engine.tool_parsing import available_tool_parsers

    named = {"type": "function", "function": {"name": "get_weather"}}
    checked = []
    for name in available_tool_parsers():
        for choice in ("required", named):
            try:
                p = VllmToolCallParser(name, tokenizer, [WEATHER], choice, None)
            except Exception:  # noqa: BLE001 "could not locate the tool call token", a missing package
                break
            assert p.structured is not None, (name, choice)
            assert p.forced_by_schema == ("json" in p.structured), (name, choice, p.structured)
            checked.append(name)
    assert "gemma4" in checked and "hermes" in checked and len(set(checked)) > 10, checked
