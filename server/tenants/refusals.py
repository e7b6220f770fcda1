"""What a tenant is told when a limit refuses it: OpenAI's words, status, `code` and retry headers
(`x-ratelimit-*`, `Retry-After`, `retry-after-ms`, `x-should-retry`)."""

from __future__ import annotations

import math

from server.errors import GatewayError, InsufficientQuotaError, ModelNotFoundError, RateLimitExceededError
from server.settings.keys_file import Tenant
from server.tenants.limiter import (
    BUDGET,
    CONCURRENCY,
    REQUESTS,
    Bucket,
    Decision,
    period_of,
    seconds_to_next_period,
)


def duration_text(seconds: float) -> str:
    """A reset time as OpenAI's x-ratelimit-reset-* headers write it: `20ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(math.ceil(seconds * 1000), 0)}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{int(minutes)}m{text}"
    if hours:
        text = f"{int(hours)}h{text}"
    return text


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the per-minute limits the tenant has."""
    headers: dict[str, str] = {}
    for kind, bucket in (("requests", decision.requests), ("tokens", decision.tokens)):
        if bucket is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(bucket.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(bucket.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = duration_text(bucket.reset_s)
    return headers


def budget_spent(tenant: Tenant, used: int | None, period: str, now: float) -> InsufficientQuotaError:
    per = tenant.limits.budget_period
    renews = period_of(now + seconds_to_next_period(now, per) + 1, per)
    return InsufficientQuotaError(
        f"You exceeded your current quota: tenant {tenant.name} has used {used or 0} of its "
        f"{tenant.limits.budget_tokens} tokens for {period}. The budget renews with {renews} (UTC).")


def refusal_error(decision: Decision, now: float, max_tokens_param: str = "max_tokens") -> GatewayError:
    """The 429 for a refused request, in OpenAI's words and shape, with its retry headers;
    `max_tokens_param` is the route's name for it (/v1/responses: max_output_tokens)."""
    tenant, reserved = decision.tenant, decision.reserved
    headers = ratelimit_headers(decision)
    if decision.reason == BUDGET:
        error = budget_spent(tenant, decision.budget_used, decision.period, now)
        error.headers = {**headers, "Retry-After": str(math.ceil(decision.retry_after_s)), "x-should-retry": "false"}
        return error
    if decision.never:
        headers["x-should-retry"] = "false"
        return RateLimitExceededError(
            f"Request too large for tenant {tenant.name} on tokens per min (TPM): Limit "
            f"{tenant.limits.tokens_per_minute}, Requested {reserved} (the prompt plus {max_tokens_param} x n, or "
            f"the whole context when {max_tokens_param} is not set). Lower {max_tokens_param} or shorten the prompt.",
            param=max_tokens_param, headers=headers)
    wait = decision.retry_after_s
    headers.update({"Retry-After": str(max(math.ceil(wait), 1)), "retry-after-ms": str(max(math.ceil(wait * 1000), 1))})
    if decision.reason == CONCURRENCY:
        return RateLimitExceededError(
            f"Too many concurrent requests for tenant {tenant.name}: Limit {tenant.limits.max_concurrent}. "
            "Please try again when one of them has finished.", headers=headers)
    bucket: Bucket | None = decision.requests if decision.reason == REQUESTS else decision.tokens
    unit = "requests per min (RPM)" if decision.reason == REQUESTS else "tokens per min (TPM)"
    requested = "" if decision.reason == REQUESTS else f", Requested {reserved}"
    return RateLimitExceededError(
        f"Rate limit reached for tenant {tenant.name} on {unit}: Limit {bucket.limit if bucket else 0}, "
        f"Remaining {bucket.remaining if bucket else 0}{requested}. Please try again in {duration_text(wait)}.",
        headers=headers)


def model_refused(model: str) -> ModelNotFoundError:
    # OpenAI's words for a model a key may not use: it does not say whether the model exists.
    return ModelNotFoundError(f"The model `{model}` does not exist or you do not have access to it.", param="model")
