"""End to end through the command line against the fake server: sweep, files, plots, compare."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from loadtest.cli import main
from server.__main__ import main as gateway_main
from tests.loadtest.conftest import ServerFactory
from tests.loadtest.fake_server import Script


def test_sweep_writes_json_csv_and_plots_and_compare_prints_ratios(
        fake_server: ServerFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = fake_server([Script(ttft_s=0.02, itl_s=0.005, tokens=4)])
    out = tmp_path / "sweep.json"
    # No `run` word: the default command. Model discovered from /v1/models.
    assert main(["--base-url", server.base_url + "/v1", "--concurrency", "1,2", "-n", "6", "--warmup", "1",
                 "--vocab-size", "5000", "--input-len", "8", "--output-len", "4", "--ignore-eos",
                 "--slo", "ttft:1000", "--slo", "tpot:1", "--out", str(out), "--plot", "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert [r["label"] for r in doc["runs"]] == ["concurrency=1", "concurrency=2"]
    for run in doc["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0 and s["total_output_tokens"] == 24
        assert s["good_requests"] == 0  # 5 ms per token misses a 1 ms TPOT SLO
        assert len(run["requests"]) == 6
    assert doc["config"]["model"] == "fake-model" and "api_key" not in doc["config"]
    assert len(server.served) == 2 + 12  # one warm-up per run
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert len(rows) == 12 and rows[0]["ok"] == "True" and len(rows[0]["itl_s"].split()) == 3
    for name in ("latency_vs_load", "throughput_vs_load", "ttft_hist", "itl_hist"):
        png = tmp_path / f"sweep_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stdout = capsys.readouterr().out
    assert "request throughput" in stdout and "goodput" in stdout

    # `llm-gateway bench compare` is `python -m loadtest compare`.
    assert gateway_main(["bench", "compare", str(out), str(out)]) == 0
    table = capsys.readouterr().out
    assert "request/s" in table and "1.000" in table


def test_rate_run_with_api_key_and_bad_slo(fake_server: ServerFactory, tmp_path: Path) -> None:
    server = fake_server([Script(ttft_s=0.0, itl_s=0.0, tokens=2)])
    assert main(["run", "--base-url", server.base_url, "--model", "m", "--rate", "50", "--burstiness", "0.5",
                 "-n", "10", "--vocab-size", "100", "--input-len", "4", "--output-len", "2",
                 "--api-key", "sk-1", "--extra-body", '{"min_tokens": 2}', "--no-progress",
                 "--out", str(tmp_path / "r.json")]) == 0
    served = server.served
    assert len(served) == 10 and all(s.headers["authorization"] == "Bearer sk-1" for s in served)
    assert all(s.body["min_tokens"] == 2 for s in served)
    assert "sk-1" not in (tmp_path / "r.json").read_text()
    with pytest.raises(SystemExit):
        main(["run", "--base-url", server.base_url, "--slo", "latency:5"])
