"""Observability against live processes: the real gateway, a real Prometheus, promtool.

One module-scoped Prometheus (Debian package `prometheus`) scrapes the session's shared gateway
every second with the shipped `deploy/prometheus/prometheus.yml` (targets and intervals
rewritten) and the shipped `alerts.yml`. A short load of plain, streamed, invalid and abandoned
requests then has to make every dashboard and alert expression return data.

Counter tests take deltas on the shared gateway: other tests in the session run sequentially,
never during one of these tests, so a delta measured inside one test is exact.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, SERVED_NAME, free_port, wait_for

PROM_DIR = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "llm-gateway.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
COMPLETIONS = "/v1/completions"
# Instant queries look back this far: it covers the whole load and >= 2 scrapes of it.
RATE_WINDOW = "2m"
# Short enough for a quick test, long enough for a busy 2-core machine to answer each scrape.
SCRAPE = "2s"

# vLLM's own families the issue asks for (names checked on a live scrape of vLLM 0.32).
VLLM_FAMILIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:num_preemptions", "vllm:request_success",
    "vllm:request_time_per_output_token_seconds",
]
# Expressions that may be NaN after the load: nothing reloads the engine in these tests.
# Reload timings are NaN until a reload of that kind ran (the session's gateway never swaps weights).
# The mean garbage-collection pause (its sum over its _count) is 0/0 while no full collection ran (none
# may in a short CPU test); the share of time paused, on the _sum alone, must still be a number.
MAY_BE_NAN = ("gateway_engine_reload_duration_seconds", "gateway_engine_reload_pause_seconds",
              "gateway_gc_full_collection_seconds_count")
# Families only a gateway with a keys file exports (limiter timings, budgets, the fair queue); the
# session's gateway has none, so expressions on them are checked by tests/e2e/test_tenants.py instead.
NEEDS_TENANT_LIMITS = ("gateway_tenant_limiter_duration_seconds", "gateway_tenant_budget_",
                       "gateway_tenant_queue", "gateway_tenant_share")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def promtool(*args: str, stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: .ci/run installs the Debian package `prometheus`"
    return subprocess.run([exe, *args], input=stdin, capture_output=True, text=True, cwd=cwd, timeout=60)


def scrape(base_url: str) -> str:
    r = httpx.get(base_url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(snapshot: dict, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, lbls), v in snapshot.items() if n == name and want <= set(lbls))


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for ann in dash["annotations"]["list"]:
        if "expr" in ann:
            out.append((f"annotation {ann['name']!r}", ann["expr"]))
    return out


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROM_DIR / "alerts.yml").read_text())["groups"]
    return [rule for g in groups for rule in g["rules"]]


THRESHOLD = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*-?[0-9.]+(e-?[0-9]+)?\s*$")


def without_threshold(expr: str) -> str:
    """`signal > 0.05` -> `signal`.

    Alert (and annotation) expressions only return series while the condition holds, so on a
    healthy server they are rightly empty; what must return data is the signal they compare.
    """
    inner, n = THRESHOLD.subn("", expr.strip())
    return inner if n else expr.strip()


def substitute(expr: str, tenant: str = ".*") -> str:
    for name, val in (("$__rate_interval", RATE_WINDOW), ("$__interval", RATE_WINDOW),
                      ("$instance", ".*"), ("$model", ".*"), ("$tenant", tenant)):
        expr = expr.replace(name, val)
    return expr


def needs_tenant_limits(expr: str) -> bool:
    return any(family in expr for family in NEEDS_TENANT_LIMITS)


# Only the front door of `serve --replicas N` writes these (server/replicas/metrics_view.py; its
# e2e test reads them): a lone gateway has none, and the expressions that use them fall back to
# `up` or are the replicas' own alert.
FRONT_DOOR_ONLY = {"gateway_replica_up"}


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(?:gateway_[a-z0-9_]+|vllm:[a-z0-9_:]+)", expr))


def complete(base_url: str, **body: object) -> httpx.Response:
    payload = {"model": SERVED_NAME, "temperature": 0, **body}
    return httpx.post(base_url + COMPLETIONS, json=payload, timeout=120)


def stream_complete(base_url: str, **body: object) -> list[dict]:
    payload = {"model": SERVED_NAME, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}, **body}
    events = []
    with httpx.stream("POST", base_url + COMPLETIONS, json=payload, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def abandon_stream(base_url: str) -> None:
    """Start a long stream, read its first event, hang up."""
    payload = {"model": SERVED_NAME, "prompt": "Count to one thousand:", "max_tokens": 1000,
               "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", base_url + COMPLETIONS, json=payload) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break


# ---------------------------------------------------------------------------------------------
# a real Prometheus scraping the gateway
# ---------------------------------------------------------------------------------------------


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    load_window: str = RATE_WINDOW
    """A range that covers the whole of `loaded`'s load, however slowly a loaded machine ran it."""
    load_scraped_at: float | None = None
    """When Prometheus had scraped that load: queries about it are evaluated there, so they give
    the same answer however long after it a test runs (`make test-timing` repeats them)."""

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        r = httpx.get(self.url + "/api/v1/query", params=params, timeout=120)
        assert r.headers.get("content-type", "").startswith("application/json"), f"{expr}: {r.status_code} {r.text[:200]}"
        body = r.json()
        assert body.get("status") == "success", f"{expr}: {body}"
        return body["data"]["result"]


