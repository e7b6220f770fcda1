"""What reload_under_load.py reports: per reload, the requests that overlapped it (failed, longest
TTFT and E2E) against the baseline before the first reload, and the table of its result lines
(reload, correctness check, whole run). The lines keep `"bench": "gpu_reload"`, the name the
results files were written under."""

from __future__ import annotations

from typing import Any

from benchmarks.lib import servers


def pct_ms(values: list[float], q: float) -> float | None:
    """The q-th percentile of `values` (seconds) in ms; None for no values."""
    from loadtest.metrics import percentile

    return None if not values else round(percentile(values, q) * 1000.0, 1)


def max_ms(values: list[float]) -> float | None:
    """The largest of `values` (seconds) in ms; None for no values."""
    return None if not values else round(max(values) * 1000.0, 1)


def error_counts(reqs: list[dict[str, Any]]) -> dict[str, int]:
    """How many of the failed requests failed each way (the error, or the HTTP status)."""
    errors: dict[str, int] = {}
    for r in reqs:
        if not r["ok"]:
            key = (r.get("error") or f"HTTP {r.get('status')}")[:120]
            errors[key] = errors.get(key, 0) + 1
    return errors


def window_stats(reqs: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Requests that overlap [t0, t1] (in flight at some point of it, or sent during it).

    Each request is a dict with sent_s, latency_s, ttft_s (seconds, same clock as t0/t1), ok, error.
    """
    hit = [r for r in reqs if r["sent_s"] <= t1 and r["sent_s"] + (r.get("latency_s") or 0.0) >= t0]
    ok = [r for r in hit if r["ok"]]
    errors = error_counts(hit)
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    e2e = [r["latency_s"] for r in hit if r.get("latency_s") is not None]
    return {
        "requests": len(hit), "sent_during": sum(1 for r in hit if r["sent_s"] >= t0),
        "failed": len(hit) - len(ok), "errors": errors,
        "max_ttft_ms": max_ms(ttft), "p50_ttft_ms": pct_ms(ttft, 50), "max_e2e_ms": max_ms(e2e),
    }


def baseline_stats(reqs: list[dict[str, Any]], before: float) -> dict[str, Any]:
    done = [r for r in reqs if r["sent_s"] + (r.get("latency_s") or 0.0) < before]
    ok = [r for r in done if r["ok"]]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    e2e = [r["latency_s"] for r in ok if r.get("latency_s") is not None]
    return {"requests": len(done), "failed": len(done) - len(ok), "p50_ttft_ms": pct_ms(ttft, 50),
            "p99_ttft_ms": pct_ms(ttft, 99), "max_ttft_ms": max_ms(ttft), "p50_e2e_ms": pct_ms(e2e, 50),
            "max_e2e_ms": max_ms(e2e)}


def table(recs: list[dict[str, Any]]) -> str:
    f = servers.fmt_num
    lines = ["| strategy | outcome | reload (server) s | generation paused s | reload (client) s | requests in window | "
             "failed | queued / aborted / kept | max queue wait s | max TTFT ms | max E2E ms | baseline p50 / max TTFT ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in recs:
        if r.get("bench") != "gpu_reload" or r.get("kind") != "reload":
            continue
        srv, win, base = r.get("server") or {}, r.get("window") or {}, r.get("baseline") or {}
        lines.append(
            f"| {r['strategy']} | {srv.get('outcome', r.get('http_status'))} | {f(srv.get('duration_s'))} | "
            f"{f(srv.get('pause_s'))} | {f(r.get('client_duration_s'))} | {win.get('requests', '-')} | "
            f"{win.get('failed', '-')} | {srv.get('queued', '-')} / {srv.get('aborted', '-')} / {srv.get('kept', '-')} | "
            f"{f(srv.get('max_queue_wait_s'))} | "
            f"{f(win.get('max_ttft_ms'))} | {f(win.get('max_e2e_ms'))} | "
            f"{f(base.get('p50_ttft_ms'))} / {f(base.get('max_ttft_ms'))} |")
    for r in recs:
        if r.get("bench") == "gpu_reload" and r.get("kind") == "correctness":
            lines.append("")
            lines.append(f"Greedy answers ({r['check']}): {'equal' if r['equal'] else 'DIFFERENT'} "
                         f"({r['detail']}).")
    for r in recs:
        if r.get("bench") == "gpu_reload" and r.get("kind") == "run":
            lines.append("")
            lines.append(f"Whole run ({r.get('label', '')}): {r['requests']} requests, {r['failed']} failed"
                         f" ({r.get('errors') or 'no errors'}), longest TTFT {f(r.get('max_ttft_ms'))} ms, "
                         f"longest E2E {f(r.get('max_e2e_ms'))} ms, gateway start {f(r.get('gateway_start_s'))} s.")
    return "\n".join(lines)
