"""`/tokenize` and `/detokenize`: text or chat messages -> token ids and back, on the serving engine's tokenizer.

They take an engine lease like generation does: the tokenizer belongs to the engine, which a
reload may replace, and a drain or a start answers 503 here as everywhere else.
"""

from __future__ import annotations

from server.engine import Engine
from server.errors import InvalidRequestError
from server.lifecycle.holder import EngineHolder
from server.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.serving.chat import chat_message_dicts, chat_prompt_ids
from server.serving.checks import check_model, check_token_ids
from server.serving.lease import prompt_chars, serve_on_lease


def tokenize_ids(engine: Engine, req: TokenizeRequest) -> list[int]:
    check_model(req.model, engine.info.served_model_name)
    if req.return_token_strs:
        raise InvalidRequestError(
            "return_token_strs is not supported by this server; decode ids one at a time with /detokenize.",
            param="return_token_strs",
        )
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("Send exactly one of `prompt` (text) and `messages` (a chat).",
                                  param="prompt" if req.prompt is not None else "messages")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        return engine.encode(req.prompt, add_special_tokens=add_special)
    if req.continue_final_message and req.add_generation_prompt:
        # vLLM's words. add_generation_prompt defaults to true, so continuing takes it set to false.
        raise InvalidRequestError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    assert req.messages is not None
    return chat_prompt_ids(
        engine, chat_message_dicts(req.messages),
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        add_special_tokens=bool(req.add_special_tokens),
    )


async def tokenize(holder: EngineHolder, req: TokenizeRequest) -> TokenizeResponse:
    def prepare(engine: Engine) -> TokenizeResponse:
        ids = tokenize_ids(engine, req)
        return TokenizeResponse(count=len(ids), max_model_len=engine.info.max_model_len, tokens=ids)

    async def done(response: TokenizeResponse) -> TokenizeResponse:
        return response

    return await serve_on_lease(holder, prepare, None, done,  # type: ignore[return-value]
                                text_chars=prompt_chars(req.prompt) + prompt_chars(req.messages))


async def detokenize(holder: EngineHolder, req: DetokenizeRequest) -> DetokenizeResponse:
    def prepare(engine: Engine) -> DetokenizeResponse:
        check_model(req.model, engine.info.served_model_name)
        check_token_ids(req.tokens, engine.info.vocab_size, param="tokens")
        return DetokenizeResponse(prompt=engine.decode(req.tokens))

    async def done(response: DetokenizeResponse) -> DetokenizeResponse:
        return response

    # a long id list decodes to a long text: off the loop like a long prompt (ids ~ 4 chars each)
    return await serve_on_lease(holder, prepare, None, done,  # type: ignore[return-value]
                                text_chars=4 * len(req.tokens))