@contextlib.contextmanager
def running_prometheus(tmp: Path, targets: list[str]) -> Iterator[Prometheus]:
    """Debian's Prometheus with the shipped config and rules, scraping `targets` every SCRAPE,
    once it has scraped all of them at least once."""
    exe = shutil.which("prometheus")
    assert exe, "prometheus is missing: .ci/run installs the Debian package `prometheus`"
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=SCRAPE, evaluation_interval=SCRAPE)
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "llm-gateway")
    job.update(scrape_interval=SCRAPE, scrape_timeout=SCRAPE)
    job["static_configs"] = [{"targets": targets, "labels": {"service": "llm-gateway"}}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(PROM_DIR / "alerts.yml", tmp / "alerts.yml")
    port = free_port()
    log_path = tmp / "prometheus.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{log_path.read_text()[-4000:]}")
            try:
                # Prometheus answers 503 "Service Unavailable" (plain text) until its TSDB is open.
                if httpx.get(prom.url + "/-/ready", timeout=10).status_code != 200:
                    return False
                live = {s["metric"]["instance"] for s in prom.query('up{job="llm-gateway"} == 1')}
                return live >= set(targets)
            except (httpx.HTTPError, ValueError, AssertionError):
                return False

        assert wait_for(up, timeout=120), f"prometheus never scraped {targets}:\n{log_path.read_text()[-4000:]}"
        yield prom
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def prometheus(gateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:  # type: ignore[no-untyped-def]
    # The load's series must exist before the first scrape, or increase() sees none of their first
    # request (this module alone, e.g. `make test-timing`, starts on a gateway that answered no 400 yet).
    assert complete(gateway.base_url, prompt="x", max_tokens=-1).status_code == 400
    target = urllib.parse.urlsplit(gateway.base_url).netloc
    with running_prometheus(tmp_path_factory.mktemp("prometheus"), [target]) as prom:
        yield prom


@pytest.fixture(scope="module")
def loaded(gateway, prometheus: Prometheus) -> Prometheus:  # type: ignore[no-untyped-def]
    """A short mixed load, after Prometheus's first scrape, then two more scrapes."""
    url = gateway.base_url
    began = time.time()
    for i in range(4):
        assert complete(url, prompt=f"Load request {i}:", max_tokens=6, ignore_eos=True).status_code == 200
    for i in range(3):
        assert stream_complete(url, prompt=f"Streamed request {i}:", max_tokens=6, ignore_eos=True)
    assert complete(url, prompt="stop here.", max_tokens=40, stop=["."]).status_code == 200
    assert complete(url, prompt="x", max_tokens=-1).status_code == 400
    abandon_stream(url)
    # Wait until Prometheus has scraped the gateway's final counts (the first scrape, before the
    # load, was awaited by the `prometheus` fixture): rates over the window then see the load.
    expected = value(samples(scrape(url)), "gateway_requests_total", route=COMPLETIONS)

    def scraped_all() -> bool:
        got = prometheus.query(f'sum(gateway_requests_total{{job="llm-gateway", route="{COMPLETIONS}"}})')
        return bool(got) and float(got[0]["value"][1]) >= expected

    assert wait_for(scraped_all, timeout=60, interval=1.0), "Prometheus never scraped the load"
    prometheus.load_scraped_at = time.time()
    prometheus.load_window = f"{max(120, int(prometheus.load_scraped_at - began) + 60)}s"
    return prometheus


# ---------------------------------------------------------------------------------------------
# static checks of the ops files
# ---------------------------------------------------------------------------------------------


def test_promtool_check_config_and_rules() -> None:
    r = promtool("check", "config", "prometheus.yml", cwd=PROM_DIR)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout + r.stderr
    r = promtool("check", "rules", "alerts.yml", cwd=PROM_DIR)
    assert r.returncode == 0, r.stdout + r.stderr
    rules = alert_rules()
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout
    names = {rule["alert"] for rule in rules}
    assert names == {
        "LLMGatewayDown", "LLMGatewayReplicaDown", "LLMGatewayEngineNotServing", "LLMGatewayHighErrorRatio", "LLMGatewayTTFTHigh",
        "LLMGatewayKVCacheNearlyFull", "LLMGatewaySustainedQueueing", "LLMGatewayReloadFailed",
        "LLMGatewayTenantLimiterDegraded", "LLMGatewayTenantKeysReloadFailed",
        "LLMGatewayEngineQuiet", "LLMGatewayEngineStalled",
    }
    for rule in rules:
        assert rule["annotations"].get("summary") and rule["annotations"].get("description"), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert without_threshold(rule["expr"]) != rule["expr"].strip(), f"{rule['alert']}: no threshold"
    reload_rule = next(r for r in rules if r["alert"] == "LLMGatewayReloadFailed")
    assert "gateway_engine_reloads_total" in reload_rule["expr"]


def test_dashboard_json_and_provisioning_are_valid() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "model", "tenant"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"] and variables[name]["multi"]
    # one row per selected tenant: a row repeated over $tenant, every panel under it filtered by it
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    [tenant_row] = [r for r in rows if r.get("repeat") == "tenant"]
    assert "$tenant" in tenant_row["title"] and tenant_row is rows[-1]
    under = dash["panels"][dash["panels"].index(tenant_row) + 1:]
    assert len(under) >= 3 and all('tenant=~"$tenant"' in t["expr"] for p in under for t in p["targets"])
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in panels}
    for needed in ("Request rate by status", "TTFT (engine)", "TTFT (client side, streamed)",
                   "Gateway overhead on TTFT", "Inter-token latency", "End-to-end latency", "Token throughput",
                   "Running vs waiting requests", "KV cache usage", "Queue time",
                   "Prefill vs decode time (mean per request)", "Finish reasons", "Engine state",
                   "Requests by tenant", "Tokens per minute by tenant", "Engine quiet time and stalls",
                   "Event-loop pauses (full garbage collections)"):
        assert needed in titles
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert "$instance" in target["expr"], f"{panel['title']}: not filtered by $instance"
            if "vllm:" in target["expr"]:
                assert 'model_name=~"$model"' in target["expr"], f"{panel['title']}: not filtered by $model"
        gp = panel["gridPos"]
        assert gp["x"] + gp["w"] <= 24
    # p50/p90/p99 for each latency family
    exprs = " ".join(e for _, e in dashboard_exprs())
    for family in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:e2e_request_latency_seconds", "vllm:request_time_per_output_token_seconds",
                   "gateway_time_to_first_token_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (le) (rate({family}_bucket" in exprs, (family, q)
    annotations = {a["name"] for a in dash["annotations"]["list"]}
    assert {"Engine state changes", "Engine reloads"} <= annotations
    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    prov = yaml.safe_load((PROVISIONING / "dashboards" / "llm-gateway.yml").read_text())
    assert prov["providers"][0]["type"] == "file" and prov["providers"][0]["options"]["path"]


