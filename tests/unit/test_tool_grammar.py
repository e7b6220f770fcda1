"""server/engine/tool_grammar.py: the Gemma 4 call grammars that `required` and a named
`tool_choice` force, checked with xgrammar (the grammar vLLM compiles) and read back with vLLM's
own gemma4 parser (what the gateway reads the calls with). No engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar

from benchmarks.fixtures import synth_tokenizer
from server.engine.tool_grammar import call_grammar, gemma4_call_grammar

FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "number"}, "maxItems": 2},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "code": {
            "type": "string", "maxLength": 3}}, "required": ["code"]},
        "note": {"type": ["string", "null"]},
        "route": {"$ref": "#/$defs/stop"},
    },
    "$defs": {"stop": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/stop"}, {"type": "null"}]}}}},
}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: OpenAI's empty list
FREE = {"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}}


def call(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{{{args}}}<tool_call|>"


def accepts(grammar: str, text: str) -> bool:
    return bool(xgrammar.testing._is_grammar_accept_string(xgrammar.Grammar.from_ebnf(grammar), text))


def test_required_takes_one_or_more_calls_of_any_tool_and_nothing_else() -> None:
    grammar = gemma4_call_grammar([FORECAST, PING], None, single_call=False)
    one = call("get_forecast", 'city:<|"|>Paris<|"|>,days:3')
    assert accepts(grammar, one) and accepts(grammar, call("ping", ""))
    assert accepts(grammar, one + call("ping", "") + one)
    assert not accepts(grammar, "")  # required: at least one call
    assert not accepts(grammar, "Sure. " + one)  # no text around the calls
    assert not accepts(grammar, call("get_weather", 'city:<|"|>Paris<|"|>'))  # not a tool
    single = gemma4_call_grammar([FORECAST, PING], None, single_call=True)  # parallel_tool_calls: false
    assert accepts(single, one) and not accepts(single, one + one)


def test_named_takes_exactly_one_call_of_that_function() -> None:
    grammar = gemma4_call_grammar([FORECAST, PING], "ping", single_call=False)
    assert accepts(grammar, call("ping", ""))
    assert not accepts(grammar, call("ping", "") + call("ping", ""))
    assert not accepts(grammar, call("get_forecast", 'city:<|"|>Paris<|"|>,days:3'))
    assert not accepts(grammar, call("ping", "x:1"))  # no parameters: `{}` only
    with pytest.raises(ValueError, match="not in tools"):
        gemma4_call_grammar([FORECAST], "ping", single_call=False)


@pytest.mark.parametrize("args, ok", [
    ('city:<|"|>Paris<|"|>,days:3', True),
    ('city:<|"|>a < b || c > d, {e}: "f"\nline<|"|>,days:-12', True),  # raw text, no escapes
    ('city:<|"|>x<|"|>,days:0,unit:<|"|>celsius<|"|>,hourly:false,hours:[1.5,-2e3],'
     'where:{lat:48.8,code:<|"|>FR<|"|>},note:null,route:{next:{next:null}}', True),
    ('city:<|"|>x<|"|>,days:3,note:<|"|>n<|"|>', True),  # a union of types
    ('days:3', False),  # a required property left out
    ('days:3,city:<|"|>x<|"|>', False),  # the schema's order
    ('city:<|"|>x<|"|>,days:3,days:4', False),  # twice
    ('city:<|"|>x<|"|>,days:3,wind:1', False),  # not a property
    ('city:<|"|>x<|"|>,days:03', False),  # not a JSON integer
    ('city:<|"|>x<|"|>,days:1.5', False),
    ('city:<|"|>x<|"|>,days:3,unit:<|"|>kelvin<|"|>', False),  # not in the enum
    ('city:<|"|>x<|"|>,days:3,hours:[1,2,3]', False),  # maxItems
    ('city:<|"|>x<|"|>,days:3,where:{code:<|"|>FRAN<|"|>}', False),  # maxLength
    ('city:<|"|>x<|"|>,days:3,where:{lat:1}', False),  # nested required
    ('city:<|"|>x<tool_call|><|"|>,days:3', False),  # a marker inside a string would end the call
    ('city:<|"|>x<|channel>y<|"|>,days:3', False),
    ('city:Paris,days:3', False),  # strings are delimited
    ('city:<|"|>x<|"|>, days:3', False),  # no free whitespace between the parts
])
def test_arguments_follow_the_schema(args: str, ok: bool) -> None:
    assert accepts(gemma4_call_grammar([FORECAST], "get_forecast", False), call("get_forecast", args)) is ok


def test_an_object_without_properties_takes_any_keys_and_values() -> None:
    grammar = gemma4_call_grammar([FREE], None, single_call=True)
    assert accepts(grammar, call("free", ""))
    assert accepts(grammar, call("free", 'a:1,b:<|"|>x<|"|>,c:[true,{d:null}]'))


def test_only_parsers_with_a_grammar_get_one() -> None:
    assert call_grammar("gemma4", [PING], None, False) is not None
    assert call_grammar("hermes", [PING], None, False) is None
    grammar = call_grammar("gemma4", [PING], None, False)
    assert grammar is not None and grammar.startswith("root ::= ")
    assert all("::=" in line for line in grammar.splitlines())  # vLLM tells EBNF from Lark by its lines


@pytest.fixture(scope="module")
def gemma_tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from vllm.tokenizers import get_tokenizer

    out: Path = synth_tokenizer.build(tmp_path_factory.mktemp("gemma") / "m", vocab_size=20000)
    return get_tokenizer(str(out))


def test_vllms_gemma4_parser_reads_what_the_grammar_takes(gemma_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from server.engine.tool_parsing import VllmToolCallParser

    grammar = gemma4_call_grammar([FORECAST, PING], None, single_call=False)
    text = (call("get_forecast", 'city:<|"|>a < b, {c}: d<|"|>,days:-12,unit:<|"|>celsius<|"|>,hours:[1.5],'
                 'where:{code:<|"|>FR<|"|>},note:null') + call("ping", ""))
    assert accepts(grammar, text)
    parser = VllmToolCallParser("gemma4", gemma_tokenizer, [FORECAST, PING], "required", None)
    first, second = parser.extract(text).calls
    assert first.name == "get_forecast" and json.loads(first.arguments) == {
        "city": "a < b, {c}: d", "days": -12, "unit": "celsius", "hours": [1.5], "where": {"code": "FR"},
        "note": None}
    assert second.name == "ping" and json.loads(second.arguments) == {}


def test_the_grammar_can_write_gemmas_special_tokens_whole(gemma_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """xgrammar reads a special token's text: where the vocabulary has `<|tool_call>` (Gemma 4's
    and the synthetic GPU tokenizer's), the grammar lets the model write it as that one token."""
    info = xgrammar.TokenizerInfo.from_huggingface(gemma_tokenizer, vocab_size=len(gemma_tokenizer))
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(gemma4_call_grammar([PING], None, False))
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    allowed = xgrammar.testing._get_masked_tokens_from_bitmask(mask, info.vocab_size)  # the rejected ones
    token = gemma_tokenizer.convert_tokens_to_ids("<|tool_call>")
    assert token not in allowed
    assert gemma_tokenizer.convert_tokens_to_ids("<eos>") in allowed  # no empty answer


@pytest.mark.timing
def test_a_string_argument_keeps_the_token_mask_precomputed(gemma_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Inside a free string xgrammar must not check the vocabulary token by token at each step:
    with repeats in the string rule (`"|"+`) a mask took 0.1-0.5 s on the full 262k vocabulary
    (seconds per forced call on the H200)."""
    info = xgrammar.TokenizerInfo.from_huggingface(gemma_tokenizer, vocab_size=len(gemma_tokenizer))
    compiled = xgrammar.GrammarCompiler(info).compile_grammar(gemma4_call_grammar([FORECAST], None, False))
    matcher = xgrammar.GrammarMatcher(compiled)
    for token in gemma_tokenizer.encode('<|tool_call>call:get_forecast{city:<|"|>Paris || x << y', add_special_tokens=False):
        assert matcher.accept_token(token), gemma_tokenizer.decode([token])
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    import time

    took = []
    for _ in range(20):
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        took.append(time.perf_counter() - started)
    # The rule fills a mask in tens of microseconds; the repeats took ~16 ms on this 20k
    # vocabulary. The median of 20 against 5 ms leaves a loaded machine 100x room.
    assert sorted(took)[10] < 0.005, sorted(took)
