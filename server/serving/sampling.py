"""Request fields -> the engine's `SamplingOptions`: the user's value, else the model's default
(its generation config), else OpenAI's."""

from __future__ import annotations

from typing import Any, Protocol

from server.engine import Engine, SamplingOptions
from server.errors import InvalidRequestError


class SamplingFields(Protocol):
    """The sampling fields completions and chat requests have in common."""

    n: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    min_tokens: int
    ignore_eos: bool
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    logit_bias: dict[str, float] | None
    stream: bool


def parse_logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not raw:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {token_id} is out of vocabulary (size {vocab_size}).",
                param="logit_bias",
            )
        if not -100 <= value <= 100:
            raise InvalidRequestError(
                f"logit_bias values must be in [-100, 100], got {value}.", param="logit_bias"
            )
        bias[token_id] = value
    return bias


def sampling_options(
    engine: Engine,
    req: SamplingFields,
    max_tokens: int,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: dict[str, Any] | None = None,
) -> SamplingOptions:
    """Request fields -> SamplingOptions: user value, else the model's default, else OpenAI's."""
    defaults = engine.info.default_sampling

    def pick(name: str, fallback: float) -> float:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingOptions(
        max_tokens=max_tokens,
        n=req.n,
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=int(pick("top_k", 0)),
        min_p=pick("min_p", 0.0),
        presence_penalty=pick("presence_penalty", 0.0),
        frequency_penalty=pick("frequency_penalty", 0.0),
        repetition_penalty=pick("repetition_penalty", 1.0),
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or defaults.get("stop_token_ids") or []),
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=parse_logit_bias(req.logit_bias, engine.info.vocab_size),
        structured=structured,
        stream=req.stream,
    )
