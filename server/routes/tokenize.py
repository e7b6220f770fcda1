"""`/tokenize` and `/detokenize`, at the root as `vllm serve` has them (API keys apply as on /v1)."""

from __future__ import annotations

from fastapi import APIRouter

from server.lifecycle.holder import EngineHolder
from server.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.routes.openai import ERROR_RESPONSES
from server.serving.tokenize import detokenize, tokenize


def build_router(holder: EngineHolder) -> APIRouter:
    """`/tokenize` and `/detokenize` on `holder`'s engine."""
    router = APIRouter()

    @router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES,
                 summary="Token ids of a text, or of chat messages rendered with the chat template")
    async def create_tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(holder, body)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES,
                 summary="The text of token ids")
    async def create_detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(holder, body)

    return router
