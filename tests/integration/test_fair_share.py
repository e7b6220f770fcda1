"""The tenants' fair queue (auth.fair_share) on the real CPU engine: with the engine full of one
tenant's flood, another tenant's short request waits for one free place, not for the flood's
queue, and the engine never runs more than max_num_seqs. The fair-versus-FIFO numbers are
`benchmarks.fair_share`'s (docs/performance/tenants.md)."""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.lib import fair_load
from tests.conftest import ServerProcess, start_gateway, wait_for
from tests.unit.test_metrics import get

SEQS = 2
FLOOD = 12
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def fair_gateway(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("fair-share")
    keys = tmp / "keys.yaml"
    keys.write_text("keys:\n  - {name: heavy, key: sk-heavy}\n  - {name: light, key: sk-light}\n")
    server = start_gateway(tmp, extra_args=["--keys-file", str(keys)],
                           env={"LLM_GATEWAY_ENGINE__MAX_NUM_SEQS": str(SEQS),
                                "LLM_GATEWAY_AUTH__USAGE_DB": str(tmp / "usage.sqlite3")})
    yield server
    server.stop()


def scrape(server: ServerProcess) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(httpx.get(server.base_url + "/metrics", timeout=30).text)
            for s in f.samples}


@pytest.mark.timing
def test_a_light_tenant_waits_for_one_place_not_for_the_flood(fair_gateway: ServerProcess) -> None:
    before = scrape(fair_gateway)
    during: dict = {}
    counted: list[dict[str, float]] = []  # each tenant's generated tokens, as the gateway counts them

    async def main() -> tuple[fair_load.Tally, fair_load.Tally]:
        alone, tally = fair_load.Tally(), fair_load.Tally()
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=fair_gateway.base_url, timeout=300,
                                     limits=httpx.Limits(max_connections=FLOOD + 8)) as client:
            counted.append(await fair_load.completion_tokens(client))
            await fair_load.one_at_a_time(client, alone, "light", "sk-light", MODEL, requests=3, max_tokens=4,
                                          pause_s=(0.1, 0.3))
            heavy = asyncio.ensure_future(fair_load.flood(client, tally, "heavy", "sk-heavy", MODEL,
                                                          concurrency=FLOOD, max_tokens=48, stop=stop))
            await fair_load.wait_running(client, SEQS)
            await asyncio.sleep(1.0)  # every place taken, the rest of the flood queued behind them
            during.update(await asyncio.to_thread(scrape, fair_gateway))
            await fair_load.one_at_a_time(client, tally, "light", "sk-light", MODEL, requests=4, max_tokens=4)
            heavy.cancel()  # the flood's streams are abandoned: the gateway aborts them
            await asyncio.gather(heavy, return_exceptions=True)
            counted.append(await fair_load.completion_tokens(client))
        return alone, tally

    alone, tally = asyncio.run(main())
    heavy, light = tally.of("heavy"), tally.of("light")
    assert heavy and all(r.status == 200 and r.tokens == 48 for r in heavy), [(r.status, r.tokens) for r in heavy]
    assert all(r.status == 200 and r.tokens == 4 for r in light)
    assert all(r.status == 200 for r in alone.of("light"))
    # the benchmark's server-side view of a split: the light tenant's 7 answers of 4 tokens each
    assert counted[1]["light"] - counted[0].get("light", 0.0) == 7 * 4, counted
    # One heavy request's time in the engine (its first token to its last), as the machine ran it.
    service = statistics.median(r.e2e_s - r.ttft_s for r in heavy if r.e2e_s and r.ttft_s)
    waited = statistics.median(r.ttft_s for r in light if r.ttft_s is not None)
    by_itself = statistics.median(r.ttft_s for r in alone.of("light") if r.ttft_s is not None)
    print(f"light's TTFT p50 {waited:.2f} s flooded, {by_itself:.2f} s alone; one heavy request {service:.2f} s")
    # First come first served, light would wait for the FLOOD - SEQS requests queued ahead of it:
    # (FLOOD - SEQS) / SEQS = 5 heavy requests' time. The fair queue gives it the next free place:
    # its TTFT alone plus at most one heavy request (the goal), with room for a loaded machine.
    assert waited < by_itself + 1.5 * service, (waited, by_itself, service)
    after = scrape(fair_gateway)
    assert get(after, "gateway_tenant_queue_seconds_count", tenant="light") - get(
        before, "gateway_tenant_queue_seconds_count", tenant="light") == 7
    heavy_waits = get(after, "gateway_tenant_queue_seconds_sum", tenant="heavy") - get(
        before, "gateway_tenant_queue_seconds_sum", tenant="heavy")
    assert heavy_waits > service  # the flood did wait, in the gateway
    # While the flood ran, its queue was in the gateway, not in vLLM's.
    assert get(during, "gateway_tenant_queued_requests", tenant="heavy") >= FLOOD // 2, during
    waiting = [v for (name, _), v in during.items() if name == "vllm:num_requests_waiting"]
    assert waiting and max(waiting) == 0, waiting


def test_a_client_that_leaves_while_queued_gives_its_place_up(fair_gateway: ServerProcess) -> None:
    """Through real uvicorn: a plain request waiting for a place (both held by long streams) whose
    client gives up is cancelled where it waits (routes/openai.cancel_on_disconnect): counted as a
    disconnect, out of the queue at once, and never run; the next request is served."""
    # The test before this one abandoned its flood: wait until the gateway has ended all of it, so
    # neither its disconnects nor vLLM's gauges (updated a step late) count here.
    assert wait_for(lambda: get(scrape(fair_gateway), "gateway_requests_in_flight", route="/v1/completions") == 0, 30)
    before = scrape(fair_gateway)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=fair_gateway.base_url, timeout=300,
                                     limits=httpx.Limits(max_connections=SEQS + 4)) as client:
            # every place held by a stream that is generating (2,000 tokens: minutes), so the light
            # request cannot get one
            held = [asyncio.Event() for _ in range(SEQS)]
            holders = asyncio.gather(*(fair_load.stream_one(client, fair_load.Tally(), "heavy", "sk-heavy", MODEL,
                                                            "Tell a long story.", 2000, first_token=e) for e in held))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in held)), 120)
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4},
                                  headers={"Authorization": "Bearer sk-light"}, timeout=1.0)
            for _ in range(100):  # the gateway sees the closed connection, then counts it
                now = await asyncio.to_thread(scrape, fair_gateway)
                if get(now, "gateway_client_disconnects_total", route="/v1/completions") > get(
                        before, "gateway_client_disconnects_total", route="/v1/completions"):
                    break
                await asyncio.sleep(0.1)
            assert get(now, "gateway_tenant_queued_requests", tenant="light") == 0, now
            assert get(now, "gateway_client_disconnects_total", route="/v1/completions") == get(
                before, "gateway_client_disconnects_total", route="/v1/completions") + 1
            holders.cancel()  # the long streams are abandoned: the gateway aborts them
            await asyncio.gather(holders, return_exceptions=True)
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4},
                                  headers={"Authorization": "Bearer sk-light"})
            assert r.status_code == 200, r.text

    asyncio.run(main())
    after = scrape(fair_gateway)
    # the one that left never reached the engine: only the served request's tokens are the tenant's
    assert get(after, "gateway_tenant_tokens_total", tenant="light", kind="completion") - get(
        before, "gateway_tenant_tokens_total", tenant="light", kind="completion") == 4
