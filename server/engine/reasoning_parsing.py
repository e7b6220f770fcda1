"""vLLM's reasoning parsers behind plain data: a finished choice, or a stream of deltas, split
into the model's reasoning and its content.

The streaming bookkeeping mirrors `vllm.parser.abstract_parser.Parser.parse_delta` (the same
in vLLM 0.26 and 0.32): the prompt decides whether reasoning is already over, each delta goes
through `extract_reasoning_streaming` until the parser says reasoning ended, an engine-based
parser (gemma4) is then flushed once, and later deltas are content as they come. At the end
of a choice still in reasoning, the parser's fallback content and flush come out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def available_reasoning_parsers() -> list[str]:
    """The names `engine.reasoning_parser` may take (vLLM's registry, lazy entries included)."""
    from vllm.reasoning import ReasoningParserManager

    return ReasoningParserManager.list_registered()


def _vllm_request() -> Any:
    """The request vLLM's reasoning parsers take: they read nothing of it but defaults
    (`adjust_request` sets `skip_special_tokens`, a fallback reads `include_reasoning`)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(
        {"model": "gateway", "messages": [{"role": "user", "content": ""}]}
    )


def _text(delta: Any, field: str) -> str | None:
    return getattr(delta, field, None) if delta is not None else None


def _join(*parts: str | None) -> str | None:
    present = [p for p in parts if p]
    return "".join(present) if present else None


class VllmReasoningParser:
    """One choice's vLLM reasoning parser (parsers keep streaming state: one per choice)."""

    def __init__(self, name: str, tokenizer: Any, prompt_token_ids: Sequence[int] = ()) -> None:
        from vllm.reasoning import ReasoningParserManager

        parser_cls = ReasoningParserManager.get_reasoning_parser(name)
        # `chat_template_kwargs` is what `vllm serve` passes per request (gemma4 reads
        # enable_thinking from it); the gateway sends no template kwargs, so: the defaults.
        self._parser = parser_cls(tokenizer, chat_template_kwargs={})
        self._request = _vllm_request()
        self._engine_based = bool(getattr(self._parser, "engine_based_streaming", False))
        adjusted = self._parser.adjust_request(_vllm_request())
        self.keeps_special_tokens = adjusted.skip_special_tokens is False
        """vLLM's `adjust_request` turns `skip_special_tokens` off (gemma4: its markers are
        special tokens that must reach the parser)."""
        self._prompt_token_ids = list(prompt_token_ids)
        self._prompt_checked = False
        self._reasoning_ended = False
        self._previous_text = ""
        self._previous_token_ids: list[int] = []

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished choice, as `vllm serve` splits a non-streamed one."""
        return self._parser.extract_reasoning(text, self._request)

    def _check_prompt(self) -> None:
        # As vLLM: a prompt that already closed reasoning makes every delta content; one that
        # leaves it open (a template ending in the reasoning opener) sets the parser's state.
        # An engine-based parser (gemma4) is not cut short: vLLM 0.32 says a prompt ending in
        # a turn boundary has ended reasoning when thinking is off, and then its engine-based
        # tool parser still splits `<|channel>...<channel|>` off as reasoning; 0.26 lets the
        # reasoning parser do it. Feeding the reasoning parser gives that split on both.
        self._prompt_checked = True
        if not self._engine_based and self._parser.is_reasoning_end(self._prompt_token_ids):
            self._reasoning_ended = True
        else:
            self._parser.adjust_initial_state_from_prompt(self._prompt_token_ids)

    def stream(
        self, delta_text: str, delta_token_ids: Sequence[int], *, finished: bool = False,
        ended_on_stop_token: bool = False,
    ) -> tuple[str | None, str | None]:
        """(reasoning delta, content delta) of one streamed delta; `finished` on the last, and
        `ended_on_stop_token` when the choice stopped on EOS or a stop token id."""
        if not self._prompt_checked:
            self._check_prompt()
        if self._reasoning_ended:
            return None, delta_text or None
        delta_ids = list(delta_token_ids)
        if ended_on_stop_token and delta_ids:
            # The stop token has no text (ChoiceOutput.ended_on_stop_token); the engine-based gemma4
            # parser of vLLM 0.26 would still print it from its id (`<eos>` at the end of content).
            delta_ids.pop()
        current_text = self._previous_text + delta_text
        current_ids = self._previous_token_ids + delta_ids
        delta = self._parser.extract_reasoning_streaming(
            self._previous_text, current_text, delta_text,
            self._previous_token_ids, current_ids, delta_ids,
        )
        reasoning, content = _text(delta, "reasoning"), _text(delta, "content")
        if self._engine_based:
            ended = self._parser.has_engine_confirmed_reasoning_end()
        else:
            ended = self._parser.is_reasoning_end_streaming(current_ids, delta_ids)
        if ended:
            self._reasoning_ended = True
            if self._engine_based:  # it holds text after the end marker back until flushed
                content = _join(content, _text(self._parser.finish_streaming(), "content"))
        self._previous_text, self._previous_token_ids = current_text, current_ids
        if finished and not self._reasoning_ended:
            reasoning, content = self._finish(reasoning, content)
        return reasoning, content

    def _finish(self, reasoning: str | None, content: str | None) -> tuple[str | None, str | None]:
        """A choice that ends still in reasoning: the parser's fallback content (what it would
        call content after all) and an engine-based parser's buffered text."""
        fallback = getattr(self._parser, "get_streaming_fallback_content", None)
        if fallback is not None:
            content = _join(content, fallback(self._previous_text, self._request))
        if self._engine_based:
            flushed = self._parser.finish_streaming()
            content = _join(content, _text(flushed, "content"))
            reasoning = _join(reasoning, _text(flushed, "reasoning"))
        return reasoning, content
