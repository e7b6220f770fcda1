"""The ways of serving one engine profile that the HTTP drivers compare (the library half of
http_overhead.py; http_interleaved.py and the experiments use it too): the in-process AsyncLLM
(benchmarks/lib/inproc.py), the gateway and `vllm serve` (`vllmN`: N API servers). Their names and
labels, the requests and seeds per cell, the one loadtest command every HTTP way gets, the `vllm
serve` command from the gateway's engine arguments, the result line of a cell, the table and goal
check of http_overhead.py, and starting a server and running one loadtest cell against it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.lib import engine_side, servers

WAYS = ("inproc", "gateway", "vllm")  # the default ways; `vllmN` ways are asked for by name
WAY_LABEL = {"inproc": "in-process AsyncLLM", "gateway": "gateway (loadtest)", "vllm": "vllm serve (loadtest)"}
# Goals from issue 9 part 2
CELL_DONE = "[inproc] cell done"  # the child's answer to each cell it read from stdin
GOAL_VS_INPROC = 0.97
GOAL_VS_VLLM = 1.00
GOAL_TTFT_P50_MS = 2.0


def api_server_count(way: str) -> int | None:
    """N for a `vllm serve` way (`vllm` is 1, `vllm4` is 4), None for any other way."""
    if way == "vllm":
        return 1
    if way.startswith("vllm") and way[4:].isdigit() and int(way[4:]) >= 1:
        return int(way[4:])
    return None


def known_way(way: str) -> bool:
    return way in WAYS or api_server_count(way) is not None


def parse_ways(text: str) -> list[str]:
    """The comma-separated ways, in order; an unknown one stops the run before any engine starts."""
    ways = text.split(",")
    unknown = [w for w in ways if not known_way(w)]
    if unknown:
        raise SystemExit(f"unknown ways {unknown} (ways: {', '.join(WAYS)}, vllmN)")
    return ways


def way_label(way: str) -> str:
    n = api_server_count(way)
    if n is not None and n > 1:
        return f"vllm serve --api-server-count {n} (loadtest)"
    return WAY_LABEL.get(way, way)


def way_order(way: str) -> tuple[int, int]:
    """Table order: in-process, gateway, then `vllm serve` by API-server count."""
    n = api_server_count(way)
    if n is not None:
        return (len(WAYS), n)
    return (WAYS.index(way) if way in WAYS else len(WAYS) + 1, 0)  # a way from an older results file last


def requests_for(concurrency: int, fixed: int | None, cell_output_tokens: int = 0, output_tokens: int = 1) -> int:
    """Requests per timed run: --requests, else 2 waves (at least 16), or more for
    --cell-output-tokens up to 8 waves (a c = 32 cell of 2 waves lasted 2-4 s on the H200: noise;
    at c = 1 the cap keeps a cell at 16 requests)."""
    if fixed:
        return fixed
    for_tokens = -(-cell_output_tokens // max(1, output_tokens))
    return max(16, 2 * concurrency, min(for_tokens, 8 * concurrency))


def seed_for(base: int, concurrency: int) -> int:
    # a different prompt set per concurrency, so prefix caching (where on) never hits between runs;
    # loadtest's warm-up uses seed + 1
    return base + 1000 * concurrency


def client_workers(concurrency: int, workers: int) -> int:
    """loadtest processes for one run: as asked, but never more than the requests in flight."""
    return max(1, min(workers, concurrency))


def loadtest_cmd(base_url: str, model: str, concurrency: int, requests: int, warmup: int,
                 input_tokens: int, output_tokens: int, vocab_size: int, seed: int, out: Path,
                 workers: int = 1, text_tokenizer: str | None = None) -> list[str]:
    """The one loadtest command both HTTP servers get (only --base-url and --out differ).
    With `text_tokenizer` (the model directory) the prompts are text that this tokenizer encodes to
    exactly `input_tokens` ids (loadtest decodes random ids and refits), so the server tokenizes."""
    text = ["--text-prompts", "--tokenizer", text_tokenizer] if text_tokenizer else []
    return [sys.executable, "-m", "loadtest", "run", "--base-url", base_url, "--model", model,
            "--concurrency", str(concurrency), "-n", str(requests), "--warmup", str(warmup),
            "--input-len", str(input_tokens), "--output-len", str(output_tokens),
            "--vocab-size", str(vocab_size), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--timeout", "600", "--no-progress", "--out", str(out),
            "--workers", str(client_workers(concurrency, workers))] + text


def vllm_serve_cmd(kwargs: dict[str, Any], port: int, api_servers: int = 1) -> list[str]:
    """`vllm serve` with the AsyncEngineArgs the gateway would pass (same names, kebab-case), with
    `api_servers` API-server processes on its one engine core."""
    entry = ["-m", "vllm.entrypoints.openai.api_server"]
    if api_servers > 1:
        # Only the `vllm serve` CLI starts several API servers; the api_server module runs one
        # whatever --api-server-count says (vLLM 0.26 and 0.32).
        entry = ["-m", "benchmarks.vllm_cli", "serve", "--api-server-count", str(api_servers)]
    cmd = [sys.executable, *entry, "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"]
    for key, value in kwargs.items():
        if key in ("enable_log_requests", "disable_log_stats"):
            continue  # the server's defaults already match (request logging off, stats on)
        flag = "--" + key.replace("_", "-")
        if key == "served_model_name":
            cmd += [flag, *[str(v) for v in value]]
        elif isinstance(value, bool):
            cmd.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            cmd += [flag, json.dumps(value)]
        else:
            cmd += [flag, str(value)]
    return cmd


def summary_fields(summary: dict[str, Any]) -> dict[str, Any]:
    """A loadtest-style summary (loadtest.metrics.summarize) as flat result fields (NaN -> None)."""
    def q_value(v: Any) -> float | None:
        return None if v is None or v != v else round(float(v), 3)

    def q(name: str, key: str) -> float | None:
        return q_value((summary.get(name) or {}).get(key))

    return {
        "completed": summary.get("completed"), "failed": summary.get("failed"),
        "duration_s": round(summary.get("duration_s") or 0.0, 4),
        "request_throughput": round(summary.get("request_throughput") or 0.0, 4),
        "output_token_throughput": round(summary.get("output_token_throughput") or 0.0, 2),
        "total_token_throughput": round(summary.get("total_token_throughput") or 0.0, 2),
        "total_input_tokens": summary.get("total_input_tokens"),
        "total_output_tokens": summary.get("total_output_tokens"),
        "output_chars_per_token": q_value(summary.get("output_chars_per_token")),
        "ttft_p50_ms": q("ttft_ms", "median"), "ttft_p99_ms": q("ttft_ms", "p99"),
        "tpot_p50_ms": q("tpot_ms", "median"), "tpot_p99_ms": q("tpot_ms", "p99"),
        "itl_p50_ms": q("itl_ms", "median"), "itl_p99_ms": q("itl_ms", "p99"),
        "e2e_p50_ms": q("e2e_ms", "median"), "send_lag_p99_ms": q("send_lag_ms", "p99"),
        "errors": summary.get("errors") or {},
    }


def result_line(way: str, concurrency: int, summary: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One measurement, flat, from a loadtest-style summary (loadtest.metrics.summarize)."""
    return {"bench": "http_overhead", "way": way, "concurrency": concurrency, **summary_fields(summary),
            "time": servers.now_utc(), **extra}


