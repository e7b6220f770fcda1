"""Exact admission with the scripted engine: a tenant that counts tokens is decided once serving
has tokenized the prompt, on prompt tokens + n x max_tokens, for every route and input shape;
the prompt is tokenized once; a refused request never reaches the engine and is charged nothing;
bursts spend at most the limit plus one request."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from testbed.fakes import FakeEngine
from tests.unit.test_metrics import get
from tests.unit.test_tenants_http import ADMIN, Gateway_, assert_error, bearer

KEYS = """
keys:
  - {name: tpm, key: sk-tpm, tokens_per_minute: 60}
  - {name: budget, key: sk-budget, budget_tokens: 40}
  - {name: both, key: sk-both, tokens_per_minute: 60, budget_tokens: 1000, requests_per_minute: 100}
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Counting:
    """Counts the scripted engine's tokenizer and generate calls."""

    def __init__(self, engine: FakeEngine) -> None:
        self.encoded = 0
        self.generated: list[str] = []
        encode, generate = engine.encode, engine.generate

        def counted_encode(text: str, *, add_special_tokens: bool) -> list[int]:
            self.encoded += 1
            return encode(text, add_special_tokens=add_special_tokens)

        async def counted_generate(request_id: str, ids: list[int], sampling: Any) -> Any:
            self.generated.append(request_id)  # when the engine is first asked for output
            async for out in generate(request_id, ids, sampling):
                yield out

        engine.encode = counted_encode  # type: ignore[method-assign]
        engine.generate = counted_generate  # type: ignore[method-assign]


def remaining(r: Any) -> int:
    return int(r.headers["x-ratelimit-remaining-tokens"])


async def post(gw: Gateway_, path: str, key: str, body: dict[str, Any]) -> Any:
    return await gw.client.post(path, json={"model": "fake", **body}, headers=bearer(key))


