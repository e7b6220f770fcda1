"""`/tokenize` and `/detokenize` wire models, in the shapes `vllm serve` uses (served at the root, not /v1)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from server.protocol.openai import ApiRequest, ChatMessage


class TokenizeRequest(ApiRequest):
    """Either `prompt` (text) or `messages` (rendered with the chat template first), not both.

    vLLM has two request models; one with both shapes' fields lets the service name the field
    that is missing or extra instead of a union's combined validation error.
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens (e.g. BOS). Default: true for `prompt`, "
        "false for `messages` (the chat template adds its own).")
    add_generation_prompt: bool = Field(
        True, description="`messages` only: end with the assistant turn's opening.")
    continue_final_message: bool = Field(
        False, description="`messages` only: leave the last message open so the model continues it.")
    return_token_strs: bool | None = Field(
        False, description="Not supported here (400): the gateway's engine seam has no id-to-token-string map.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(ApiRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
