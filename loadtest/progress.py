"""Live progress bar (tqdm) with running throughput and error count."""

from __future__ import annotations

import sys
import time
from typing import Any

from loadtest.records import RequestRecord


class ProgressBar:
    """An Observer for run_load; writes to stderr so stdout stays clean for the summary."""

    def __init__(self, total: int | None, label: str, enabled: bool = True) -> None:
        from tqdm import tqdm

        self._bar: Any = tqdm(total=total, desc=label, unit="req", file=sys.stderr,
                              disable=not enabled, dynamic_ncols=True)
        self._start = time.perf_counter()
        self._tokens = 0
        self._errors = 0

    def finished(self, record: RequestRecord) -> None:
        if record.ok:
            self._tokens += record.output_tokens
        else:
            self._errors += 1
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix(tok_s=f"{self._tokens / elapsed:.1f}", errors=self._errors, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
