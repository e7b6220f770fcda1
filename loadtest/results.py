"""Result files: JSON (config, per-run summary and per-request records) and a per-request CSV."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loadtest.metrics import summarize
from loadtest.records import RequestRecord
from loadtest.runner import RunResult

FORMAT = 1
CSV_FIELDS = ("run", "load", "index", "ok", "status", "scheduled_s", "sent_s", "send_lag_s", "ttft_s",
              "tpot_s", "latency_s", "prompt_tokens", "completion_tokens", "chunks",
              "output_chars", "input_tokens_requested", "max_tokens", "itl_s", "error")


def _finite(value: Any) -> Any:
    # JSON has no NaN/inf: write null so other tools can read the file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def build_document(config: dict[str, Any], runs: list[RunResult], slos_ms: dict[str, float]) -> dict[str, Any]:
    return _finite({
        "tool": "loadtest",
        "format": FORMAT,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": config,
        "runs": [{
            "label": run.load.label,
            "load": asdict(run.load),
            "workers": run.workers,
            "summary": summarize(run.records, run.duration_s, slos_ms),
            "requests": [r.to_dict() for r in run.records],
        } for run in runs],
    })


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


def write_csv(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for n, run in enumerate(document["runs"]):
            for req in run["requests"]:
                row = {**req, "run": n, "load": run["label"],
                       "itl_s": " ".join(f"{g:.6f}" for g in req["itl_s"])}
                writer.writerow(row)


def read_document(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    if doc.get("tool") != "loadtest" or "runs" not in doc:
        raise ValueError(f"{path}: not a loadtest result file")
    return doc


def records_of(run: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r) for r in run["requests"]]
