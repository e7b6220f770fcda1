"""Summary statistics on hand-made records."""

from __future__ import annotations

import math

import pytest

from loadtest.metrics import meets_slos, peak_output_rate, percentile, summarize
from loadtest.records import RequestRecord


def _rec(i: int, sent: float, ttft: float, itl: list[float], tokens: int | None = None, error: str | None = None) -> RequestRecord:
    n = tokens if tokens is not None else len(itl) + 1
    return RequestRecord(index=i, scheduled_s=sent, sent_s=sent, ttft_s=ttft, itl_s=itl,
                         latency_s=ttft + sum(itl), prompt_tokens=10, completion_tokens=n,
                         chunks=len(itl) + 1, status=200 if error is None else 500, error=error)


def test_percentile_interpolates_like_numpy() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)  # numpy.percentile(values, 90)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert math.isnan(percentile([], 50))


def test_tpot_follows_vllm_definition() -> None:
    r = _rec(0, 0.0, 0.5, [0.1, 0.1, 0.1])
    assert r.tpot_s == pytest.approx((0.8 - 0.5) / 3)
    assert _rec(1, 0.0, 0.5, []).tpot_s is None  # one token: no decode phase


def test_summary_counts_throughput_and_goodput() -> None:
    records = [
        _rec(0, 0.0, 0.1, [0.02] * 9),        # fast
        _rec(1, 0.0, 0.9, [0.02] * 9),        # TTFT over the SLO
        _rec(2, 0.5, 0.1, [0.08] * 9),        # TPOT over the SLO
        _rec(3, 0.5, 0.1, [0.02], error="boom"),
    ]
    s = summarize(records, duration_s=2.0, slos_ms={"ttft": 500, "tpot": 50})
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_token_throughput"] == pytest.approx(30 / 2.0)
    assert s["input_token_throughput"] == pytest.approx(30 / 2.0)
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.5)
    assert s["ttft_ms"]["median"] == pytest.approx(100.0)
    assert s["itl_ms"]["max"] == pytest.approx(80.0)
    assert s["errors"] == {"boom": 1}
    assert not meets_slos(records[3], {})


def test_peak_output_rate_uses_one_second_buckets() -> None:
    # 10 tokens at t=0.1..0.19, 5 tokens in the next second.
    a = _rec(0, 0.0, 0.1, [0.01] * 9)
    b = _rec(1, 1.0, 0.2, [0.1] * 4)
    assert peak_output_rate([a, b]) == pytest.approx(10.0)
