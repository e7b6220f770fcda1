"""CPU smoke runs of the HTTP benchmarks with the embedded model (slow: engines start)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lib import servers

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_http_overhead_cpu_smoke(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "smoke.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.http_overhead", "--device", "cpu",
         "--concurrency", "1,2", "--requests", "4", "--input-tokens", "32", "--output-tokens", "8",
         "--out", str(out), "--workdir", str(tmp_path / "work"), "--deadline-s", "480", "--min-left-s", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    recs = servers.load_jsonl([out])
    cells = {(r["way"], r["concurrency"]) for r in recs}
    assert cells == {(w, c) for w in ("inproc", "gateway", "vllm") for c in (1, 2)}, proc.stdout[-4000:]
    for r in recs:
        assert r["failed"] == 0 and r["completed"] == 4, r
        assert r["total_output_tokens"] == 4 * 8, r  # ignore_eos: fixed output length everywhere
        assert r["ttft_p50_ms"] > 0 and r["request_throughput"] > 0
    assert "| 2 | gateway (loadtest) |" in proc.stdout


@pytest.mark.slow
def test_reload_under_load_cpu_smoke(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "reload.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.reload_under_load", "--device", "cpu",
         "--concurrency", "2", "--output-tokens", "8", "--baseline-s", "4", "--settle-s", "3",
         "--out", str(out), "--workdir", str(tmp_path / "work"), "--deadline-s", "480"],
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    recs = servers.load_jsonl([out])
    reloads = [r for r in recs if r["kind"] == "reload"]
    assert [r["strategy"] for r in reloads] == ["drain-swap", "blue-green"], proc.stdout[-4000:]
    for r in reloads:
        assert r["http_status"] == 200 and r["server"]["outcome"] == "success", r
        assert r["window"]["requests"] > 0
    run = [r for r in recs if r["kind"] == "run"][0]
    assert run["requests"] > 0 and run["failed"] == 0, json.dumps(run)


def test_frontend_capacity_runs_two_trees_side_by_side(tmp_path: Path) -> None:
    """The scripted-engine capacity benchmark (no model, seconds): this tree twice, interleaved."""
    out = tmp_path / "capacity.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.frontend_capacity", "--tree", f"a={ROOT}",
         "--tree", f"b={ROOT}", "--rounds", "2", "--concurrency", "4", "--requests", "16",
         "--output-tokens", "8", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {"a", "b"} and doc["summary"]["a"]["vs_a"] == 1.0
    for name in ("a", "b"):
        assert [r["round"] for r in doc["runs"][name]] == [0, 1]
        assert all(r["failed"] == 0 and r["out_tok_s"] > 0 for r in doc["runs"][name])


def interleaved(tmp_path: Path, *args: str,
                deadline_s: int = 800) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    """`python -m benchmarks.http_interleaved` on the CPU, all files under tmp_path: (process, results, document)."""
    out, doc = tmp_path / "results.jsonl", tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.http_interleaved", "--device", "cpu", *args,
         "--out", str(out), "--doc", str(doc), "--workdir", str(tmp_path / "work"), "--deadline-s", str(deadline_s)],
        cwd=ROOT, capture_output=True, text=True, timeout=deadline_s + 100)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, out, doc


@pytest.mark.slow
def test_http_interleaved_cpu_smoke(model_dir: Path, tmp_path: Path) -> None:
    """Three engines up at once, every cell interleaving the ways; medians, ratios, client check."""
    proc, out, doc = interleaved(tmp_path, "--concurrency", "1,4", "--repeats", "2", "--requests", "4",
                                 "--input-tokens", "32", "--output-tokens", "8", "--loadtest-workers", "2")
    recs = servers.load_jsonl([out])
    timed = [r for r in recs if not r.get("client_check")]
    assert sorted((r["way"], r["concurrency"], r["repeat"]) for r in timed) == sorted(
        (w, c, rep) for w in ("inproc", "gateway", "vllm") for c in (1, 4) for rep in (0, 1))
    assert all(r["failed"] == 0 and r["total_output_tokens"] == 4 * 8 for r in recs), recs
    # every way streamed text (SmolLM2 with real weights: several characters a token), in-process too
    assert all(r["output_chars_per_token"] > 0.5 for r in recs), [(r["way"], r["output_chars_per_token"]) for r in recs]
    checks = json.loads(doc.read_text())["meta"]["client_checks"]
    assert {c["way"] for c in checks} == {"gateway", "vllm"} and all(c["workers_doubled"] == 4 for c in checks)
    summary = json.loads(doc.read_text())["meta"]["summary"]
    assert {(r["way"], r["concurrency"]) for r in summary if r["repeats"] == 2} == {
        (w, c) for w in ("inproc", "gateway", "vllm") for c in (1, 4)}
    assert "| 4 | gateway (loadtest) | 2 |" in proc.stdout
    # lib/engine_side.py: every way read the engine core's own per-token interval and its CPU
    assert all(r["engine_itl_ms"] > 0 and r["engine_tokens_per_step"] >= 1 and r["engine_cpu_cores"] > 0
               for r in timed), [(r["way"], r.get("engine_itl_ms"), r.get("engine_cpu_cores")) for r in timed]
    assert all(r["client_cpu_cores"] > 0 for r in timed if r["way"] != "inproc")
    assert "| 4 | gateway (loadtest) | " in proc.stdout.split("Engine side and CPU per cell")[1]


@pytest.mark.slow
def test_http_interleaved_text_prompts_cpu_smoke(model_dir: Path, tmp_path: Path) -> None:
    """Issue 14, goal 4 in small: text prompts of an exact token length, gateway and vllm serve only."""
    proc, out, doc = interleaved(tmp_path, "--text-prompts", "--ways", "inproc,gateway,vllm", "--concurrency", "2",
                                 "--repeats", "1", "--requests", "4", "--input-tokens", "64", "--output-tokens", "8",
                                 "--loadtest-workers", "1", deadline_s=900)
    assert "the in-process way is left out" in proc.stdout
    recs = servers.load_jsonl([out])
    timed = [r for r in recs if not r.get("client_check")]
    assert sorted(r["way"] for r in timed) == ["gateway", "vllm"], proc.stdout[-4000:]
    for r in recs:
        assert r["failed"] == 0 and r["total_output_tokens"] == 4 * 8, r
        assert "--text-prompts --tokenizer $MODEL_DIR" in r["loadtest_cmd"], r["loadtest_cmd"]
        assert r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
    # the same texts everywhere, each exactly 64 tokens as the server counts them
    assert {r["total_input_tokens"] for r in timed} == {4 * 64}, [r["total_input_tokens"] for r in timed]
    summary = json.loads(doc.read_text())["meta"]["summary"]
    assert all(r["ttft_p99_ms_median"] is not None for r in summary)
    assert "| TTFT p99 median ms (min-max) |" in proc.stdout and "| 2 | vllm serve (loadtest) | 1 |" in proc.stdout


@pytest.mark.slow
def test_http_interleaved_api_server_ways_cpu_smoke(model_dir: Path, tmp_path: Path) -> None:
    """Experiment G0 in small: `vllm serve` with one and with two API servers, interleaved."""
    proc, out, _ = interleaved(tmp_path, "--ways", "vllm,vllm2", "--concurrency", "2", "--repeats", "1",
                               "--requests", "4", "--input-tokens", "32", "--output-tokens", "8",
                               "--loadtest-workers", "1", "--no-client-check")
    recs = servers.load_jsonl([out])
    assert sorted(r["way"] for r in recs) == ["vllm", "vllm2"], proc.stdout[-4000:]
    assert all(r["failed"] == 0 and r["total_output_tokens"] == 4 * 8 for r in recs), recs
    log = (tmp_path / "work" / "vllm2.log").read_text(errors="replace")
    assert "ApiServer_0" in log and "ApiServer_1" in log  # two API-server processes served
    assert "| 2 | vllm serve --api-server-count 2 (loadtest) | 1 |" in proc.stdout


@pytest.mark.slow
def test_dummy_outputs_cpu_smoke(model_dir: Path, tmp_path: Path) -> None:
    """The real CPU engine with dummy weights: the tool counts and replays what it generated."""
    out = tmp_path / "dummy.json"
    # pytest's tmp paths are too long for vLLM's IPC sockets: rpc_dir falls back to a short one
    env = servers.clean_env({"VLLM_CACHE_ROOT": str(tmp_path / "cache"), "TMPDIR": str(tmp_path),
                              "VLLM_RPC_BASE_PATH": str(servers.rpc_dir(tmp_path, "run")),
                              "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.experiments.dummy_outputs", "--device", "cpu", "--model", str(model_dir),
         "--prompts", "2", "--input-tokens", "32", "--output-tokens", "16", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["output_ids"] == 2 * 16 and 0.0 <= doc["special_share"] <= 1.0
    assert doc["detok_us_per_step_model"] > 0 and doc["detok_us_per_step_random"] > 0
