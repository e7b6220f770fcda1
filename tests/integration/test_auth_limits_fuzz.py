"""API keys, request limits, the OpenAPI document, and schemathesis fuzzing, on one keyed gateway.

This gateway runs with API keys, an admin key, small limits and a 128-token context, so fuzzed
requests that happen to be valid finish in seconds on a CPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.conftest import SERVED_NAME, ServerProcess, start_gateway

API_KEY = "sk-test-inline"
FILE_KEY = "sk-test-from-file"
ADMIN_KEY = "sk-admin"
MAX_BODY = 16384
FUZZ_EXAMPLES = int(os.environ.get("LLM_GATEWAY_FUZZ_EXAMPLES", "250"))
LONG_FUZZ_EXAMPLES = 1000  # make test-slow


@pytest.fixture(scope="module")
def keyed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("keyed")
    key_file = tmp / "keys.txt"
    key_file.write_text(f"# one key per line\n{FILE_KEY}\n")
    server = start_gateway(
        tmp,
        extra_args=["--api-key", API_KEY, "--api-key-file", str(key_file), "--admin-key", ADMIN_KEY,
                    "--max-model-len", "128"],
        env={
            "LLM_GATEWAY_LIMITS__MAX_N": "2",
            "LLM_GATEWAY_LIMITS__MAX_PROMPTS_PER_REQUEST": "2",
            "LLM_GATEWAY_LIMITS__MAX_BODY_BYTES": str(MAX_BODY),
        },
    )
    yield server
    assert server.stop() == 0


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    if param:
        assert error["param"] == param
    return error


def test_sdk_with_keys(keyed: ServerProcess) -> None:
    for key in (API_KEY, FILE_KEY):
        client = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=key, max_retries=0)
        assert client.completions.create(model=SERVED_NAME, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
        assert [m.id for m in client.models.list()] == [SERVED_NAME]


@pytest.mark.parametrize("key", ["wrong", API_KEY + "x", API_KEY[:-1], ADMIN_KEY])
def test_sdk_unauthorized(keyed: ServerProcess, key: str) -> None:
    client = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


def test_401_shape_and_open_paths(keyed: ServerProcess) -> None:
    r = httpx.post(keyed.base_url + "/v1/completions", json={"prompt": "x"})
    assert_error(r, 401)
    assert r.headers["www-authenticate"] == "Bearer"
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(keyed.base_url + path).status_code == 200
    assert httpx.get(keyed.base_url + "/openapi.json").status_code == 401


def test_admin_needs_the_admin_key(keyed: ServerProcess) -> None:
    url = keyed.base_url + "/admin/status"
    assert_error(httpx.get(url), 401)
    assert_error(httpx.get(url, headers=headers(API_KEY)), 401)
    r = httpx.get(url, headers=headers(ADMIN_KEY))
    assert r.status_code == 200
    assert r.json()["state"] == "serving"
    assert r.json()["model"] == SERVED_NAME


def test_body_too_large_is_413(keyed: ServerProcess) -> None:
    big = {"model": SERVED_NAME, "prompt": "x" * (MAX_BODY + 10)}
    assert_error(httpx.post(keyed.base_url + "/v1/completions", json=big, headers=headers(API_KEY)), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must count the stream
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1000 + 2):
            yield b"y" * 1000
        yield b'"}'

    r = httpx.post(keyed.base_url + "/v1/completions", content=chunks(),
                   headers={**headers(API_KEY), "content-type": "application/json"})
    assert_error(r, 413)


@pytest.mark.parametrize("size,status", [(16 * 1024, 200), (32 * 1024 + 1, 431), (200 * 1024, 431), (4 * 2**20, 431)])
def test_request_head_is_capped_like_nginx(keyed: ServerProcess, size: int, status: int) -> None:
    """`server.max_header_bytes` (32 KiB, nginx's 4 x 8k): a bigger head gets 431 in the OpenAI
    shape and the connection is closed; the server keeps serving."""
    h = {**headers(API_KEY), "x-padding": "p" * size}
    try:
        r = httpx.get(keyed.base_url + "/v1/models", headers=h, timeout=30)
    except httpx.RemoteProtocolError:  # the server closed before the client finished sending 4 MiB
        assert status == 431
    else:
        assert r.status_code == status, r.text[:300]
        if status == 431:
            assert_error(r, 431)
            assert r.headers["connection"] == "close"
    assert httpx.get(keyed.base_url + "/v1/models", headers=headers(API_KEY), timeout=30).status_code == 200


def test_limits(keyed: ServerProcess) -> None:
    url = keyed.base_url + "/v1/completions"
    h = headers(API_KEY)
    assert_error(httpx.post(url, json={"prompt": "x", "n": 3, "temperature": 1}, headers=h), 400, "n")
    assert_error(httpx.post(url, json={"prompt": ["a", "b", "c"]}, headers=h), 400, "prompt")
    assert_error(httpx.post(url, json={"prompt": "x", "max_tokens": 500}, headers=h), 400, "max_tokens")
    chat = keyed.base_url + "/v1/chat/completions"
    assert_error(httpx.post(chat, json={"messages": [{"role": "user", "content": "x"}], "n": 5, "temperature": 1},
                            headers=h), 400, "n")


def test_openapi_describes_every_route(keyed: ServerProcess) -> None:
    doc = httpx.get(keyed.base_url + "/openapi.json", headers=headers(API_KEY)).json()
    paths = doc["paths"]
    for path, method in [("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                         ("/v1/responses", "post"), ("/v1/messages", "post"), ("/v1/messages/count_tokens", "post"),
                         ("/tokenize", "post"), ("/detokenize", "post"),
                         ("/health", "get"), ("/ready", "get"), ("/metrics", "get"), ("/admin/status", "get")]:
        assert method in paths[path], path
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "CompletionResponse", "ChatCompletionResponse",
                 "ErrorResponse", "ModelList", "ResponsesRequest", "ResponseObject", "TokenizeRequest",
                 "TokenizeResponse", "DetokenizeRequest", "DetokenizeResponse", "MessagesRequest", "Message",
                 "AnthropicErrorResponse", "CountTokensRequest", "CountTokensResponse"):
        assert name in schemas
    for path in ("/v1/completions", "/v1/responses", "/v1/messages", "/tokenize"):
        assert {"400", "401", "404", "413", "503"} <= set(paths[path]["post"]["responses"])
    assert "prompt" in schemas["CompletionRequest"]["properties"]


# -- fuzzing: schemathesis over our own OpenAPI document ---------------------------------------


FUZZ_MAX_TOKENS = 8


def bound_generation(case) -> None:  # type: ignore[no-untyped-def]
    """Cap generated tokens so valid fuzz cases take a second, not a minute, on a CPU engine."""
    if not isinstance(case.body, dict):
        return
    capped = False
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = case.body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > FUZZ_MAX_TOKENS:
            case.body[key] = FUZZ_MAX_TOKENS
        capped |= key in case.body
    if not capped:  # each route ignores the other routes' name (unknown fields are accepted)
        case.body["max_tokens"] = case.body["max_output_tokens"] = FUZZ_MAX_TOKENS


def check_response(case, base_url: str) -> int:  # type: ignore[no-untyped-def]
    bound_generation(case)
    response = case.call(base_url=base_url, headers=headers(API_KEY), timeout=120)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
    if 400 <= response.status_code < 500:
        body = response.json()
        error = body["error"]
        if case.path.startswith("/v1/messages"):  # Anthropic's shape on the Anthropic routes
            assert body["type"] == "error" and set(error) == {"type", "message"}, response.text
        else:
            assert set(error) == {"message", "type", "param", "code"}, response.text
        assert isinstance(error["message"], str) and error["message"]
    return response.status_code


def test_fuzz_no_5xx_and_openai_errors(keyed: ServerProcess) -> None:
    fuzz(keyed, FUZZ_EXAMPLES)


@pytest.mark.slow
def test_fuzz_longer(keyed: ServerProcess) -> None:
    fuzz(keyed, LONG_FUZZ_EXAMPLES)


def fuzz(keyed: ServerProcess, examples: int) -> None:
    """Hypothesis-generated requests for every operation in our own OpenAPI document: no 5xx,
    every error in its API's shape (OpenAI's, Anthropic's on /v1/messages).

    Driven through schemathesis's strategies directly (its pytest plugin does not support
    pytest 9 yet). The example budget is split evenly over the operations.
    """
    doc = httpx.get(keyed.base_url + "/openapi.json", headers=headers(API_KEY)).json()
    schema = schemathesis.openapi.from_dict(doc)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 7
    posts = [op for op in operations if op.method.upper() == "POST"]
    # GET routes here take no parameters: one example each exhausts them.
    per_post = (examples - (len(operations) - len(posts))) // len(posts)
    statuses: dict[int, int] = {}

    for operation in operations:
        budget = per_post if operation in posts else 1

        @given(case=operation.as_strategy())
        @settings(max_examples=budget, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case) -> None:  # type: ignore[no-untyped-def]
            status = check_response(case, keyed.base_url)
            statuses[status] = statuses.get(status, 0) + 1

        run()
    total = sum(statuses.values())
    print(f"fuzz: {total} requests over {len(operations)} operations, statuses {sorted(statuses.items())}")
    assert total >= 0.9 * examples
    assert httpx.get(keyed.base_url + "/health").status_code == 200
