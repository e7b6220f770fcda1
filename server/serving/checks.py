"""Request checks the generation routes share, in vLLM's words where `vllm serve` has the same
check: the model name, token ids, the room left in the context, `n`, logprobs."""

from __future__ import annotations

from server.engine import Engine
from server.errors import InvalidRequestError, ModelNotFoundError
from server.settings import LimitSettings


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ModelNotFoundError(
            f"The model `{requested}` does not exist. Available: {served}.", param="model"
        )


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, *, param: str = "max_tokens",
    prompt_param: str | None = None,
) -> int:
    """vLLM's rule: reject impossible values, clamp the rest to the room left in the context."""
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_len} tokens, which leaves no room for output. Shorten the prompt.",
            param=prompt_param or ("prompt" if param == "max_tokens" else "messages"),
        )
    if requested is None:
        return room
    if requested < 1:
        raise InvalidRequestError(f"{param} must be at least 1, got {requested}.", param=param)
    if requested > max_model_len:
        raise InvalidRequestError(
            f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param=param,
        )
    return min(requested, room)


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    for tid in ids:
        if tid < 0 or tid >= vocab_size:
            raise InvalidRequestError(
                f"Token id {tid} is out of vocabulary (vocabulary size {vocab_size}).", param=param
            )


def check_limits(limits: LimitSettings, *, n: int, prompts: int = 1) -> None:
    if n > limits.max_n:
        raise InvalidRequestError(f"n={n} is more than this server allows ({limits.max_n}).", param="n")
    if prompts > limits.max_prompts_per_request:
        raise InvalidRequestError(
            f"{prompts} prompts in one request; this server allows {limits.max_prompts_per_request}.",
            param="prompt",
        )


def check_logprobs(value: int | None, engine: Engine, param: str) -> None:
    if value is None:
        return
    if value < 0:
        raise InvalidRequestError(f"{param} must be non-negative, got {value}.", param=param)
    if value > engine.info.max_logprobs:
        raise InvalidRequestError(
            f"{param}={value} is more than the server allows ({engine.info.max_logprobs}).",
            param=param,
        )
