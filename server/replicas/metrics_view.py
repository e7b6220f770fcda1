"""One `/metrics` for the front door of `serve --replicas N`: every replica's exposition, each
sample labelled `replica="<i>"`, merged family by family, plus `gateway_replica_up`.

Without it, nginx would answer `/metrics` from whichever replica least_conn picked, and a scrape of
the front door would jump between replicas. Prometheus can still scrape each replica's own port
(deploy/prometheus/prometheus.yml); scrape one or the other, not both, or every count doubles.

The merge works on the text format as the gateways write it (prometheus_client's): a family is
its `# HELP` and `# TYPE` lines and the samples after them, and a sample gets the label inserted
as its first. The families keep the first replica's order; a family that only some replicas have
(a histogram with no observation yet, say) is kept with the samples there are. The view's own
gauge is written here rather than in `server.metrics`: it belongs to the supervisor's process,
which has no registry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

logger = logging.getLogger("llm_gateway.replicas")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE_TIMEOUT_S = 4.0  # under the shipped scrape_timeout (4 s) with the merge's own time on top
UP = "gateway_replica_up"


def label_sample(line: str, replica: str) -> str:
    """`name{a="b"} 1` -> `name{replica="0",a="b"} 1`; `name 1` -> `name{replica="0"} 1`."""
    label = f'replica="{replica}"'
    name_end = len(line)
    for i, ch in enumerate(line):
        if ch in "{ ":
            name_end = i
            break
    if line[name_end:name_end + 1] == "{":
        rest = line[name_end + 1:]
        return f"{line[:name_end]}{{{label}{',' if not rest.startswith('}') else ''}{rest}"
    return f"{line[:name_end]}{{{label}}}{line[name_end:]}"


def merge(expositions: Sequence[tuple[str, str | None]]) -> str:
    """[(replica, its /metrics text or None when it did not answer)] -> one exposition."""
    headers: dict[str, list[str]] = {}  # family -> its HELP and TYPE lines (the first seen)
    samples: dict[str, list[str]] = {}  # family -> every replica's samples, in first-seen order
    for replica, text in expositions:
        if text is None:
            continue
        family = ""
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    samples.setdefault(family, [])
                    seen = headers.setdefault(family, [])
                    if not any(h.split(" ", 2)[1] == parts[1] for h in seen):
                        seen.append(line)
                continue
            samples.setdefault(family, []).append(label_sample(line, replica))
    out: list[str] = []
    for family, lines in samples.items():
        out.extend(headers.get(family, []))
        out.extend(lines)
    out.append(f"# HELP {UP} Whether the front door's last scrape of this replica answered (1) or not (0).")
    out.append(f"# TYPE {UP} gauge")
    out.extend(f'{UP}{{replica="{replica}"}} {0 if text is None else 1}' for replica, text in expositions)
    return "\n".join(out) + "\n"


class MetricsView:
    """A loopback HTTP server in the supervisor: GET /metrics scrapes every replica at once and
    answers the merge. nginx's `/metrics` location proxies here (front.metrics_from_view)."""

    def __init__(self, replica_urls: Sequence[str]) -> None:
        self.replica_urls = list(replica_urls)
        self.client = httpx.Client(timeout=SCRAPE_TIMEOUT_S)
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.replica_urls)), thread_name_prefix="metrics")
        view = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404)
                    return
                body = view.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
                pass  # nginx logs the scrapes

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="metrics-view", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def _scrape(self, url: str) -> str | None:
        try:
            r = self.client.get(url + "/metrics")
            return r.text if r.status_code == 200 else None
        except httpx.HTTPError:
            return None  # a replica starting again, or killed: `gateway_replica_up` says 0

    def render(self) -> str:
        texts = list(self.pool.map(self._scrape, self.replica_urls))
        return merge([(str(i), text) for i, text in enumerate(texts)])

    def start(self) -> MetricsView:
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.thread.is_alive():  # shutdown() waits for serve_forever, which may never have run
            self.server.shutdown()
        self.server.server_close()
        self.pool.shutdown(wait=False)
        self.client.close()
