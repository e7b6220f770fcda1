"""Every `gateway_*` metric, on an injectable registry, plus the exposition of vLLM's `vllm:*`.

Names carry unit suffixes, buckets are explicit, labels are few (route, status, reason, state,
outcome, tenant, kind, backend). `tenant` is bounded by the keys file (one value per tenant). This module imports neither the routes nor the engine: they call into it.
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import (
    CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE,
)
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from server import __version__

# Latency buckets (seconds) sized for LLM serving: sub-ms gateway work up to multi-minute generations.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
                    60.0, 120.0, 300.0, 600.0)
# Waiting for a place in a full engine (the tenants' fair queue): nothing below capacity, up to
# a long request's whole duration above it.
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
# Deciding a request's tenant limits: microseconds in memory, a loopback round trip with Redis.
LIMITER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
RELOAD_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)
PAUSE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# A full garbage collection on the event loop: ~1 ms with the startup heap frozen, ~150 ms without.
GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

ENGINE_STATES = ("starting", "serving", "reloading", "draining", "stalled", "dead", "stopped")

REJECTION_REASONS = ("auth", "overload", "rate_limit", "budget", "validation", "unavailable")
TENANT_REFUSALS = ("requests", "tokens", "concurrency", "budget")

# Routes kept out of request metrics: scraping and probing are not traffic.
UNMEASURED_ROUTES = frozenset({"/metrics", "/health", "/ready"})


class GatewayMetrics:
    """The gateway's own metric families, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gateway_requests", "HTTP requests by route and status code.",
            ["route", "status"], registry=r)
        self.in_flight = Gauge(
            "gateway_requests_in_flight", "HTTP requests being served now.", ["route"], registry=r)
        self.request_duration = Histogram(
            "gateway_request_duration_seconds", "HTTP request duration, to the last byte.",
            ["route"], buckets=DURATION_BUCKETS, registry=r)
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds",
            "Time from request arrival to the first generated token leaving the gateway.",
            ["route"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            "gateway_time_per_output_token_seconds",
            "(duration - TTFT) / (completion tokens - 1), as the client sees it.",
            ["route"], buckets=TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "gateway_prompt_tokens", "Prompt tokens of completed requests.", ["route"], registry=r)
        self.completion_tokens = Counter(
            "gateway_completion_tokens", "Generated tokens sent to clients.", ["route"], registry=r)
        self.finished = Counter(
            "gateway_request_finish", "Finished choices by finish reason.",
            ["route", "reason"], registry=r)
        self.disconnects = Counter(
            "gateway_client_disconnects", "Requests whose client went away before the end (aborted).",
            ["route"], registry=r)
        self.rejections = Counter(
            "gateway_rejections", "Requests refused before reaching the engine, by reason.",
            ["reason"], registry=r)
        self.engine_state = Gauge(
            "gateway_engine_state", "1 for the engine's current state, 0 for the others.",
            ["state"], registry=r)
        self.engine_stalls = Counter(
            "gateway_engine_stalls", "Times the engine stalled: requests pending in it and no engine "
            "output for health.stall_timeout_s.", registry=r)
        self.engine_quiet = Gauge(
            "gateway_engine_quiet_seconds", "Seconds without engine output while requests are pending in "
            "it (0 when idle or moving); the stall rule fires at health.stall_timeout_s.", registry=r)
        self.reloads = Counter(
            "gateway_engine_reloads", "Engine reloads by outcome.", ["outcome"], registry=r)
        self.reload_duration = Histogram(
            "gateway_engine_reload_duration_seconds", "Engine reload duration.",
            buckets=RELOAD_BUCKETS, registry=r)
        self.reload_queued = Counter(
            "gateway_engine_reload_queued_requests", "Requests that waited for a reload to finish.",
            registry=r)
        self.reload_pause = Histogram(
            "gateway_engine_reload_pause_seconds", "In-place reloads: how long generation was paused "
            "(pause, weight load, resume).", buckets=PAUSE_BUCKETS, registry=r)
        self.reload_kept = Counter(
            "gateway_engine_reload_kept_requests", "Requests in flight across an in-place reload "
            "(paused and resumed on the new weights).", registry=r)
        self.reload_aborted = Counter(
            "gateway_engine_reload_aborted_requests", "Requests aborted by a reload's drain timeout.",
            registry=r)
        self.gc_full_collection = Histogram(
            "gateway_gc_full_collection_seconds", "Full (oldest generation) garbage collections in the "
            "gateway process; each one pauses the event loop.", buckets=GC_BUCKETS, registry=r)
        self.tenant_requests = Counter(
            "gateway_tenant_requests", "Generation requests by tenant and status code.",
            ["tenant", "status"], registry=r)
        self.tenant_tokens = Counter(
            "gateway_tenant_tokens", "Tokens used by tenant: kind is prompt or completion.",
            ["tenant", "kind"], registry=r)
        self.tenant_rate_limited = Counter(
            "gateway_tenant_rate_limited", "Requests refused with 429 (or streams ended) by the tenant's "
            "limits, by the limit: requests, tokens, concurrency, budget.", ["tenant", "reason"], registry=r)
        self.tenant_budget = Gauge(
            "gateway_tenant_budget_tokens", "The tenant's token budget per period (day or month).",
            ["tenant"], registry=r)
        self.tenant_budget_used = Gauge(
            "gateway_tenant_budget_used_tokens", "Tokens counted against the tenant's budget this period "
            "(running requests count what they hold).", ["tenant"], registry=r)
        self.tenant_queue = Histogram(
            "gateway_tenant_queue_seconds", "Time a tenant's generation requests waited for a place in a "
            "full engine (auth.fair_share; 0 below capacity).", ["tenant"], buckets=QUEUE_BUCKETS, registry=r)
        self.tenant_queued = Gauge(
            "gateway_tenant_queued_requests", "A tenant's generation requests waiting now for a place in a "
            "full engine (auth.fair_share).", ["tenant"], registry=r)
        self.tenant_share = Gauge(
            "gateway_tenant_share", "The tenant's weight under contention (`share` in the keys file): "
            "a full engine's places go to active tenants in proportion to it.", ["tenant"], registry=r)
        self.limiter_duration = Histogram(
            "gateway_tenant_limiter_duration_seconds", "Time to decide a request's tenant limits.",
            ["backend"], buckets=LIMITER_BUCKETS, registry=r)
        self.limiter_degraded = Counter(
            "gateway_tenant_limiter_degraded", "Requests whose limits were counted per instance because "
            "Redis failed (or is left alone for auth.redis_retry_s after a failure).", registry=r)
        self.keys_reloads = Counter(
            "gateway_tenant_keys_reloads", "Re-reads of the keys file by outcome.", ["outcome"], registry=r)
        self.profile = Info(
            "gateway_profile", "The active engine profile.", registry=r)
        self.build = Info("gateway_build", "Build information.", registry=r)
        self.build.info({
            "version": __version__,
            "python": platform.python_version(),
        })
        for state in ENGINE_STATES:
            self.engine_state.labels(state=state).set(0)
        for route in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
            # Pre-create label sets so dashboards and rules see zeros rather than no data.
            self.in_flight.labels(route=route).set(0)
            self.disconnects.labels(route=route)
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason=reason)
        for outcome in ("success", "failure"):
            self.keys_reloads.labels(outcome=outcome)
        for outcome in ("success", "failure", "rolled_back"):
            self.reloads.labels(outcome=outcome)

    def set_engine_state(self, state: str) -> None:
        for s in ENGINE_STATES:
            self.engine_state.labels(state=s).set(1 if s == state else 0)

    def observe_reload(self, result: Any) -> None:
        """Record a finished reload (a server.lifecycle.holder.ReloadResult)."""
        self.reloads.labels(outcome=result.outcome).inc()
        self.reload_duration.observe(result.duration_s)
        self.reload_queued.inc(result.queued)
        self.reload_aborted.inc(result.aborted)
        if result.pause_s is not None:
            self.reload_pause.observe(result.pause_s)
            self.reload_kept.inc(result.kept)

    def set_profile(self, labels: dict[str, str]) -> None:
        self.profile.info(labels)

    def observe_rejection(self, status: int, reason: str | None = None) -> None:
        """`reason` where the refusing layer knows it (a tenant's `rate_limit` / `budget`), else by status."""
        reason = reason or {401: "auth", 403: "auth", 429: "overload", 503: "unavailable"}.get(status)
        if reason is None and 400 <= status < 500:
            reason = "validation"
        if reason is not None:
            self.rejections.labels(reason=reason).inc()

    def add_tenants(self, tenants: Iterable[Any]) -> None:
        """Label sets for every tenant (server.settings.keys_file.Tenant), so panels show zeros, not gaps."""
        for tenant in tenants:
            for kind in ("prompt", "completion"):
                self.tenant_tokens.labels(tenant=tenant.name, kind=kind)
            for refusal in TENANT_REFUSALS:
                self.tenant_rate_limited.labels(tenant=tenant.name, reason=refusal)
            self.tenant_share.labels(tenant=tenant.name).set(tenant.limits.share)
            self.tenant_queued.labels(tenant=tenant.name)
            self.tenant_queue.labels(tenant=tenant.name)
            if tenant.limits.budget_tokens:
                self.tenant_budget.labels(tenant=tenant.name).set(tenant.limits.budget_tokens)
                self.tenant_budget_used.labels(tenant=tenant.name)
            else:  # a reloaded keys file may have dropped the budget
                for gauge in (self.tenant_budget, self.tenant_budget_used):
                    with contextlib.suppress(KeyError):
                        gauge.remove(tenant.name)


