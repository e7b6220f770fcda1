"""The tool's measurements against a fake server with scripted timings (loopback).

Tolerances: medians within 5% of the scripted values (a loaded 2-core CI box adds a few ms of
scheduling jitter to single samples; medians absorb it), and the client's view must agree with
the server's own write timestamps (same clock) to within a couple of milliseconds.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import pytest

from loadtest.client import Endpoint
from loadtest.metrics import summarize
from loadtest.records import RequestSpec
from loadtest.runner import Bounds, Load, RunResult, run_load
from tests.loadtest.conftest import ServerFactory
from tests.loadtest.fake_server import Script

SPECS = [RequestSpec(prompt=[1, 2, 3, 4], max_tokens=8, input_tokens=4)]


def _run(url: str, load: Load, bounds: Bounds, api: str = "completions", stream: bool = True,
         warmup: int = 0, **endpoint: Any) -> RunResult:
    ep = Endpoint(base_url=url, model="fake-model", api=api, stream=stream, **endpoint)  # type: ignore[arg-type]
    specs = SPECS if api == "completions" else [RequestSpec(prompt="hello there", max_tokens=8)]
    return asyncio.run(run_load(ep, load, bounds, specs, warmup_specs=specs[:1] * warmup, timeout_s=30))


def test_ttft_itl_tpot_and_throughput_match_the_script(fake_server: ServerFactory) -> None:
    # TTFT long against loopback overhead (a few ms, more on a starved CPU) so 5% is meaningful.
    ttft, itl, tokens = 0.500, 0.050, 8
    server = fake_server([Script(ttft_s=ttft, itl_s=itl, tokens=tokens)])
    # Warm-up opens the 4 pooled connections, so no measured request pays for a TCP handshake.
    result = _run(server.base_url, Load("concurrency", 4), Bounds(num_requests=16), warmup=4)
    s = summarize(result.records, result.duration_s)

    assert s["completed"] == 16 and s["failed"] == 0
    assert s["ttft_ms"]["median"] == pytest.approx(ttft * 1000, rel=0.05)
    assert s["itl_ms"]["median"] == pytest.approx(itl * 1000, rel=0.05)
    assert s["tpot_ms"]["median"] == pytest.approx(itl * 1000, rel=0.05)
    assert s["total_output_tokens"] == 16 * tokens
    assert all(r.completion_tokens == tokens and r.chunks == tokens and r.prompt_tokens == 4 for r in result.records)
    assert all(r.output_chars == 3 * tokens for r in result.records) and s["output_chars_per_token"] == 3.0  # "tok"
    # 16 requests in 4 waves of 4, each ttft + 7 gaps long.
    per_request = ttft + (tokens - 1) * itl
    assert s["request_throughput"] == pytest.approx(4 / per_request, rel=0.05)
    assert s["output_token_throughput"] == pytest.approx(4 * tokens / per_request, rel=0.05)

    # The client's gaps are the server's write gaps, measured on the same clock.
    client_gaps = sorted(g for r in result.records for g in r.itl_s)
    served = server.served[4:]  # after the warm-up
    assert len(served) == 16
    server_gaps = sorted(b - a for srv in served for a, b in zip(srv.token_writes, srv.token_writes[1:]))
    assert abs(statistics.median(client_gaps) - statistics.median(server_gaps)) < 0.002
    assert abs(statistics.fmean(client_gaps) - statistics.fmean(server_gaps)) < 0.003


def test_poisson_rate_run_sends_on_schedule(fake_server: ServerFactory) -> None:
    server = fake_server([Script(ttft_s=0.0, itl_s=0.0, tokens=2)])
    rate, n = 40.0, 120
    result = _run(server.base_url, Load("rate", rate), Bounds(num_requests=n))
    assert len(result.records) == n and all(r.ok for r in result.records)
    lags = sorted(r.send_lag_s for r in result.records)
    assert lags[0] >= -1e-6  # never early
    assert statistics.median(lags) < 0.005  # the client is not the bottleneck
    # The Poisson shape is the schedule's (seed 0, so it is the same every run); the client's part
    # is to keep to it. The shape of the actual send gaps is not asserted: one scheduler hiccup on a
    # busy CI machine turns a few gaps into one long one and a burst, and the test would measure
    # the machine, not the client.
    scheduled = sorted(r.scheduled_s for r in result.records)
    gaps = [b - a for a, b in zip(scheduled, scheduled[1:])]
    # 120 exponential gaps: the mean is within ~3 standard errors (1/sqrt(119) ~ 9%) of 1/rate.
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.3)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.35)
    sent = sorted(r.sent_s for r in result.records)
    assert sent[-1] - sent[0] == pytest.approx(scheduled[-1] - scheduled[0], rel=0.3)


def test_errors_and_disconnects_are_counted_not_fatal(fake_server: ServerFactory) -> None:
    modes = ["ok", "http_error", "error_event", "disconnect", "no_done"]
    server = fake_server([Script(ttft_s=0.01, itl_s=0.005, tokens=4, mode=m) for m in modes])  # type: ignore[arg-type]
    result = _run(server.base_url, Load("concurrency", 1), Bounds(num_requests=10))
    s = summarize(result.records, result.duration_s)
    assert s["completed"] == 2 and s["failed"] == 8
    by_mode = {modes[r.index % 5]: r for r in result.records}
    assert by_mode["ok"].ok
    assert by_mode["http_error"].status == 500 and "scripted failure" in (by_mode["http_error"].error or "")
    assert by_mode["error_event"].status == 200 and "engine died" in (by_mode["error_event"].error or "")
    assert by_mode["disconnect"].error and by_mode["disconnect"].chunks == 2
    assert by_mode["no_done"].error == "stream ended without [DONE]"
    assert sum(s["errors"].values()) == 8


@pytest.mark.timing
def test_chat_stream_skips_the_role_chunk_and_survives_split_utf8(fake_server: ServerFactory) -> None:
    server = fake_server([Script(ttft_s=0.1, itl_s=0.01, tokens=5, text="日本🙂", split_writes=True)])
    result = _run(server.base_url, Load("concurrency", 2), Bounds(num_requests=4), api="chat", api_key="sk-test")
    assert all(r.ok and r.chunks == 5 and r.completion_tokens == 5 for r in result.records)
    assert all(r.output_chars == 5 * len("日本🙂") for r in result.records)  # characters, not bytes
    # The role chunk comes at once; TTFT must wait for the first content (100 ms + the split pause).
    assert min(r.ttft_s or 0 for r in result.records) >= 0.1
    assert server.served[0].body["messages"] == [{"role": "user", "content": "hello there"}]
    assert server.served[0].headers["authorization"] == "Bearer sk-test"


def test_non_streaming_and_ignore_eos_body(fake_server: ServerFactory) -> None:
    server = fake_server([Script(ttft_s=0.05, itl_s=0.01, tokens=6)])
    result = _run(server.base_url, Load("concurrency", 2), Bounds(num_requests=4), stream=False, ignore_eos=True)
    assert all(r.ok and r.completion_tokens == 6 and r.itl_s == [] and r.output_chars == 18 for r in result.records)
    assert all(r.ttft_s == r.latency_s or abs((r.ttft_s or 0) - (r.latency_s or 0)) < 0.01 for r in result.records)
    body = server.served[0].body
    assert body["ignore_eos"] is True and body["stream"] is False and "min_tokens" not in body
    assert "stream_options" not in body


@pytest.mark.timing
def test_duration_bound_and_concurrency_ramp_up(fake_server: ServerFactory) -> None:
    server = fake_server([Script(ttft_s=0.05, itl_s=0.0, tokens=1)])
    result = _run(server.base_url, Load("concurrency", 4, ramp_up_s=0.4), Bounds(duration_s=1.0))
    assert result.records and all(r.ok for r in result.records)
    assert max(r.sent_s for r in result.records) < 1.0 + 0.05
    # Ramp-up: the 4th worker joins at 0.3 s, so nothing runs 4-wide before then.
    early = [r for r in result.records if r.sent_s < 0.25]
    assert len({round(r.sent_s, 2) for r in early}) >= 2 and len(early) < 4 * 0.25 / 0.05
