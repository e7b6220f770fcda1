"""Load for the tests that change a serving gateway under traffic (reloads, replicas killed or
reloaded): clients sending short completions until stopped, every answer checked."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import httpx

LOAD_CLIENTS = 8


@dataclass
class LoadResult:
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    models: set[str] = field(default_factory=set)


class Load:
    """`clients` clients (half of them streaming) sending short completions until stopped; every
    answer checked."""

    def __init__(self, base_url: str, clients: int = LOAD_CLIENTS, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url
        self.headers = headers or {}
        self.stop = threading.Event()
        self.result = LoadResult()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    @property
    def ended(self) -> int:
        """Requests answered so far, good or not."""
        with self.lock:
            return self.result.ok + len(self.result.failures)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)

    def _record(self, ok: bool, detail: str = "", model: str = "") -> None:
        with self.lock:
            if ok:
                self.result.ok += 1
                self.result.models.add(model)
            else:
                self.result.failures.append(detail)

    def _run(self, i: int) -> None:
        stream = i % 2 == 0
        body = {"prompt": f"Client {i} says", "max_tokens": 8, "temperature": 0, "stream": stream}
        with httpx.Client(base_url=self.base_url, timeout=300, headers=self.headers) as client:
            while not self.stop.is_set():
                try:
                    if stream:
                        with client.stream("POST", "/v1/completions", json=body) as r:
                            if r.status_code != 200:
                                r.read()
                                self._record(False, f"{r.status_code} {r.text[:200]}")
                                continue
                            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                        chunks = [json.loads(e) for e in events[:-1]]
                        complete = (events[-1] == "[DONE]" and all("error" not in c for c in chunks)
                                    and chunks[-1]["choices"][0]["finish_reason"] is not None)
                        self._record(complete, f"incomplete stream: {events[-3:]}", chunks[-1].get("model", ""))
                    else:
                        r = client.post("/v1/completions", json=body)
                        good = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None
                        self._record(good, f"{r.status_code} {r.text[:200]}", r.json().get("model", "") if good else "")
                except Exception as exc:  # a dropped connection is a failure too
                    self._record(False, repr(exc))
