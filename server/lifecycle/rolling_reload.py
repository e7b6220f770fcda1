"""`llm-gateway reload URL...`: reload several gateway instances one at a time (the replicas behind
one nginx site, `deploy/install.sh --replicas-per-gpu`), so capacity never drops to zero.

Each instance gets POST /admin/reload, which answers once its reload has ended (the new engine
serving, or the old one kept after a rollback), then must answer /ready before the next one starts.
Before an instance is reloaded, every other instance must be ready: a reload never takes the last
serving instance out. A refused or failed reload stops the roll, so a bad profile reaches one
instance, not all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx


@dataclass
class Step:
    """One instance reloaded and ready again (a failure raises RollError instead)."""

    url: str
    detail: str
    seconds: float


class RollError(Exception):
    """The roll stopped before every instance was reloaded."""


def ready(client: httpx.Client, url: str, timeout_s: float = 5.0, on_timeout: bool = False) -> bool:
    """The instance at `url` answers 200 on /ready (False when unreachable; `on_timeout` when it
    does not answer within `timeout_s`)."""
    try:
        return client.get(url + "/ready", timeout=timeout_s).status_code == 200
    except httpx.TimeoutException:
        return on_timeout
    except httpx.HTTPError:
        return False


def _wait_ready(client: httpx.Client, url: str, timeout_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if ready(client, url):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def _reload_detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:300]}"
    if response.status_code == 200:  # ReloadResult.as_dict()
        if body.get("engine_reloaded") is False:
            return "profile unchanged: keys file re-read, engine kept"
        waited = ""
        if body.get("queued"):
            waited = f", {body['queued']} request(s) waited up to {body.get('max_queue_wait_s', 0):.1f} s"
        return f"{body.get('outcome', 'done')} ({body.get('strategy', '?')}, {body.get('duration_s', 0):.1f} s{waited})"
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else None
    return f"HTTP {response.status_code}: {message or response.text[:300]}"


def roll(
    urls: list[str],
    *,
    admin_key: str | None = None,
    config: str | None = None,
    reload_timeout_s: float = 1800.0,
    ready_timeout_s: float = 900.0,
    poll_s: float = 1.0,
    report: Callable[[str], None] = print,
    client: httpx.Client | None = None,
) -> list[Step]:
    """Reload `urls` in order; raise RollError at the first instance that cannot be reloaded."""
    urls = [u.rstrip("/") for u in urls]
    if not urls:
        raise RollError("no instance given")
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    body = {"config": config} if config else None
    own = client is None
    client = client or httpx.Client()
    steps: list[Step] = []
    try:
        for i, url in enumerate(urls):
            others = [u for u in urls if u != url]
            not_ready = [u for u in others if not ready(client, u)]
            if not_ready:
                raise RollError(f"not reloading {url}: {', '.join(not_ready)} not ready, so it would "
                                "leave too few instances serving; reloaded so far: "
                                f"{', '.join(s.url for s in steps) or 'none'}")
            report(f"[{i + 1}/{len(urls)}] {url}: reloading")
            t0 = time.monotonic()
            try:
                response = client.post(url + "/admin/reload", json=body, headers=headers, timeout=reload_timeout_s)
            except httpx.HTTPError as exc:
                raise RollError(f"{url}: reload request failed ({exc.__class__.__name__}: {exc}); "
                                "the remaining instances were not reloaded") from exc
            detail = _reload_detail(response)
            if response.status_code != 200:
                raise RollError(f"{url}: {detail}; the remaining instances were not reloaded")
            if not _wait_ready(client, url, ready_timeout_s, poll_s):
                raise RollError(f"{url}: reloaded ({detail}) but not ready after {ready_timeout_s:.0f} s; "
                                "the remaining instances were not reloaded")
            step = Step(url, detail, time.monotonic() - t0)
            steps.append(step)
            report(f"[{i + 1}/{len(urls)}] {url}: {detail}, ready after {step.seconds:.1f} s")
    finally:
        if own:
            client.close()
    return steps
