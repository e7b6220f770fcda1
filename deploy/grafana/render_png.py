"""Render the Grafana dashboard's panels from a real Prometheus into one PNG, with matplotlib.

No Grafana server can be installed on the build machines (no Debian, PyPI or npm package runs
one), so docs/dashboard.png is made by this script: every panel's PromQL queries go to
Prometheus's /api/v1/query_range exactly as written in the dashboard JSON (the template
variables $instance, $model and $tenant set to "All", $__rate_interval to --rate-interval), and the
results are drawn as Grafana would draw a time series. The annotation queries are drawn as
vertical lines on every panel.

    python deploy/grafana/render_png.py --prometheus http://127.0.0.1:9090 \
        --minutes 10 --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "llm-gateway.json"


def substitute(expr: str, rate_interval: str, variables: dict[str, str] | None = None) -> str:
    """The dashboard's template variables replaced as Grafana does with 'All' selected."""
    values = {"$__rate_interval": rate_interval, "$__interval": rate_interval, "$__range": rate_interval,
              "$instance": ".*", "$model": ".*", "$tenant": ".*", **(variables or {})}
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    return expr


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=120) as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt:
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__")
    out = fmt
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def render(prometheus: str, out: Path, start: float, end: float, step: float, rate_interval: str,
           dashboard: Path = DASHBOARD) -> dict[str, int]:
    """Draw every panel; return the number of series drawn per panel title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.dates import DateFormatter
    from datetime import datetime, timezone

    dash = json.loads(dashboard.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    marks: list[tuple[float, str]] = []
    for ann in dash.get("annotations", {}).get("list", []):
        if "expr" not in ann:
            continue
        for series in query_range(prometheus, substitute(ann["expr"], rate_interval), start, end, step):
            last = None
            for ts, _ in series["values"]:
                # one mark per event: the first step of each run of consecutive matching steps
                if last is None or float(ts) - last > step * 1.5:
                    marks.append((float(ts), ann.get("iconColor", "orange")))
                last = float(ts)

    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 6.4, rows * 3.2), squeeze=False)
    fig.suptitle(f"{dash['title']} (rendered from Prometheus by deploy/grafana/render_png.py)", fontsize=14)
    drawn: dict[str, int] = {}
    to_dt = lambda ts: datetime.fromtimestamp(ts, tz=timezone.utc)  # noqa: E731
    for ax, panel in zip(axes.flat, panels):
        ax.set_title(panel["title"], fontsize=10)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        count = 0
        if panel["type"] == "table":
            lines = []
            for target in panel["targets"]:
                for series in query_range(prometheus, substitute(target["expr"], rate_interval), end, end, step):
                    labels = {k: v for k, v in series["metric"].items() if k not in ("__name__", "job", "service")}
                    lines.append("\n".join(f"{k}: {v}" for k, v in sorted(labels.items())))
                    count += 1
            ax.axis("off")
            ax.text(0, 1, "\n\n".join(lines) or "no data", va="top", family="monospace", fontsize=7,
                    transform=ax.transAxes)
            drawn[panel["title"]] = count
            continue
        for target in panel["targets"]:
            for series in query_range(prometheus, substitute(target["expr"], rate_interval), start, end, step):
                points = [(to_dt(float(t)), float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
                if not points:
                    continue
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]), linewidth=1.2)
                count += 1
        for ts, color in marks:
            ax.axvline(to_dt(ts), color=color, alpha=0.4, linewidth=1, linestyle="--")
        ax.set_ylabel({"s": "seconds", "percentunit": "ratio", "reqps": "req/s"}.get(unit, ""), fontsize=8)
        ax.xaxis.set_major_formatter(DateFormatter("%H:%M:%S"))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if count:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        drawn[panel["title"]] = count
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=15.0, help="time range ending now")
    parser.add_argument("--step", type=float, default=2.0, help="query step in seconds")
    parser.add_argument("--rate-interval", default="30s", help="value for $__rate_interval")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args()
    end = time.time()
    drawn = render(args.prometheus, args.out, end - args.minutes * 60, end, args.step, args.rate_interval,
                   args.dashboard)
    for title, n in drawn.items():
        print(f"{n:3d} series  {title}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