# ---------------------------------------------------------------------------------------------
# the live scrape
# ---------------------------------------------------------------------------------------------


def test_live_scrape_passes_promtool_and_has_vllm_families(gateway) -> None:  # type: ignore[no-untyped-def]
    text = scrape(gateway.base_url)
    # promtool's linter on our families, strictly. vLLM's own names contain ':' (recording-rule
    # style) and one histogram ends in _total, which the linter flags and we cannot rename.
    ours = "\n".join(
        line for line in text.splitlines()
        if line.startswith("gateway_") or re.match(r"# (HELP|TYPE) gateway_", line)
    ) + "\n"
    assert "gateway_requests_total" in ours
    r = promtool("check", "metrics", stdin=ours)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
    # the whole scrape parses and only vLLM's colon names draw lint
    r = promtool("check", "metrics", stdin=text)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert problems and all(line.startswith("vllm:") for line in problems), problems
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in VLLM_FAMILIES:
        assert name in families, f"{name} missing from /metrics"
        labels = {s.labels.get("model_name") for s in families[name].samples}
        assert labels == {SERVED_NAME}, (name, labels)
    # probes and scrapes are not traffic
    snap = samples(scrape(gateway.base_url))
    routes = {dict(lbls).get("route") for (n, lbls) in snap if n == "gateway_requests_total"}
    assert not routes & {"/metrics", "/health", "/ready"}
    info = {dict(lbls)["model"]: dict(lbls) for (n, lbls) in snap if n == "gateway_profile_info"}
    assert info[SERVED_NAME]["vllm_version"] and info[SERVED_NAME]["cuda_graphs"] in {"true", "false"}
    assert value(snap, "gateway_engine_state", state="serving") == 1
    assert sum(v for (n, _), v in snap.items() if n == "gateway_engine_state") == 1


