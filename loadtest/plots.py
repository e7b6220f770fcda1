"""PNG plots of a result document (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency"))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _load_axis(doc: dict[str, Any]) -> tuple[list[float], str]:
    loads = [run["load"] for run in doc["runs"]]
    kind = loads[0]["kind"]
    xs = [float(ld["value"]) for ld in loads]
    # An all-at-once run (rate inf) goes one step right of the largest finite rate.
    finite = [x for x in xs if math.isfinite(x)]
    top = max(finite, default=1.0) * 1.25
    xs = [x if math.isfinite(x) else top for x in xs]
    return xs, ("concurrency" if kind == "concurrency" else "request rate (req/s)")


def _sweep_plots(plt: Any, doc: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    xs, xlabel = _load_axis(doc)
    summaries = [run["summary"] for run in doc["runs"]]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (key, name) in zip(axes.flat, METRICS):
        for pct in ("median", "p90", "p99"):
            ax.plot(xs, [s[key][pct] if s[key][pct] is not None else math.nan for s in summaries],
                    marker="o", label=pct)
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("latency percentiles vs load")
    fig.tight_layout()
    lat = out_dir / f"{stem}_latency_vs_load.png"
    fig.savefig(lat, dpi=100)
    plt.close(fig)

    fig, ax1 = plt.subplots(figsize=(8, 5))
    ax1.plot(xs, [s["output_token_throughput"] for s in summaries], marker="o", color="tab:blue",
             label="output tok/s")
    ax1.plot(xs, [s["peak_output_token_throughput"] for s in summaries], marker=".", linestyle="--",
             color="tab:cyan", label="peak output tok/s")
    ax1.set_xlabel(xlabel)
    ax1.set_ylabel("tokens/s")
    ax2 = ax1.twinx()
    ax2.plot(xs, [s["request_throughput"] for s in summaries], marker="s", color="tab:red", label="req/s")
    if all("goodput" in s for s in summaries):
        ax2.plot(xs, [s["goodput"] for s in summaries], marker="^", color="tab:green", label="goodput req/s")
    ax2.set_ylabel("requests/s")
    handles = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax1.legend(handles, [str(h.get_label()) for h in handles], loc="upper left")
    ax1.grid(alpha=0.3)
    ax1.set_title("throughput vs load")
    fig.tight_layout()
    thr = out_dir / f"{stem}_throughput_vs_load.png"
    fig.savefig(thr, dpi=100)
    plt.close(fig)
    return [lat, thr]


def _histogram(plt: Any, doc: dict[str, Any], out: Path, title: str, values_of: Any) -> Path:
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in doc["runs"]:
        values = [v * 1000.0 for v in values_of(run["requests"])]
        if values:
            ax.hist(values, bins=40, alpha=0.5, label=run["label"])
    ax.set_xlabel("ms")
    ax.set_ylabel("count")
    ax.set_title(title)
    if len(doc["runs"]) > 1:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_plots(doc: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = _sweep_plots(plt, doc, out_dir, stem) if len(doc["runs"]) > 1 else []
    paths.append(_histogram(plt, doc, out_dir / f"{stem}_ttft_hist.png", "TTFT distribution",
                            lambda reqs: [r["ttft_s"] for r in reqs if r["ok"] and r["ttft_s"] is not None]))
    paths.append(_histogram(plt, doc, out_dir / f"{stem}_itl_hist.png", "inter-token latency distribution",
                            lambda reqs: [g for r in reqs if r["ok"] for g in r["itl_s"]]))
    return paths
