"""The gateway's HTTP stack on the scripted engine (testbed/fakes.py: no model, answers at once), one
way per process: `no-keys`, `tenants` (a keys file of 2 tenants at limits never reached, usage in
SQLite), `tenants-redis` (the same with the limits in Redis) or `before` (a tree from before tenants).
tenants_overhead.py and frontend_capacity.py start one per way or tree with `start`.

The child runs this file by path with `python -P` (its directory is not put on the import path),
from the tree being measured with PYTHONPATH set to that tree, so that `server` and the scripted engine
come from it and not from this checkout. This file therefore imports nothing from `benchmarks` at
its top.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

BASELINE = "no-keys"
SCRIPTED_WAYS = ("before", BASELINE, "tenants", "tenants-redis")
TENANT_KEYS = ("sk-bench-a", "sk-bench-b")
GENEROUS = {"requests_per_minute": 10**9, "tokens_per_minute": 10**12, "max_concurrent": 10**4,
            "budget_tokens": 10**15}


def keys_file(workdir: Path) -> Path:
    """WORKDIR/keys.yaml: the bench tenants' keys at GENEROUS limits (written once, then reused).
    Written whole under another name and renamed: the tenant ways' servers start at once, and one
    that read the file half written would serve without keys (every request tenant `unnamed`). Not
    server.tenants.cli's writer: this runs with `server` from the tree being measured, which may
    predate it."""
    path = workdir / "keys.yaml"
    if not path.exists():
        part = path.with_name(f"keys.yaml.{os.getpid()}")
        part.write_text(json.dumps({"keys": [{"name": f"bench-{i}", "key": key, **GENEROUS}
                                             for i, key in enumerate(TENANT_KEYS)]}))
        os.replace(part, path)
    return path


def serve(way: str, port: int, workdir: Path, redis_url: str | None) -> None:
    """The gateway's app on the scripted engine, one way, on loopback `port` until SIGTERM."""
    import uvicorn

    from server.app import build_app
    from server.settings import EngineProfile, Settings

    try:  # this layout
        from server.lifecycle.holder import EngineHolder
        from server.runner.http_options import uvicorn_http_options
        from testbed.fakes import FakeEngine
    except ImportError:  # a tree from before server/ was grouped by job (and testbed/ existed)
        from server.holder import EngineHolder  # type: ignore[no-redef]
        from server.http_protocol import uvicorn_http_options  # type: ignore[no-redef]
        from tests.fakes import FakeEngine  # type: ignore[no-redef]

    auth: dict[str, Any] = {}
    if way.startswith("tenants"):
        auth = {"keys_file": keys_file(workdir), "usage_db": workdir / f"usage-{way}.sqlite3"}
        if way == "tenants-redis":
            auth["redis_url"] = redis_url
    settings = Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1, served_model_name="fake",
                                             max_model_len=4096),
                        server={"state_dir": workdir}, **({"auth": auth} if auth else {}))
    engine = FakeEngine()
    engine.info.max_model_len = 4096

    async def factory(_: Settings) -> FakeEngine:
        return engine

    async def main() -> None:
        holder = EngineHolder(settings, factory)
        if "tenancy" in inspect.signature(build_app).parameters:  # build_app takes its parts
            from server.metrics import GatewayMetrics
            from server.tenants.service import Tenancy

            tenancy = Tenancy(settings)
            app = build_app(settings, holder, GatewayMetrics(), tenancy)
        else:  # an older tree: build_app made them (and a tree before tenants has none)
            app = build_app(settings, holder)
            tenancy = getattr(app.state, "tenancy", None)
        await holder.start()
        if tenancy is not None:
            await tenancy.start()
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False,
                                lifespan="off", **uvicorn_http_options(settings.server.max_header_bytes))
        server = uvicorn.Server(config)
        # uvicorn re-raises SIGTERM once it has stopped, which would end the process before the
        # usage store's last flush below; stop it by hand instead.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
        try:
            await server.serve()
        finally:
            if tenancy is not None:
                await tenancy.stop()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


def start(name: str, way: str, tree: Path, workdir: Path, log_path: Path, redis_url: str | None = None):  # noqa: ANN201
    """One scripted server for `way`, serving `tree`'s `server` package; returns the started
    servers.Server (not yet ready: wait on /ready)."""
    # Imported here: at the top it would be imported in the child too, from the measured tree.
    from benchmarks.lib import servers

    port = servers.free_port()
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--way", way, "--port", str(port),
           "--workdir", str(workdir)] + (["--redis-url", redis_url] if redis_url else [])
    return servers.start_server(name, cmd, log_path, port, servers.clean_env({"PYTHONPATH": str(tree)}), cwd=tree)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--way", choices=SCRIPTED_WAYS, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--workdir", type=Path, required=True, help="keys file, usage databases, state")
    ap.add_argument("--redis-url", default=None, help="for tenants-redis")
    a = ap.parse_args()
    serve(a.way, a.port, a.workdir, a.redis_url)


if __name__ == "__main__":
    main()