def test_openmetrics_on_request(gateway) -> None:  # type: ignore[no-untyped-def]
    r = httpx.get(gateway.base_url + "/metrics",
                  headers={"Accept": "application/openmetrics-text; version=1.0.0"}, timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n") and r.text.count("# EOF") == 1
    assert "# TYPE gateway_requests counter" in r.text
    assert "# TYPE vllm:generation_tokens counter" in r.text
    # Prometheus asks for OpenMetrics: the samples must keep the ':' of their family's name
    # (prometheus_client's default escaping writes vllm_generation_tokens_total, which would
    # leave every vllm:* panel and alert without data).
    assert re.search(r"^vllm:generation_tokens_total\{", r.text, re.M)
    assert not re.search(r"^vllm_", r.text, re.M)


def test_counters_move_by_exactly_the_requests_and_tokens(gateway) -> None:  # type: ignore[no-untyped-def]
    url = gateway.base_url
    before = samples(scrape(url))
    # Token-id prompts and ignore_eos: the prompt and completion token counts are known upfront.
    plain = [([1000 + i] * (3 + i), 2 + i) for i in range(4)]      # (prompt ids, max_tokens)
    streamed = [([2000 + i] * (5 + i), 4 + i) for i in range(2)]
    for ids, n in plain:
        r = complete(url, prompt=ids, max_tokens=n, ignore_eos=True)
        assert r.status_code == 200
        assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
    for ids, n in streamed:
        events = stream_complete(url, prompt=ids, max_tokens=n, ignore_eos=True)
        assert events[-1]["usage"]["completion_tokens"] == n
    assert complete(url, prompt="x", max_tokens=-1).status_code == 400
    for probe in ("/health", "/ready", "/metrics", "/no-such-route"):
        httpx.get(url + probe, timeout=10)
    n_req = len(plain) + len(streamed)
    prompt_sum = sum(len(ids) for ids, _ in plain + streamed)
    gen_sum = sum(n for _, n in plain + streamed)

    def after_settled() -> dict:
        # vLLM records stats from its output loop, which may run just after the response left.
        snap = samples(scrape(url))
        done = value(snap, "vllm:request_success_total") - value(before, "vllm:request_success_total")
        return snap if done >= n_req else {}

    after = wait_for(after_settled, timeout=10)
    assert after, "vLLM's counters never caught up"

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    route = {"route": COMPLETIONS}
    assert delta("gateway_requests_total", status="200", **route) == n_req
    assert delta("gateway_requests_total", status="400", **route) == 1
    assert delta("gateway_requests_total", route="other") == 1  # the unknown path, not the probes
    assert delta("gateway_requests_total") == n_req + 2
    assert delta("gateway_rejections_total", reason="validation") == 1
    assert delta("gateway_rejections_total") == 1
    assert delta("gateway_prompt_tokens_total", **route) == prompt_sum
    assert delta("gateway_completion_tokens_total", **route) == gen_sum
    assert delta("gateway_request_finish_total", reason="length", **route) == n_req
    assert delta("gateway_request_duration_seconds_count", **route) == n_req + 1
    # TTFT/TPOT as the client sees them exist for streamed requests only
    assert delta("gateway_time_to_first_token_seconds_count", **route) == len(streamed)
    assert delta("gateway_time_per_output_token_seconds_count", **route) == len(streamed)
    assert value(after, "gateway_requests_in_flight", **route) == 0
    # vLLM's own families agree
    assert delta("vllm:prompt_tokens_total") == prompt_sum
    assert delta("vllm:generation_tokens_total") == gen_sum
    assert delta("vllm:request_success_total", finished_reason="length") == n_req
    assert delta("vllm:request_success_total") == n_req
    assert delta("vllm:e2e_request_latency_seconds_count") == n_req
    assert delta("vllm:time_to_first_token_seconds_count") == n_req
    assert delta("vllm:request_prompt_tokens_sum") == prompt_sum
    assert delta("vllm:request_generation_tokens_sum") == gen_sum


def test_abandoned_stream_counts_a_disconnect_and_is_aborted(gateway) -> None:  # type: ignore[no-untyped-def]
    """A client that hangs up mid-stream: one disconnect, and vLLM stops generating for it.

    vLLM 0.32 counts aborts requested by the frontend in no counter (its
    request_success_total{finished_reason="abort"} stays put), so the abort shows as the engine
    going idle long before the 1000 tokens asked for.
    """
    url = gateway.base_url
    before = samples(scrape(url))
    abandon_stream(url)

    def counted() -> dict:
        snap = samples(scrape(url))
        moved = value(snap, "gateway_client_disconnects_total", route=COMPLETIONS) > value(
            before, "gateway_client_disconnects_total", route=COMPLETIONS)
        idle = value(snap, "vllm:num_requests_running") == 0
        return snap if moved and idle else {}

    after = wait_for(counted, timeout=30)
    assert after, "the abandoned stream was not counted as a disconnect, or vLLM still runs it"
    assert value(after, "gateway_client_disconnects_total", route=COMPLETIONS) - value(
        before, "gateway_client_disconnects_total", route=COMPLETIONS) == 1
    time.sleep(1.0)
    later = samples(scrape(url))
    generated = value(later, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert 1 <= generated < 1000, generated
    assert value(later, "vllm:num_requests_running") == 0


# ---------------------------------------------------------------------------------------------
# Prometheus
# ---------------------------------------------------------------------------------------------


def test_every_dashboard_and_alert_expression_returns_data(loaded: Prometheus, gateway) -> None:  # type: ignore[no-untyped-def]
    scraped = {s.name for f in text_string_to_metric_families(scrape(gateway.base_url)) for s in f.samples}
    exprs = dashboard_exprs() + [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]
    assert len(exprs) > 40
    empty, nan = [], []
    for where, expr in exprs:
        if needs_tenant_limits(expr) or metric_names(expr) <= FRONT_DOOR_ONLY:
            continue
        for name in metric_names(expr) - FRONT_DOOR_ONLY:
            assert name in scraped, f"{where}: {name} is not in the live scrape"
        query = substitute(without_threshold(expr))
        result = loaded.query(query)
        if not result:
            empty.append(f"{where}: {query}")
            continue
        values = [float(s["value"][1]) for s in result]
        if all(math.isnan(v) for v in values) and not any(m in expr for m in MAY_BE_NAN):
            nan.append(f"{where}: {query}")
    assert not empty, "expressions returning an empty vector:\n" + "\n".join(empty)
    assert not nan, "expressions returning only NaN after the load:\n" + "\n".join(nan)


@pytest.mark.timing
def test_load_is_visible_in_prometheus(loaded: Prometheus) -> None:
    window, at = loaded.load_window, loaded.load_scraped_at
    [gen] = loaded.query(f'sum(increase(vllm:generation_tokens_total{{job="llm-gateway"}}[{window}]))', at)
    assert float(gen["value"][1]) > 20
    statuses = {s["metric"]["status"] for s in loaded.query(
        f'sum by (status) (increase(gateway_requests_total{{job="llm-gateway"}}[{window}])) > 0', at)}
    assert {"200", "400"} <= statuses
    reasons = {s["metric"]["finished_reason"] for s in loaded.query(
        f'sum by (finished_reason) (increase(vllm:request_success_total[{window}])) > 0', at)}
    assert "length" in reasons
    [gone] = loaded.query(f'sum(increase(gateway_client_disconnects_total{{job="llm-gateway"}}[{window}]))', at)
    assert float(gone["value"][1]) > 0
    [ttft] = loaded.query(
        f'histogram_quantile(0.5, sum by (le) (rate(gateway_time_to_first_token_seconds_bucket[{window}])))', at)
    assert 0 < float(ttft["value"][1]) < 60


# Latency and saturation alerts may rightly go pending on a slow, shared 2-core CI machine.
PERFORMANCE_ALERTS = {"LLMGatewayTTFTHigh", "LLMGatewaySustainedQueueing", "LLMGatewayKVCacheNearlyFull"}


def test_alert_rules_load_and_stay_quiet_on_a_healthy_server(loaded: Prometheus) -> None:
    r = httpx.get(loaded.url + "/api/v1/rules", timeout=60).json()
    rules = [rule for g in r["data"]["groups"] for rule in g["rules"]]
    assert len(rules) == len(alert_rules())

    def evaluated() -> list[dict]:
        got = httpx.get(loaded.url + "/api/v1/rules", timeout=60).json()
        rs = [rule for g in got["data"]["groups"] for rule in g["rules"]]
        return rs if all(rule.get("lastEvaluation", "").startswith("20") for rule in rs) else []

    rules = wait_for(evaluated, timeout=30)
    assert rules
    for rule in rules:
        assert rule["health"] == "ok", rule
        if rule["name"] in PERFORMANCE_ALERTS and rule["state"] != "inactive":
            # then the condition must really hold: the full expression returns the firing series
            assert loaded.query(rule["query"]), rule
        else:
            assert rule["state"] == "inactive", rule


def test_dashboard_renders_from_prometheus(loaded: Prometheus, tmp_path: Path) -> None:
    """The script that made docs/dashboard.png draws every panel from this Prometheus."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_png", ROOT / "deploy" / "grafana" / "render_png.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    end = time.time()
    out = tmp_path / "dashboard.png"
    drawn = module.render(loaded.url, out, end - 120, end, 1.0, "30s")
    assert out.stat().st_size > 50_000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dash = json.loads(DASHBOARD.read_text())
    tenant_limits_only = {p["title"] for p in dash["panels"] if p["type"] != "row"
                          and all(needs_tenant_limits(t["expr"]) for t in p["targets"])}
    blank = [title for title, n in drawn.items()
             if n == 0 and "reload" not in title.lower() and title not in tenant_limits_only]
    assert not blank, f"panels drawn without data: {blank}"


def promql_regex(literal: str) -> str:
    """`literal` as a regex inside a PromQL string, as Grafana writes one selected value."""
    return re.escape(literal).replace("\\", "\\\\")


def test_two_instances_are_scraped_and_split_by_instance(gateway, notified_gateway, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One Prometheus scraping two gateway instances (the one-gateway-per-GPU layout): the
    dashboard's `$instance` variable lists both, its per-instance panels split them, "All" sums
    them, and selecting one instance keeps only its series. The second instance is the session's
    notified gateway (the systemd notify tests, later in file order, stop it)."""
    second = notified_gateway.server
    assert second.proc.poll() is None
    instances = [urllib.parse.urlsplit(s.base_url).netloc for s in (gateway, second)]
    for server in (gateway, second):  # the series exist before the first scrape (increase() needs that)
        assert complete(server.base_url, prompt="Warm-up:", max_tokens=2).status_code == 200
    (tmp_path / "prom").mkdir()
    with running_prometheus(tmp_path / "prom", instances) as prom:
        sent = {}
        for server, n in ((gateway, 2), (second, 3)):
            for i in range(n):
                assert complete(server.base_url, prompt=f"Instance load {i}:", max_tokens=4).status_code == 200
            assert stream_complete(server.base_url, prompt="Streamed:", max_tokens=4, ignore_eos=True)
            sent[server.base_url] = value(samples(scrape(server.base_url)), "gateway_requests_total", route=COMPLETIONS)

        def scraped_all() -> bool:
            got = {s["metric"]["instance"]: float(s["value"][1]) for s in prom.query(
                f'sum by (instance) (gateway_requests_total{{job="llm-gateway", route="{COMPLETIONS}"}})')}
            return all(got.get(inst, 0) >= sent[srv.base_url] for inst, srv in zip(instances, (gateway, second)))

        assert wait_for(scraped_all, timeout=60, interval=1.0), "Prometheus never scraped the load"
        wait_for(lambda: False, timeout=2 * float(SCRAPE[:-1]))  # one more scrape for the rates

        dash = json.loads(DASHBOARD.read_text())
        variable = next(v for v in dash["templating"]["list"] if v["name"] == "instance")
        listed = {s["metric"]["instance"] for s in prom.query(variable["query"]["query"].replace(
            "label_values(", "").rsplit(",", 1)[0])}
        assert listed == set(instances)

        per_instance = [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row"
                        for t in p["targets"] if "by (instance" in t["expr"]]
        assert len(per_instance) >= 3, per_instance
        for title, expr in per_instance:
            every = prom.query(substitute(expr))
            assert {s["metric"]["instance"] for s in every} == set(instances), (title, every)
            only = prom.query(substitute(expr.replace("$instance", promql_regex(instances[1]))))
            assert {s["metric"]["instance"] for s in only} == {instances[1]}, (title, only)

        # An aggregate panel with "All" is the sum of the two instances.
        rate = (f'sum(increase(gateway_requests_total{{job="llm-gateway", instance=~"$instance", '
                f'route="{COMPLETIONS}"}}[{RATE_WINDOW}]))')
        at = time.time()  # one evaluation time, so the three extrapolations match
        total = float(prom.query(substitute(rate), at)[0]["value"][1])
        parts = [float(prom.query(substitute(rate.replace("$instance", promql_regex(i))), at)[0]["value"][1])
                 for i in instances]
        assert total == pytest.approx(sum(parts)) and all(p > 0 for p in parts), (total, parts)
