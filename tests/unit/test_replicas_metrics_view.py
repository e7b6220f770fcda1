"""The front door's /metrics for `serve --replicas N` (server/replicas/metrics_view.py): real
prometheus_client expositions merged, read back by prometheus_client's parser and by promtool;
the view served over HTTP from live (loopback) replicas, one of them down."""

from __future__ import annotations

import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.replicas import front
from server.replicas.metrics_view import MetricsView, label_sample, merge


def exposition(n: int, *, with_histogram: bool = True) -> str:
    registry = CollectorRegistry()
    Counter("gateway_requests", "Requests.", ["route", "status"], registry=registry).labels("/v1/x", "200").inc(n)
    if with_histogram:
        Histogram("gateway_ttft_seconds", "TTFT.", registry=registry).observe(0.1 * n)
    Gauge("vllm:num_requests_running", "Running.", ["engine"], registry=registry).labels("0").set(n)
    Gauge("gateway_plain", "No labels.", registry=registry).set(3)
    return generate_latest(registry).decode()


def test_a_label_goes_first_in_every_sample_shape() -> None:
    assert label_sample('a_total{x="1"} 2.0', "0") == 'a_total{replica="0",x="1"} 2.0'
    assert label_sample("a 2.0", "1") == 'a{replica="1"} 2.0'
    assert label_sample("a{} 2.0", "1") == 'a{replica="1"} 2.0'
    assert label_sample('vllm:x{le="+Inf"} 1 1700000000', "2") == 'vllm:x{replica="2",le="+Inf"} 1 1700000000'


def test_merged_families_keep_every_sample_once_labelled() -> None:
    # replica 1 has not observed the histogram yet (its family is missing), replica 2 is down
    merged = merge([("0", exposition(1)), ("1", exposition(2, with_histogram=False)), ("2", None)])
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    requests = {s.labels["replica"]: s.value for s in families["gateway_requests"].samples if s.name.endswith("_total")}
    assert requests == {"0": 1.0, "1": 2.0}
    assert {s.labels["replica"] for s in families["gateway_ttft_seconds"].samples} == {"0"}
    assert {s.labels["replica"]: s.value for s in families["vllm:num_requests_running"].samples} == {"0": 1, "1": 2}
    assert {s.labels["replica"]: s.value for s in families["gateway_replica_up"].samples} == {"0": 1, "1": 1, "2": 0}
    # one HELP and one TYPE per family, however many replicas
    assert merged.count("# TYPE gateway_requests_total counter") == 1
    assert merged.count("# HELP gateway_plain ") == 1


def test_promtool_reads_the_merge() -> None:
    assert shutil.which("promtool"), "promtool is missing: .ci/run installs the Debian package `prometheus`"
    merged = merge([("0", exposition(1)), ("1", exposition(2))])
    ours = "\n".join(line for line in merged.splitlines() if "vllm:" not in line) + "\n"  # vLLM's names lint
    r = subprocess.run(["promtool", "check", "metrics"], input=ours,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


class _Replica(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def test_the_view_scrapes_live_replicas_and_marks_a_dead_one() -> None:
    handler = type("R0", (_Replica,), {"body": exposition(5).encode()})
    replica = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    dead = ThreadingHTTPServer(("127.0.0.1", 0), _Replica)
    dead_url = f"http://127.0.0.1:{dead.server_address[1]}"
    dead.server_close()  # nothing listens there now
    view = MetricsView([f"http://127.0.0.1:{replica.server_address[1]}", dead_url]).start()
    try:
        r = httpx.get(f"http://127.0.0.1:{view.port}/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert 'gateway_requests_total{replica="0",route="/v1/x",status="200"} 5.0' in r.text
        assert 'gateway_replica_up{replica="1"} 0' in r.text
        assert httpx.get(f"http://127.0.0.1:{view.port}/other", timeout=10).status_code == 404
    finally:
        view.stop()
        replica.shutdown()
        replica.server_close()


def test_a_view_that_never_started_stops() -> None:
    MetricsView(["http://127.0.0.1:9"]).stop()  # the supervisor's early exits call stop() too


def test_the_front_sends_metrics_to_the_view_and_keeps_the_allow_list(tmp_path) -> None:  # type: ignore[no-untyped-def]
    front.write_front(tmp_path, upstreams=[9001, 9002], listen="127.0.0.1:9000", ready_dir=tmp_path, metrics_port=9100)
    snippet = (tmp_path / "llm-gateway-proxy.conf").read_text()
    location = snippet[snippet.index("location = /metrics {"):]
    location = location[:location.index("}")]
    assert "proxy_pass http://127.0.0.1:9100;" in location and "deny all;" in location
    assert "allow 127.0.0.1;" in location and "llm_gateway" not in location

