"""`--workers N`: load split between spawned client processes, records merged into one run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.client import Endpoint
from loadtest.metrics import percentile, summarize
from loadtest.records import RequestRecord, RequestSpec
from loadtest.runner import Bounds, Load
from loadtest.workers import WorkerResult, merge, plan, split, split_load
from tests.loadtest.conftest import ServerFactory
from tests.loadtest.fake_server import Script


def _keys(value: object) -> object:
    """The shape of a JSON value: dict keys (recursively), not values; lists by their first item."""
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return None


def _run_args(url: str, out: Path, *extra: str) -> list[str]:
    return ["run", "--base-url", url, "--concurrency", "4", "-n", "40", "--vocab-size", "5000",
            "--input-len", "8", "--output-len", "4", "--ignore-eos", "--out", str(out), "--no-progress", *extra]


@pytest.mark.timing
def test_two_workers_against_the_fake_server(fake_server: ServerFactory, tmp_path: Path) -> None:
    server = fake_server([Script(ttft_s=0.02, itl_s=0.005, tokens=4)])
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert main(_run_args(server.base_url, one)) == 0
    assert main(_run_args(server.base_url, two, "--workers", "2", "--warmup", "2")) == 0
    doc1, doc2 = json.loads(one.read_text()), json.loads(two.read_text())
    run = doc2["runs"][0]
    s = run["summary"]
    assert s["completed"] == 40 and s["failed"] == 0 and s["errors"] == {}
    assert s["total_output_tokens"] == 160
    assert doc2["config"]["workers"] == 2 and run["workers"] == 2
    assert doc1["config"]["workers"] == 1 and doc1["runs"][0]["workers"] == 1
    assert run["label"] == "concurrency=4" and run["load"]["value"] == 4
    assert _keys(doc1) == _keys(doc2)
    assert sorted(r["index"] for r in run["requests"]) == list(range(40))
    # The workers' disjoint slices of the prompt pool: the same 40 prompts as the one-process run.
    served = [str(r.body["prompt"]) for r in server.served]
    assert len(served) == 40 + 2 + 40  # one warm-up request per worker
    assert not Counter(served[:40]) - Counter(served[40:])
    # Started together: both workers' first sends lie within a fraction of the run.
    first_sends = sorted(r["sent_s"] for r in run["requests"])[:4]
    assert first_sends[-1] < 0.5 * s["duration_s"]


def _rec(i: int, sent: float, ttft: float, latency: float, tokens: int = 5) -> RequestRecord:
    itl = [(latency - ttft) / (tokens - 1)] * (tokens - 1)
    return RequestRecord(index=i, scheduled_s=sent, sent_s=sent, ttft_s=ttft, itl_s=itl, latency_s=latency,
                         prompt_tokens=10, completion_tokens=tokens, chunks=tokens, status=200)


def test_merged_percentiles_are_over_all_records_not_per_worker() -> None:
    # Worker 0 is fast (TTFT 10..50 ms), worker 1 slow (TTFT 1..3 s, 3 requests): the per-worker
    # medians are 30 ms and 2000 ms, their mean 1015 ms; the global median of the 8 is 45 ms.
    fast = [_rec(i, 0.1 * i, 0.01 * (i + 1), 0.2 + 0.01 * i) for i in range(5)]
    slow = [_rec(i, 0.2 * i, 1.0 + i, 4.0 + i) for i in range(3)]
    w0, w1 = WorkerResult(0, 100.0, fast), WorkerResult(1, 100.25, slow)
    merged = merge(Load("concurrency", 4), [w0, w1])
    assert merged.workers == 2 and len(merged.records) == 8
    assert [r.index for r in merged.records] == list(range(8))
    # Times moved onto the earliest start: worker 1 started 0.25 s later.
    assert sorted(r.sent_s for r in merged.records) == pytest.approx(sorted(
        [r.sent_s for r in fast] + [r.sent_s + 0.25 for r in slow]))
    assert merged.duration_s == pytest.approx(0.25 + 0.4 + 6.0)

    s = summarize(merged.records, merged.duration_s)
    ttfts = [r.ttft_s for r in fast + slow]
    assert s["ttft_ms"]["median"] == pytest.approx(percentile(ttfts, 50) * 1000) == pytest.approx(45.0)
    for p, q in (("p90", 90), ("p99", 99)):
        assert s["ttft_ms"][p] == pytest.approx(percentile(ttfts, q) * 1000)
    e2e = [r.latency_s for r in fast + slow]
    assert s["e2e_ms"]["median"] == pytest.approx(percentile(e2e, 50) * 1000)
    itl = [g for r in fast + slow for g in r.itl_s]
    assert s["itl_ms"]["p90"] == pytest.approx(percentile(itl, 90) * 1000)
    per_worker = [summarize(w.records, 1.0)["ttft_ms"]["median"] for w in (w0, w1)]
    assert per_worker == pytest.approx([30.0, 2000.0])
    assert s["ttft_ms"]["median"] not in per_worker
    assert s["ttft_ms"]["median"] != pytest.approx(sum(per_worker) / 2)
    assert s["completed"] == 8 and s["total_output_tokens"] == 40
    assert s["output_token_throughput"] == pytest.approx(40 / merged.duration_s)
    # The workers' own records are left as they were.
    assert slow[0].sent_s == 0.0 and slow[2].index == 2


def test_merge_sums_errors() -> None:
    bad = RequestRecord(index=0, scheduled_s=0.0, status=500, error="HTTP 500: boom")
    merged = merge(Load("rate", 4.0), [WorkerResult(0, 5.0, [bad, _rec(1, 0.1, 0.1, 0.5)]),
                                       WorkerResult(1, 5.0, [bad])])
    s = summarize(merged.records, merged.duration_s)
    assert (s["completed"], s["failed"], s["errors"]) == (1, 2, {"HTTP 500: boom": 2})


def test_split_and_plan() -> None:
    assert split(10, 3) == [4, 3, 3] and split(4, 4) == [1, 1, 1, 1] and split(0, 2) == [0, 0]
    assert [p.value for p in split_load(Load("concurrency", 10), 3)] == [4, 3, 3]
    rates = split_load(Load("rate", 9.0, max_concurrency=5, ramp_up_s=2.0), 2)
    assert [(p.value, p.max_concurrency, p.ramp_up_s) for p in rates] == [(4.5, 3, 2.0), (4.5, 2, 2.0)]
    assert split_load(Load("rate", float("inf")), 2)[1].value == float("inf")
    specs = [RequestSpec(prompt=[i], max_tokens=4) for i in range(10)]
    jobs = plan(Endpoint("http://x", "m"), Load("concurrency", 3), Bounds(10, 5.0), specs, workers=3,
                warmup_specs=specs[:2], seed=7)
    assert [j.bounds for j in jobs] == [Bounds(4, 5.0), Bounds(3, 5.0), Bounds(3, 5.0)]
    assert [[s.prompt[0] for s in j.specs] for j in jobs] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [len(j.warmup_specs) for j in jobs] == [1, 1, 0] and [j.seed for j in jobs] == [7, 8, 9]
    duration_only = plan(Endpoint("http://x", "m"), Load("concurrency", 2), Bounds(None, 5.0), specs, workers=2)
    assert [j.bounds.num_requests for j in duration_only] == [None, None]


@pytest.mark.parametrize(("extra", "message"), [
    (["--concurrency", "4", "--workers", "0"], "--workers must be >= 1"),
    (["--concurrency", "2", "--workers", "3"], "needs --concurrency >= 3"),
    (["--concurrency", "8,2", "--workers", "4"], "at every sweep point"),
    (["--workers", "2"], "needs --concurrency >= 2"),  # default concurrency 1
    (["--concurrency", "4", "-n", "1", "--workers", "2"], "needs --num-requests >= 2"),
    (["--rate", "4", "--max-concurrency", "1", "--workers", "2"], "--max-concurrency >= 2"),
    (["--rate", "4", "--burstiness", "0.5", "--workers", "2"], "--burstiness"),
])
def test_argument_errors(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--base-url", "http://127.0.0.1:9", "--model", "m", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_mentions_workers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "--workers" in out and "progress" in out