# ------------------------------------------------------------------------- table / goal check
def _by_key(recs: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for r in recs:
        if r.get("bench", "http_overhead") == "http_overhead" and "way" in r:
            out[(r["way"], int(r["concurrency"]))] = r  # a later line of the same cell wins
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def goal_check(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: gateway vs in-process and vs vllm serve against the issue's goals."""
    cells = _by_key(recs)
    out = []
    for c in sorted({c for (_, c) in cells}):
        gw, ip, vl = cells.get(("gateway", c)), cells.get(("inproc", c)), cells.get(("vllm", c))
        if gw is None:
            continue
        row: dict[str, Any] = {"concurrency": c}
        checks: list[bool] = []
        if ip is not None:
            row["req_vs_inproc"] = ratio(gw["request_throughput"], ip["request_throughput"])
            row["tok_vs_inproc"] = ratio(gw["output_token_throughput"], ip["output_token_throughput"])
            checks.append(min(row["req_vs_inproc"] or 0, row["tok_vs_inproc"] or 0) >= GOAL_VS_INPROC)
        if vl is not None:
            row["req_vs_vllm"] = ratio(gw["request_throughput"], vl["request_throughput"])
            row["tok_vs_vllm"] = ratio(gw["output_token_throughput"], vl["output_token_throughput"])
            checks.append(min(row["req_vs_vllm"] or 0, row["tok_vs_vllm"] or 0) >= GOAL_VS_VLLM)
            if gw.get("ttft_p50_ms") is not None and vl.get("ttft_p50_ms") is not None:
                row["ttft_p50_delta_ms"] = gw["ttft_p50_ms"] - vl["ttft_p50_ms"]
                checks.append(row["ttft_p50_delta_ms"] <= GOAL_TTFT_P50_MS)
        failed = sum(int(r.get("failed") or 0) for (_, rc), r in cells.items() if rc == c)
        row["failed"] = failed
        row["meets_goals"] = bool(checks) and all(checks) and failed == 0
        row["complete"] = ip is not None and vl is not None
        out.append(row)
    return out


def table(recs: list[dict[str, Any]]) -> str:
    cells = _by_key(recs)
    conc = sorted({c for (_, c) in cells})
    f = servers.fmt_num
    lines = ["| concurrency | way | req/s | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
             "out tok/s vs in-process | vs vllm serve | failed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in conc:
        ip, vl = cells.get(("inproc", c)), cells.get(("vllm", c))
        for way in sorted({w for (w, rc) in cells if rc == c}, key=way_order):
            r = cells[(way, c)]
            tok = r["output_token_throughput"]
            vs_ip = ratio(tok, ip["output_token_throughput"]) if ip and way != "inproc" else None
            vs_vl = ratio(tok, vl["output_token_throughput"]) if vl and way != "vllm" else None
            lines.append(
                f"| {c} | {way_label(way)} | {f(r['request_throughput'])} | {f(tok)} | "
                f"{f(r.get('ttft_p50_ms'))} / {f(r.get('ttft_p99_ms'))} | "
                f"{f(r.get('tpot_p50_ms'))} / {f(r.get('tpot_p99_ms'))} | "
                f"{'-' if vs_ip is None else f'{vs_ip:.3f}x'} | {'-' if vs_vl is None else f'{vs_vl:.3f}x'} | "
                f"{r.get('failed', 0)} |")
    checks = goal_check(recs)
    if checks:
        lines.append("")
        lines.append(f"Goals (gateway >= {GOAL_VS_INPROC:.2f}x in-process and >= {GOAL_VS_VLLM:.2f}x "
                     f"vllm serve on req/s and out tok/s, p50 TTFT <= vllm serve + {GOAL_TTFT_P50_MS:g} ms):")
        for row in checks:
            parts = []
            for key, label in (("req_vs_inproc", "req/s vs in-process"), ("tok_vs_inproc", "tok/s vs in-process"),
                               ("req_vs_vllm", "req/s vs vllm"), ("tok_vs_vllm", "tok/s vs vllm")):
                if row.get(key) is not None:
                    parts.append(f"{label} {row[key]:.3f}x")
            if row.get("ttft_p50_delta_ms") is not None:
                parts.append(f"p50 TTFT {row['ttft_p50_delta_ms']:+.1f} ms vs vllm")
            verdict = "meets" if row["meets_goals"] else "misses"
            if not row["complete"]:
                verdict += " (incomplete: a way is missing)"
            lines.append(f"- concurrency {row['concurrency']}: {verdict}; " + ", ".join(parts)
                         + f"; failed {row['failed']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- servers and cells
def inproc_child_cmd(a: argparse.Namespace, profile: Path, workdir: Path, t_end: float, meta: dict[str, Any],
                     min_left_s: float, concurrency: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The in-process way's child (`python -m benchmarks.lib.inproc`) and its environment, to be
    started with cwd=ROOT. With `concurrency` it runs those cells and exits (http_overhead.py);
    without, it reads one cell per line from stdin (http_interleaved.py)."""
    env = servers.clean_env({"VLLM_RPC_BASE_PATH": str(servers.rpc_dir(workdir, "inproc-run")),
                             "TMPDIR": str(workdir / "inproc-tmp")})
    for key in ("VLLM_RPC_BASE_PATH", "TMPDIR"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    env.setdefault("VLLM_CACHE_ROOT", str(workdir / "vllm-cache"))
    cells = ["--concurrency", concurrency] if concurrency else ["--cells-stdin"]
    cmd = [sys.executable, "-m", "benchmarks.lib.inproc", *cells, "--profile", str(profile), "--out", str(a.out),
           "--input-tokens", str(a.input_tokens), "--output-tokens", str(a.output_tokens),
           "--vocab-size", str(a.vocab_size), "--seed", str(a.seed),
           "--deadline-at", str(time.time() + (t_end - time.monotonic())), "--min-left-s", str(min_left_s),
           "--meta", json.dumps(meta), "--cell-output-tokens", str(a.cell_output_tokens)] + (
               ["--requests", str(a.requests)] if a.requests else [])
    return cmd, env


def launch_http_server(way: str, settings, profile: Path, workdir: Path,  # noqa: ANN001
                       name: str | None = None) -> servers.Server:
    """The gateway or `vllm serve` (`way`) on the profile, started, not waited for; `name` (default
    the way) names its log, IPC and temp folders under `workdir`."""
    from server.engine import engine_args_kwargs

    name = name or way
    port = servers.free_port()
    dirs = {"VLLM_RPC_BASE_PATH": servers.rpc_dir(workdir, f"{name}-run"), "TMPDIR": workdir / f"{name}-tmp"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    env = servers.clean_env({**settings.engine.env, **{k: str(v) for k, v in dirs.items()}})
    env.setdefault("VLLM_CACHE_ROOT", str(workdir / "vllm-cache"))
    if way == "gateway":
        cmd = [sys.executable, "-m", "server", "serve", "--config", str(profile), "--port", str(port)]
    else:
        cmd = vllm_serve_cmd(engine_args_kwargs(settings), port, api_server_count(way) or 1)
    print(f"[{name}] starting: {' '.join(cmd)}", flush=True)
    return servers.start_server(name, cmd, workdir / f"{name}.log", port, env)


def start_http_server(way: str, settings, profile: Path, workdir: Path, t_end: float):  # noqa: ANN001, ANN201
    """The gateway or `vllm serve` on the profile, ready; returns (server, seconds to ready)."""
    server = launch_http_server(way, settings, profile, workdir)
    try:
        start_s = server.wait_ready("/ready" if way == "gateway" else "/health", max(1.0, t_end - time.monotonic()))
    except BaseException:
        server.stop(grace_s=30)
        raise
    print(f"[{way}] ready in {start_s:.1f}s", flush=True)
    return server, start_s


def http_cell(way: str, server, c: int, a: argparse.Namespace, model: str, workdir: Path, t_end: float,  # noqa: ANN001
              meta: dict[str, Any], *, rep: int = 0, workers: int | None = None) -> dict[str, Any] | None:
    """One loadtest run against `server`; its result line (appended to --out), None if it failed."""
    workers = a.loadtest_workers if workers is None else workers
    n = requests_for(c, a.requests, a.cell_output_tokens, a.output_tokens)
    raw = workdir / f"{way}-c{c}-r{rep}-w{workers}.json"
    cmd_lt = loadtest_cmd(server.base_url, model, c, n, c, a.input_tokens, a.output_tokens, a.vocab_size,
                          seed_for(a.seed + 100 * rep, c), raw, workers=workers,
                          text_tokenizer=getattr(a, "text_tokenizer", None))
    meter = engine_side.CellMeter(server.proc.pid, lambda: engine_side.scrape(server.base_url))
    if not servers.run_logged(cmd_lt, workdir / f"{way}-loadtest.log", " ".join(cmd_lt), t_end, f"{way}] [c={c}"):
        return None
    side = meter.stop()
    summary = json.loads(raw.read_text())["runs"][0]["summary"]
    shown = [x if not x.startswith("http://") else "$BASE_URL" for x in cmd_lt]
    shown[shown.index("--out") + 1] = "$RAW.json"
    if "--tokenizer" in shown:
        shown[shown.index("--tokenizer") + 1] = "$MODEL_DIR"
    shown[0] = "python"
    rec = result_line(way, c, summary, requests=n, warmup=c, repeat=rep,
                      loadtest_workers=client_workers(c, workers), loadtest_cmd=" ".join(shown), raw=raw.name,
                      **side, **meta)
    servers.append_jsonl(a.out, rec)
    print(f"[{way}] c={c}: {rec['request_throughput']:.2f} req/s, {rec['output_token_throughput']:.1f} "
          f"out tok/s, TTFT p50 {rec['ttft_p50_ms']} ms, TPOT p50 {rec['tpot_p50_ms']} ms, "
          f"failed {rec['failed']}; {engine_side.brief(rec)}", flush=True)
    return rec
