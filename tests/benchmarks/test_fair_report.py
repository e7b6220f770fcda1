"""benchmarks/lib/fair_report.py: the summary of benchmarks.fair_share's rounds, with both ways or the fair queue alone."""

from __future__ import annotations

from typing import Any

from benchmarks.lib.fair_report import summarize


def round_of(way: str, *, b_alone: float, b_flooded: float, a_tps: float, service: float,
             split: tuple[float, float] | None = None) -> dict[str, Any]:
    r: dict[str, Any] = {
        "round": 0, "way": way, "flood": 256,
        "b_alone": {"ttft_p50_s": b_alone},
        "a_alone": {"tokens_per_s": a_tps, "e2e_p50_s": service + 0.1, "service_p50_s": service},
        "a_with_b": {"a_tokens_per_s": a_tps, "b": {"ttft_p50_s": b_flooded, "ttft_max_s": 2 * b_flooded}},
    }
    if split:
        r["weights"] = {"split": split[0], "server_split": split[1]}
    return r


def test_both_ways_compare_the_flood_and_give_both_splits() -> None:
    s = summarize([round_of("fair", b_alone=0.05, b_flooded=0.8, a_tps=110, service=2.3, split=(2.9, 3.1)),
                   round_of("fifo", b_alone=0.05, b_flooded=16.9, a_tps=117, service=2.2)])
    assert s["fair"]["weights_split"]["median"] == 2.9 and s["fair"]["weights_server_split"]["median"] == 3.1
    assert s["a_throughput_fair_over_fifo"]["median"] == round(110 / 117, 4)
    goals = s["goals"]
    assert goals["b_ttft_flooded_within_alone_plus_one_a_request"] and goals["bound_s"] == 2.35
    assert goals["a_throughput_at_least_0.9x_fifo"] is True
    assert goals["weights_split_within_10pct_of_3"] is True  # the client's count decides


def test_the_fair_queue_alone_leaves_the_fifo_comparison_open() -> None:
    s = summarize([round_of("fair", b_alone=0.011, b_flooded=0.091, a_tps=17865, service=0.81, split=(1.0, 1.0))])
    assert s["fifo"]["b_ttft_p50_alone_s"] is None and s["a_throughput_fair_over_fifo"] is None
    # not measured is not failed: None, where a False would claim the flood lost throughput
    assert s["goals"]["a_throughput_at_least_0.9x_fifo"] is None
    assert s["goals"]["b_ttft_flooded_over_alone"] == round(0.091 / 0.011, 3)
    assert s["goals"]["weights_split_within_10pct_of_3"] is False


def test_the_vllm_anchor_gets_its_own_ratio() -> None:
    s = summarize([round_of("fair", b_alone=0.010, b_flooded=0.074, a_tps=17800, service=0.8, split=(1.0, 1.0)),
                   round_of("vllm", b_alone=0.012, b_flooded=0.060, a_tps=18000, service=0.8)])
    assert s["vllm"]["b_ttft_p50_flooded_s"]["median"] == 0.06
    assert s["goals"]["vllm_b_ttft_flooded_over_alone"] == 5.0
    assert "vllm" not in summarize([round_of("fair", b_alone=0.01, b_flooded=0.02, a_tps=1, service=1)])
