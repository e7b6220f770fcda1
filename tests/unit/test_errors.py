from __future__ import annotations

import json

from server.errors import InvalidRequestError, ModelNotFoundError, OverloadedError, error_body, sse_error_event


def test_error_body_shape() -> None:
    body = error_body("bad", 400, "prompt")
    assert body == {"error": {"message": "bad", "type": "BadRequestError", "param": "prompt", "code": 400}}


def test_exception_status_and_type() -> None:
    assert InvalidRequestError("x").status == 400
    assert ModelNotFoundError("x").type == "NotFoundError"
    assert OverloadedError("x", headers={"Retry-After": "1"}).headers == {"Retry-After": "1"}


def test_sse_error_event() -> None:
    event = sse_error_event(InvalidRequestError("boom", param="n"))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:])["error"]["message"] == "boom"
