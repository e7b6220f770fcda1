"""benchmarks/lib/engine_side.py (engine-stamped histograms and CPU shares per cell) and lib/gc_report.py (the
GC-pauses experiment's table); no engine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.lib import engine_side, gc_report

EXPOSITION = """# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 90.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} %(itl_n)s
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} %(itl_s)s
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} %(req_n)s
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} %(pre_s)s
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} %(req_n)s
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} NaN
vllm:iteration_tokens_total_count{engine="0",model_name="m"} %(steps)s
vllm:iteration_tokens_total_count{engine="1",model_name="m"} %(steps)s
vllm:generation_tokens_total{engine="0",model_name="m"} %(gen)s
gateway_requests_total{route="/v1/completions"} 7.0
"""


def _text(**v: float) -> str:
    return EXPOSITION % v


def test_engine_delta_reads_means_over_the_cell_and_tokens_per_step() -> None:
    before = engine_side.parse_vllm(_text(itl_n=100, itl_s=0.5, req_n=4, pre_s=0.2, steps=50, gen=100))
    after = engine_side.parse_vllm(_text(itl_n=1100, itl_s=5.5, req_n=8, pre_s=0.6, steps=300, gen=1100))
    assert "gateway_requests_total" not in after and after["vllm:iteration_tokens_total_count"] == 600.0  # 2 engines
    side = engine_side.engine_delta(before, after)
    assert side["engine_itl_ms"] == 5.0  # 5.0 s over 1,000 tokens
    assert side["engine_prefill_ms"] == 100.0  # 0.4 s over 4 requests
    assert side["engine_queue_ms"] == 0.0  # NaN samples are skipped, not summed
    assert side["engine_steps"] == 500 and side["engine_tokens_per_step"] == 2.0
    assert engine_side.engine_delta(None, after) == {}  # a server that did not answer: no fields
    same = engine_side.engine_delta(after, after)
    assert same["engine_itl_ms"] is None and same["engine_tokens_per_step"] is None


def test_scrape_of_a_port_with_no_server_is_none() -> None:
    import socket

    with socket.socket() as s:  # a loopback port bound and never listened on: refused at once
        s.bind(("127.0.0.1", 0))
        assert engine_side.scrape(f"http://127.0.0.1:{s.getsockname()[1]}", timeout_s=2) is None


@pytest.mark.timing
def test_cpu_meter_counts_the_frontend_its_children_and_reaped_clients() -> None:
    busy = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        meter = engine_side.CpuMeter(os.getpid())
        end = time.process_time() + 0.3
        while time.process_time() < end:  # the frontend's own work
            pass
        subprocess.run([sys.executable, "-c", busy], check=True)  # a load client, reaped
        side = meter.stop()
    finally:
        child.kill()
        child.wait()
    assert side["frontend_cpu_cores"] > 0.2 * 0.3 / side["cell_wall_s"]
    assert side["client_cpu_cores"] * side["cell_wall_s"] >= 0.35  # the reaped child's 0.4 s
    assert 0 <= side["engine_cpu_cores"] < 0.5  # the sleeping child: nearly nothing
    assert 0 <= side["host_cpu_busy_pct"] <= 100 and side["host_cpus"] == os.cpu_count()


def test_gc_pauses_table_compares_pause_time_per_thousand_requests() -> None:
    def rec(way: str, full: int, ms: float) -> dict:
        return {"way": way, "completed": 500, "gc_full_collections": full, "gc_pause_ms": ms,
                "ttft_p99_ms": 80.0, "output_token_throughput": 900.0}

    rows = {r["way"]: r for r in gc_report.summarize(
        [rec("frozen", 3, 3.0), rec("unfrozen", 1, 240.0), rec("frozen", 1, 1.0), rec("unfrozen", 0, 0.0)])}
    assert rows["frozen"]["pause_ms_per_1k_requests"] == 4.0 and rows["frozen"]["pause_ms_mean"] == 1.0
    assert rows["unfrozen"]["pause_ms_per_1k_requests"] == 240.0 and rows["unfrozen"]["full_collections"] == 1
    assert "| unfrozen | 2 | 1000 | 1 | 240 | 240 | 240 | 80.0 | 900 |" in gc_report.table(list(rows.values()))
    assert gc_report.GC_SAMPLE.findall("gateway_gc_full_collection_seconds_count 3.0\n"
                                       "gateway_gc_full_collection_seconds_sum 0.25\n") == [("count", "3.0"),
                                                                                          ("sum", "0.25")]


def test_gc_pauses_counts_stalls_in_the_streams_of_a_loadtest_cell() -> None:
    ramp = [0.9] * gc_report.RAMP_TOKENS  # other requests' prefills: not a stall
    requests = [{"itl_s": ramp + [0.01, 0.48, 0.01, 0.31]}, {"itl_s": ramp + [0.01, 0.02]}, {"itl_s": None}]
    assert gc_report.stream_gaps(requests) == {"max_token_gap_ms": 480.0, "token_gaps_over_stall": 2,
                                               "requests_with_stall": 1}
    rows = gc_report.summarize([{"way": "unfrozen", "completed": 3, "gc_full_collections": 1, "gc_pause_ms": 470.0,
                                 "ttft_p99_ms": 80.0, "output_token_throughput": 900.0,
                                 **gc_report.stream_gaps(requests)}])
    assert gc_report.table(rows).splitlines()[-1].endswith("| 480 | 1 |")


def test_cell_meter_reads_before_and_after_and_merges_cpu() -> None:
    reads = iter([engine_side.parse_vllm(_text(itl_n=0, itl_s=0, req_n=0, pre_s=0, steps=0, gen=0)),
                  engine_side.parse_vllm(_text(itl_n=10, itl_s=0.05, req_n=1, pre_s=0.02, steps=5, gen=10))])
    side = engine_side.CellMeter(os.getpid(), lambda: next(reads), count_clients=False).stop()
    assert side["engine_itl_ms"] == 5.0 and side["engine_tokens_per_step"] == 1.0  # 2 engines, 5 steps each
    assert "frontend_cpu_cores" in side and "client_cpu_cores" not in side
    line = engine_side.brief(side)
    assert line.startswith("engine ITL 5.0 ms, 1.0 tok/step; CPU cores: frontend ") and "clients" not in line
