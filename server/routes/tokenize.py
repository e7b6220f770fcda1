"""`/tokenize` and `/detokenize`, at the root as `vllm serve` has them (API keys apply as on /v1)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.protocol.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.routes.openai import ERROR_RESPONSES
from server.serving.tokenize import detokenize, tokenize

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES,
             summary="Token ids of a text, or of chat messages rendered with the chat template")
async def create_tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    return await tokenize(request.app.state.holder, body)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES,
             summary="The text of token ids")
async def create_detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    return await detokenize(request.app.state.holder, body)