@pytest.mark.anyio
async def test_every_route_reserves_its_exact_prompt_plus_n_times_max_tokens(tmp_path: Path) -> None:
    cases: list[tuple[str, dict[str, Any], int]] = [
        # (route, body, n x max_tokens); the prompt's size comes from the response's usage
        ("/v1/completions", {"prompt": "one two three four five", "max_tokens": 3}, 3),
        ("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "n": 2}, 2 * 2 * 2),
        ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "what is the weather"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny and warm today"}],
            "max_completion_tokens": 4, "n": 2}, 2 * 4),
        ("/v1/responses", {"instructions": "be brief", "max_output_tokens": 5, "input": [
            {"role": "user", "content": "weather in Rome"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny and warm today"}]}, 5),
        ("/v1/messages", {"system": "be brief", "max_tokens": 6, "messages": [
            {"role": "user", "content": "weather in Rome"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather",
                                               "input": {"city": "Rome"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                          "content": "sunny and warm today"}]}]}, 6),
    ]
    for i, (path, body, completions) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        async with Gateway_(tmp_path / str(i), keys=KEYS) as gw:
            counting = Counting(gw.engine)
            r = await post(gw, path, "sk-tpm", body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            assert prompt > 2
            # taken from a full bucket of 60 (it refills by 1 a second while the test runs)
            assert 60 - (prompt + completions) <= remaining(r) <= 60 - (prompt + completions) + 1, (path, prompt)
            # one tokenization per text prompt (token ids need none): admission reused serving's count
            assert counting.encoded == (0 if i == 1 else 1)


@pytest.mark.anyio
async def test_tool_definitions_and_long_scripts_are_counted(tmp_path: Path) -> None:
    # The scripted chat template counts words; a tool-heavy, word-heavy request reserves them all,
    # where characters / 4 of the message text would have reserved a few tokens.
    async with Gateway_(tmp_path, keys=KEYS) as gw:
        counting = Counting(gw.engine)
        long = " ".join(["word"] * 50)
        r = await post(gw, "/v1/chat/completions", "sk-tpm", {
            "messages": [{"role": "user", "content": long}], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 52  # "user: ... assistant:"
        assert remaining(r) <= 60 - 53 + 1
        # the next one does not fit in what is left: refused before the engine sees it
        r = await post(gw, "/v1/chat/completions", "sk-tpm", {
            "messages": [{"role": "user", "content": long}], "max_tokens": 1})
        error = assert_error(r, 429, "rate_limit_exceeded")
        assert "on tokens per min (TPM): Limit 60" in error["message"] and "Requested 53" in error["message"]
        assert r.headers["retry-after"] and r.headers["x-ratelimit-limit-tokens"] == "60"
        assert len(counting.generated) == 1 and counting.encoded == 2
        snap = gw.metrics()
        # the refused request is charged nothing, though its prompt was tokenized
        assert get(snap, "gateway_tenant_tokens_total", tenant="tpm", kind="prompt") == 52
        assert get(snap, "gateway_tenant_requests_total", tenant="tpm", status="429") == 1
        assert get(snap, "gateway_tenant_rate_limited_total", tenant="tpm", reason="tokens") == 1
        assert get(snap, "gateway_rejections_total", reason="rate_limit") == 1
        tenants = (await gw.client.get("/admin/usage", headers=ADMIN)).json()["tenants"]
        assert (tenants["tpm"]["requests"], tenants["tpm"]["errors"], tenants["tpm"]["total_tokens"]) == (2, 1, 53)


@pytest.mark.anyio
async def test_a_request_larger_than_tokens_per_minute_is_refused_for_good(tmp_path: Path) -> None:
    async with Gateway_(tmp_path, keys=KEYS) as gw:
        r = await post(gw, "/v1/responses", "sk-tpm", {"input": "a b c", "max_output_tokens": 58})
        error = assert_error(r, 429, "rate_limit_exceeded")
        assert error["param"] == "max_output_tokens" and error["message"].startswith("Request too large")
        assert r.headers["x-should-retry"] == "false"
        r = await post(gw, "/v1/chat/completions", "sk-tpm", {"messages": [{"role": "user", "content": "a"}],
                                                              "stream": True, "max_tokens": 60})
        assert_error(r, 429, "rate_limit_exceeded")  # a stream is refused before it starts


@pytest.mark.anyio
@pytest.mark.parametrize("key,limit", [("sk-budget", 40), ("sk-tpm", 60)])
async def test_a_parallel_burst_spends_at_most_the_limit_plus_one_request(tmp_path: Path, key: str, limit: int) -> None:
    async with Gateway_(tmp_path, keys=KEYS) as gw:
        gw.engine.delay_s = 0.01  # all of them in flight together
        counting = Counting(gw.engine)
        prompt = " ".join(["w"] * 8)
        results = await asyncio.gather(*(
            post(gw, "/v1/chat/completions", key, {"messages": [{"role": "user", "content": prompt}],
                                                    "max_tokens": 4, "stream": i % 2 == 1})
            for i in range(12)))
        served = [r for r in results if r.status_code == 200]
        refused = [r for r in results if r.status_code == 429]
        assert len(served) + len(refused) == 12 and served and refused
        one = 10 + 4  # "user: w x 8 assistant:" is 10 words, plus max_tokens
        spent = len(served) * one  # the scripted engine generates max_tokens every time
        assert spent <= limit + one
        assert len(counting.generated) == len(served)
        used = get(gw.metrics(), "gateway_tenant_tokens_total", tenant=key[3:], kind="prompt")
        assert used == 10 * len(served)
        if key == "sk-budget":
            assert get(gw.metrics(), "gateway_tenant_budget_used_tokens", tenant="budget") == spent
            for r in refused:
                assert_error(r, 429, "insufficient_quota")
                assert r.headers["x-should-retry"] == "false"


@pytest.mark.anyio
async def test_refunds_are_exact(tmp_path: Path) -> None:
    async with Gateway_(tmp_path, keys=KEYS) as gw:
        # reserves 3 + 20, uses 3 + 4 (the stream fails after 4 tokens): 16 come back
        gw.engine.fail_after = 4
        r = await post(gw, "/v1/completions", "sk-both", {"prompt": "a b c", "max_tokens": 20, "stream": True})
        assert r.status_code == 200 and '"error"' in r.text
        assert remaining(r) in (60 - 23, 60 - 22)
        gw.engine.fail_after = None
        r = await post(gw, "/v1/completions", "sk-both", {"prompt": [1], "max_tokens": 1})
        assert 60 - 7 - 2 <= remaining(r) <= 60 - 7 - 2 + 2
        assert get(gw.metrics(), "gateway_tenant_budget_used_tokens", tenant="both") == 7 + 2


@pytest.mark.anyio
async def test_a_bad_body_takes_nothing_and_is_never_a_500(tmp_path: Path) -> None:
    async with Gateway_(tmp_path, keys=KEYS) as gw:
        for body in ({"prompt": "a", "max_tokens": 0}, {"prompt": [], "max_tokens": 1}, {"prompt": [10**6]},
                     {"prompt": " ".join(["w"] * 70)}):
            r = await post(gw, "/v1/completions", "sk-budget", body)
            assert r.status_code == 400, r.text
        r = await post(gw, "/v1/chat/completions", "sk-budget", {"messages": "nope"})
        assert r.status_code == 400
        r = await post(gw, "/v1/completions", "sk-budget", {"prompt": "a", "max_tokens": 1})
        assert r.status_code == 200
        assert get(gw.metrics(), "gateway_tenant_budget_used_tokens", tenant="budget") == 2


@pytest.mark.anyio
async def test_a_request_cancelled_while_its_admission_is_decided_gives_everything_back(tmp_path: Path) -> None:
    from server.middleware.tenant_limits import TenantLimitMiddleware, _Admission
    from server.request_state import RequestState

    async with Gateway_(tmp_path, keys=KEYS) as gw:
        limiter = gw.tenancy.limiter
        assert limiter is not None
        acquire = limiter.acquire

        async def slow_acquire(tenant: Any, tokens: int) -> Any:  # as a Redis round trip
            await asyncio.sleep(0.05)
            return await acquire(tenant, tokens)

        limiter.acquire = slow_acquire  # type: ignore[method-assign]
        middleware = TenantLimitMiddleware(gw.app, gw.tenancy, gw.gateway_metrics, lambda: "fake")
        tenant = gw.tenancy.directory.tenants["both"]
        admission = _Admission(middleware, RequestState(started=0.0, request_id="r"), tenant, "max_tokens")
        task = asyncio.ensure_future(admission.admit(30))
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away while the limiter decided
        with pytest.raises(asyncio.CancelledError):
            await task
        decision = await admission.settled()  # the decision still came back: it took 30 tokens
        assert decision is not None and decision.allowed and decision.reserved == 30
        assert await gw.tenancy.finish(tenant, decision, 0, 0, error=True) == 0  # all of it back
        limiter.acquire = acquire  # type: ignore[method-assign]
        r = await post(gw, "/v1/completions", "sk-both", {"prompt": [1], "max_tokens": 1})
        assert 60 - 2 <= remaining(r) <= 60


def test_a_usage_file_from_before_the_queue_columns_is_read_and_upgraded(tmp_path: Path) -> None:
    """Usage files written before `queued`/`queue_ms` existed: `llm-gateway usage` (read-only)
    reads them with zeros, and the gateway adds the columns when it opens the file."""
    import sqlite3

    from server.tenants.usage import open_usage_db, read_rows

    path = tmp_path / "usage.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE usage (tenant TEXT NOT NULL, day TEXT NOT NULL, requests INTEGER NOT NULL DEFAULT 0, "
                   "errors INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0, "
                   "completion_tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (tenant, day))")
        db.execute("INSERT INTO usage VALUES ('a', '2026-12-01', 3, 1, 30, 40)")
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        rows = read_rows(lambda sql, args: db.execute(sql, args).fetchall(), None, None, None)
    assert [r.as_dict() for r in rows] == [{"tenant": "a", "day": "2026-12-01", "requests": 3, "errors": 1,
                                            "prompt_tokens": 30, "completion_tokens": 40, "total_tokens": 70,
                                            "queued": 0, "queue_ms": 0}]
    db = open_usage_db(path)
    db.execute("UPDATE usage SET queued = 2, queue_ms = 150")
    assert db.execute("SELECT queued, queue_ms FROM usage").fetchall() == [(2, 150)]
    db.close()
    open_usage_db(path).close()  # a second open finds the columns in place