def exposition(metrics: GatewayMetrics, openmetrics: bool, include_vllm: bool = True) -> tuple[bytes, str]:
    """The /metrics body: the gateway registry, then vLLM's families from the global registry."""
    if openmetrics:
        body = generate_openmetrics(metrics.registry)
        # OpenMetrics ends with "# EOF"; vLLM's families go before it.
        if include_vllm:
            # prometheus_client's default "underscores" escaping rewrites the ':' of sample
            # names (vllm:x -> vllm_x) but not of their # TYPE lines, so the samples would not
            # belong to their families. ':' is a legal (legacy) name rune: with allow-utf-8,
            # legacy-valid names are written unchanged.
            vllm_text = _openmetrics_keep_colons(_VllmOnly(REGISTRY))
            body = body.removesuffix(b"# EOF\n") + vllm_text
        return body, OPENMETRICS_CONTENT_TYPE
    body = generate_latest(metrics.registry)
    if include_vllm:
        body += generate_latest(_VllmOnly(REGISTRY))
    return body, CONTENT_TYPE_LATEST


def _openmetrics_keep_colons(collector: object) -> bytes:
    try:
        return generate_openmetrics(collector, escaping="allow-utf-8")
    except TypeError:  # prometheus_client before 0.22 has no escaping and keeps ':' as is
        return generate_openmetrics(collector)


class _VllmOnly:
    """A collector view of `registry` restricted to the `vllm:` families."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable:
        for family in self._registry.collect():
            if family.name.startswith("vllm:"):
                yield family
