"""The fair queue through the app on the scripted engine: a full engine's next place goes to the
light tenant, the engine never runs more than max_num_seqs, waits past the first-token timeout
end in a 504 that charges nothing, and the queue is seen in the metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.settings import EngineProfile, Settings
from testbed.fakes import FakeEngine
from tests.unit.test_metrics import get
from tests.unit.test_tenants_http import ADMIN, Gateway_, assert_error

KEYS = """
keys:
  - {name: heavy, key: sk-heavy}
  - {name: light, key: sk-light, share: 2}
  - {name: counted, key: sk-counted, budget_tokens: 100000}
"""
SEQS = 2


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FairGateway(Gateway_):
    """`Gateway_` on an engine of SEQS places whose scripted tokens take 20 ms, recording the most
    requests it ever ran at once."""

    def __init__(self, tmp_path: Path, *, fair_share: bool = True, limits: dict[str, Any] | None = None) -> None:
        keys = tmp_path / "keys.yaml"
        keys.write_text(KEYS)
        settings = Settings(
            engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake",
                                 load_format="dummy", max_num_seqs=SEQS),
            auth={"keys_file": keys, "usage_db": tmp_path / "usage.sqlite3", "fair_share": fair_share,
                  "admin_keys": ["sk-admin"]},
            limits=limits or {}, server={"state_dir": tmp_path / "state"})
        engine = FakeEngine(delay_s=0.02)
        self.most_running = 0
        generate = engine.generate

        async def watched(request_id: str, ids: list[int], sampling: Any) -> Any:
            async for out in generate(request_id, ids, sampling):
                self.most_running = max(self.most_running, engine.running)
                yield out

        engine.generate = watched  # type: ignore[method-assign]
        super().__init__(tmp_path, settings=settings, engine=engine)

    async def ask(self, key: str, max_tokens: int, **body: Any) -> httpx.Response:
        return await self.complete(key, prompt="a b c", max_tokens=max_tokens, **body)


async def flood_then_light(gw: FairGateway) -> tuple[int, list[httpx.Response]]:
    """Heavy sends 10 long requests at once; light then sends one short one. How many of heavy's
    were still unfinished when light's came back."""
    heavy = [asyncio.ensure_future(gw.ask("sk-heavy", 20)) for _ in range(10)]
    while gw.engine.running < SEQS:
        await asyncio.sleep(0.005)
    light = await gw.ask("sk-light", 2)
    assert light.status_code == 200, light.text
    behind = sum(not task.done() for task in heavy)
    return behind, [await task for task in heavy]


@pytest.mark.anyio
async def test_the_light_tenant_gets_the_next_place_and_the_engine_never_overfills(tmp_path: Path) -> None:
    async with FairGateway(tmp_path) as gw:
        behind, heavy = await flood_then_light(gw)
        assert all(r.status_code == 200 for r in heavy)
        assert behind >= 7, behind  # light went past heavy's queue: only the running ones ended before
        assert gw.most_running <= SEQS
        metrics = gw.metrics()
        assert get(metrics, "gateway_tenant_queue_seconds_count", tenant="heavy") == 10
        assert get(metrics, "gateway_tenant_queue_seconds_sum", tenant="heavy") > 0.3
        assert get(metrics, "gateway_tenant_queue_seconds_count", tenant="light") == 1
        assert get(metrics, "gateway_tenant_queued_requests", tenant="heavy") == 0
        assert get(metrics, "gateway_tenant_share", tenant="light") == 2
        assert gw.tenancy.fair is not None and gw.tenancy.fair.in_use == 0
        # The usage store counts the waits: heavy's 10 requests past the first SEQS waited, for as
        # long as the metrics say (to the millisecond); light's waited for one place.
        usage = (await gw.client.get("/admin/usage", headers=ADMIN)).json()["tenants"]
        waited_ms = get(metrics, "gateway_tenant_queue_seconds_sum", tenant="heavy") * 1000
        assert 10 - SEQS <= usage["heavy"]["queued"] <= 10
        assert abs(usage["heavy"]["queue_ms"] - waited_ms) <= 10 and usage["heavy"]["queue_ms"] > 300
        assert usage["light"]["queued"] == 1 and usage["light"]["requests"] == 1


@pytest.mark.anyio
async def test_off_every_request_goes_to_the_engine_at_once(tmp_path: Path) -> None:
    async with FairGateway(tmp_path, fair_share=False) as gw:
        behind, heavy = await flood_then_light(gw)
        assert all(r.status_code == 200 for r in heavy)
        assert gw.most_running == 11  # vLLM's own queue would hold them: light waits behind heavy
        assert gw.tenancy.fair is None


@pytest.mark.anyio
async def test_a_wait_past_the_first_token_timeout_is_a_504_that_charges_nothing(tmp_path: Path) -> None:
    async with FairGateway(tmp_path, limits={"first_token_timeout_s": 0.2}) as gw:
        # Streamed: their first token comes at once (the scripted engine sends a whole answer at its end).
        running = [asyncio.ensure_future(gw.ask("sk-heavy", 40, stream=True)) for _ in range(SEQS)]
        while gw.engine.running < SEQS:
            await asyncio.sleep(0.005)
        r = await gw.ask("sk-counted", 5)
        error = assert_error(r, 504, 504)
        assert "no place in the engine within 0.2 s" in error["message"]
        streamed = await gw.ask("sk-counted", 5, stream=True)  # refused before any byte, as JSON
        assert streamed.status_code == 504 and streamed.json()["error"]["message"] == error["message"]
        assert [(await t).status_code for t in running] == [200] * SEQS
        assert get(gw.metrics(), "gateway_tenant_tokens_total", tenant="counted", kind="prompt") == 0
        ok = await gw.ask("sk-counted", 5)  # the engine is free again: served at once
        assert ok.status_code == 200
        # The budget holds only the served request: the two that waited too long gave theirs back.
        assert get(gw.metrics(), "gateway_tenant_budget_used_tokens", tenant="counted") == 8


@pytest.mark.anyio
async def test_a_client_gone_while_waiting_gives_its_place_up(tmp_path: Path) -> None:
    async with FairGateway(tmp_path) as gw:
        running = [asyncio.ensure_future(gw.ask("sk-heavy", 30)) for _ in range(SEQS)]
        while gw.engine.running < SEQS:
            await asyncio.sleep(0.005)
        waiting = asyncio.ensure_future(gw.ask("sk-light", 5))
        fair = gw.tenancy.fair
        assert fair is not None
        while fair.waiting("light") == 0:
            await asyncio.sleep(0.005)
        waiting.cancel()
        while fair.waiting("light"):
            await asyncio.sleep(0.005)
        assert [(await t).status_code for t in running] == [200] * SEQS
        assert fair.in_use == 0
        assert (await gw.ask("sk-light", 2)).status_code == 200
