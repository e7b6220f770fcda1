"""Every error the gateway returns: exception classes, their status codes, the OpenAI error body.

The body is ``{"error": {"message", "type", "param", "code"}}``. Like `vllm serve`, ``type`` is
the status class name (``BadRequestError``, ``NotFoundError``, ...) and ``code`` the status
number, so clients that switch between the two see the same errors. The two tenant refusals are
the exception: their ``code`` is OpenAI's string (``rate_limit_exceeded``, ``insufficient_quota``),
because that string is how OpenAI's clients tell "wait and retry" from "stop, the budget is
spent", while a gateway-wide 429 (``limits.max_in_flight``) keeps the number. Once a stream has
started the same body is sent as a final SSE event (``sse_error_event``) followed by
``data: [DONE]``; a /v1/responses stream ends with OpenAI's ``error`` event instead
(``responses_error_event``), which carries the same body under ``error``.

The Anthropic routes (/v1/messages, ``anthropic_path``) render the same errors in Anthropic's
shape, ``{"type": "error", "error": {"type", "message"}}``, with Anthropic's type for the status
(``invalid_request_error``, ``rate_limit_error``, ...) and the same status and headers:
``error_body_for`` picks the shape by path, for the middleware and the app's handlers alike.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

_TYPE_BY_STATUS: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}


def error_type_for(status: int) -> str:
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


class GatewayError(Exception):
    """Base class: carries the HTTP status and the OpenAI error fields."""

    status: int = 500
    code: str | None = None
    """OpenAI's string code where OpenAI defines one for this error; else the status number is sent."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return error_type_for(self.status)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, code=self.code)


class InvalidRequestError(GatewayError):
    """The request is malformed or asks for something impossible (400)."""

    status = 400


class AuthenticationError(GatewayError):
    status = 401


class ModelNotFoundError(GatewayError):
    status = 404


class NotFoundError(GatewayError):
    status = 404


class ConflictError(GatewayError):
    status = 409


class RequestTooLargeError(GatewayError):
    status = 413


class OverloadedError(GatewayError):
    """Too much work in flight; the client should retry later (429 + Retry-After)."""

    status = 429


class RateLimitExceededError(GatewayError):
    """A tenant's requests or tokens per minute, or its concurrent requests (429 + Retry-After)."""

    status = 429
    code = "rate_limit_exceeded"


class InsufficientQuotaError(GatewayError):
    """A tenant's token budget for the period is spent (429; retrying before the period ends cannot help)."""

    status = 429
    code = "insufficient_quota"


class ServiceUnavailableError(GatewayError):
    """No engine can serve right now (starting, reloading, draining): 503 + Retry-After."""

    status = 503


class RequestTimeoutError(GatewayError):
    status = 504


class EngineDeadError(GatewayError):
    """The engine died; the process will exit (or restart the engine)."""

    status = 503


class InternalError(GatewayError):
    status = 500


def error_body(message: str, status: int, param: str | None = None, *, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type_for(status),
            "param": param,
            "code": code if code is not None else status,
        }
    }


_ANTHROPIC_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}

ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def anthropic_path(path: str) -> bool:
    return path in ANTHROPIC_PATHS


def anthropic_error_type(status: int) -> str:
    if status in _ANTHROPIC_TYPE_BY_STATUS:
        return _ANTHROPIC_TYPE_BY_STATUS[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def error_body_for(path: str, message: str, status: int, param: str | None = None, *,
                   code: str | None = None) -> dict[str, Any]:
    """The error body in the dialect of the route at `path` (Anthropic's on /v1/messages)."""
    if anthropic_path(path):
        return anthropic_error_body(message, status)
    return error_body(message, status, param, code=code)


def gateway_error_body(path: str, error: GatewayError) -> dict[str, Any]:
    return error_body_for(path, error.message, error.status, error.param, code=error.code)


def anthropic_error_event(error: GatewayError) -> str:
    """The last event of a /v1/messages stream that failed after it started: Anthropic's `error`
    event, which the anthropic SDK raises as an APIStatusError."""
    body = anthropic_error_body(error.message, error.status)
    return f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def sse_error_event(error: GatewayError) -> str:
    return f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"


def responses_error_event(error: GatewayError, sequence_number: int) -> str:
    """The last event of a /v1/responses stream that failed: OpenAI's `error` event (type, code,
    message, param, sequence_number) plus the usual body under `error`, which the OpenAI SDK
    raises as an APIError, as it does for a failed chat stream."""
    body = error.body()["error"]
    event = {"type": "error", "sequence_number": sequence_number, "code": str(body["code"]),
             "message": error.message, "param": error.param, "error": body}
    return f"event: error\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
