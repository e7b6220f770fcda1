"""What benchmarks/fair_share.py reports: per way (the fair queue, first come first served), the
light tenant's TTFT alone and under the flood, the flood's throughput and one of its requests' time
in the engine, the weighted split (the client's count and the gateway's), medians and spread over
the rounds; and the goals of issue 38."""

from __future__ import annotations

from typing import Any

from benchmarks.lib import fair_load

WAYS = ("fair", "fifo", "vllm")
"""The fair queue, first come first served (both the gateway), and `vllm serve` (the anchor)."""


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(values: list[float | None]) -> dict[str, float] | None:
        got = sorted(v for v in values if v is not None)
        return {"median": round(fair_load.p50(got), 4), "min": round(got[0], 4), "max": round(got[-1], 4)} if got else None

    result: dict[str, Any] = {}
    for way in WAYS:
        runs = [r for r in rounds if r["way"] == way]
        if way == "vllm" and not runs:
            continue  # the anchor is optional: a summary without it keeps its old shape
        result[way] = {
            "b_ttft_p50_alone_s": med([r["b_alone"]["ttft_p50_s"] for r in runs]),
            "b_ttft_p50_flooded_s": med([r["a_with_b"]["b"]["ttft_p50_s"] for r in runs]),
            "b_ttft_max_flooded_s": med([r["a_with_b"]["b"]["ttft_max_s"] for r in runs]),
            "a_e2e_p50_s": med([r["a_alone"]["e2e_p50_s"] for r in runs]),
            "a_service_p50_s": med([r["a_alone"]["service_p50_s"] for r in runs]),
            "a_tokens_per_s_alone": med([r["a_alone"]["tokens_per_s"] for r in runs]),
            "a_tokens_per_s_with_b": med([r["a_with_b"]["a_tokens_per_s"] for r in runs]),
        }
        if way == "fair":
            result[way]["weights_split"] = med([r["weights"]["split"] for r in runs if "weights" in r])
            result[way]["weights_server_split"] = med([r["weights"].get("server_split") for r in runs if "weights" in r])
    pairs = zip([r for r in rounds if r["way"] == "fair"], [r for r in rounds if r["way"] == "fifo"])
    result["a_throughput_fair_over_fifo"] = med([f["a_alone"]["tokens_per_s"] / o["a_alone"]["tokens_per_s"]
                                                 for f, o in pairs if o["a_alone"]["tokens_per_s"]])
    fair = result["fair"]
    if fair["b_ttft_p50_alone_s"] and fair["b_ttft_p50_flooded_s"] and fair["a_service_p50_s"]:
        # B alone plus the time one of A's running requests takes (in the engine, not its wait).
        bound = fair["b_ttft_p50_alone_s"]["median"] + fair["a_service_p50_s"]["median"]
        result["goals"] = {
            "b_ttft_flooded_within_alone_plus_one_a_request": fair["b_ttft_p50_flooded_s"]["median"] <= bound,
            "bound_s": round(bound, 4),
            # None when the run measured the fair queue alone (--ways fair)
            "a_throughput_at_least_0.9x_fifo": (result["a_throughput_fair_over_fifo"]["median"] >= 0.9
                                                if result["a_throughput_fair_over_fifo"] else None),
            # the H200's goals: B's TTFT under the flood within 3x alone, a 3:1 split within 10%
            "b_ttft_flooded_over_alone": round(fair["b_ttft_p50_flooded_s"]["median"] / fair["b_ttft_p50_alone_s"]["median"], 3),
        }
        anchor = result.get("vllm")
        if anchor and anchor["b_ttft_p50_alone_s"] and anchor["b_ttft_p50_flooded_s"]:
            # the same ratio for `vllm serve` on the same engine flags: the engine's own wait
            result["goals"]["vllm_b_ttft_flooded_over_alone"] = round(
                anchor["b_ttft_p50_flooded_s"]["median"] / anchor["b_ttft_p50_alone_s"]["median"], 3)
        if fair.get("weights_split"):
            result["goals"]["weights_split_within_10pct_of_3"] = abs(fair["weights_split"]["median"] / 3 - 1) <= 0.1
    return result
