"""`llm-gateway` (= `python -m server`): serve, prepare-model, check-config, keys, usage, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from server.settings import ConfigFileError, Settings, load_settings
from server.settings.engine import EMBEDDED_MODEL
from server.settings.schema import EMBEDDED_MODEL_DIRNAME, deep_merge, default_profile_path, read_profile_file

logger = logging.getLogger("llm_gateway")


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", help="YAML profile (default: $LLM_GATEWAY_CONFIG, else the shipped "
                        "profile for this machine: configs/embedded-cpu.yaml, or configs/gemma4-e2b-h200.yaml "
                        "with an NVIDIA GPU)")
    parser.add_argument("--host", help="bind address (server.host)")
    parser.add_argument("--port", type=int, help="bind port (server.port)")
    parser.add_argument("--state-dir", help="state directory (server.state_dir)")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--model", help="model directory or hub id (engine.model)")
    parser.add_argument("--served-model-name", help="name clients send as `model` (engine.served_model_name)")
    parser.add_argument("--max-model-len", type=int, help="context length (engine.max_model_len)")
    parser.add_argument("--api-key", action="append", help="accepted API key (auth.api_keys); repeatable")
    parser.add_argument("--api-key-file", help="file of API keys, one per line (auth.api_key_file)")
    parser.add_argument("--admin-key", action="append", help="admin key for /admin/* (auth.admin_keys); repeatable")
    parser.add_argument("--keys-file", help="keys file: named keys with limits and budgets (auth.keys_file)")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    server = {
        "host": args.host,
        "port": args.port,
        "state_dir": args.state_dir,
        "log_level": args.log_level,
    }
    engine = {
        "model": args.model,
        "served_model_name": args.served_model_name,
        "max_model_len": args.max_model_len,
    }
    auth = {
        "api_keys": args.api_key,
        "api_key_file": args.api_key_file,
        "admin_keys": args.admin_key,
        "keys_file": args.keys_file,
    }
    out: dict[str, Any] = {}
    if any(v is not None for v in auth.values()):
        out["auth"] = {k: v for k, v in auth.items() if v is not None}
    if any(v is not None for v in server.values()):
        out["server"] = {k: v for k, v in server.items() if v is not None}
    if any(v is not None for v in engine.values()):
        out["engine"] = {k: v for k, v in engine.items() if v is not None}
    return out


def _load(args: argparse.Namespace) -> Settings:
    try:
        return load_settings(args.config, **_overrides(args))
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "settings"
            lines.append(f"  {loc}: {err['msg']}")
        sys.exit("invalid configuration:\n" + "\n".join(lines))
    except (FileNotFoundError, ConfigFileError) as exc:
        sys.exit(f"invalid configuration: {exc}")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _load(args)
    _setup_logging(settings.server.log_level)
    replicas = args.replicas if args.replicas is not None else settings.server.replicas
    if replicas > 1:
        from server.replicas.supervisor import run_replicas

        return run_replicas(settings, args.serve_argv, replicas, client_limits=not args.no_client_limits)
    from server.runner.gateway import run

    cli = _overrides(args)

    def loader(config_path: str | None, overrides: dict[str, Any]) -> Settings:
        # CLI flags keep winning on reload; the request's overrides win over everything.
        return load_settings(config_path, **deep_merge(cli, overrides))

    code = run(settings, loader=loader, config_path=args.config or os.environ.get("LLM_GATEWAY_CONFIG"))
    # Everything is stopped and cleaned up by now. Skip interpreter teardown: vLLM objects
    # finalized after their modules are torn down print spurious tracebacks.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_prepare_model(args: argparse.Namespace) -> int:
    settings = _load(args)
    if args.if_needed and settings.engine.model != EMBEDDED_MODEL:
        print(f"[prepare-model] profile uses {settings.engine.model}; nothing to prepare")
        return 0
    from server.model_prep import prepare_embedded_model, write_second_version

    prepare_embedded_model(settings.server.state_dir, force=args.force)
    if args.second_version:
        write_second_version(settings.server.state_dir, force=args.force)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    settings = _load(args)
    from server.settings.checks import profile_warnings

    shown = settings.model_dump(mode="json")
    for field in ("api_keys", "admin_keys"):
        shown["auth"][field] = ["***"] * len(shown["auth"][field])  # never print secrets
    if shown["auth"]["redis_url"]:
        shown["auth"]["redis_url"] = re.sub(r"//[^@/]*@", "//***@", shown["auth"]["redis_url"])
    print(json.dumps(shown, indent=2))
    for warning in profile_warnings(settings):
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _keys_file_of(args: argparse.Namespace) -> Path:
    """--keys-file, else $LLM_GATEWAY_AUTH__KEYS_FILE, else the profile's auth.keys_file, read
    without validating the profile (the file may not exist yet)."""
    if args.keys_file:
        return Path(args.keys_file)
    if os.environ.get("LLM_GATEWAY_AUTH__KEYS_FILE"):
        return Path(os.environ["LLM_GATEWAY_AUTH__KEYS_FILE"])
    config = args.config or os.environ.get("LLM_GATEWAY_CONFIG") or default_profile_path()
    try:
        named = (read_profile_file(Path(config)).get("auth") or {}).get("keys_file")
    except (ConfigFileError, AttributeError):
        named = None
    if not named:
        sys.exit(f"no keys file: pass --keys-file, or set auth.keys_file in {config}")
    return Path(named)


def cmd_keys_add(args: argparse.Namespace) -> int:
    from server.settings.keys_file import KeysFileError
    from server.tenants.cli import LIMIT_OPTIONS, add_key

    path = _keys_file_of(args)
    limits = {name: getattr(args, name) for name in LIMIT_OPTIONS}
    try:
        key, done = add_key(path, args.name, limits)
    except KeysFileError as exc:
        sys.exit(f"keys add: {exc}")
    print(key)
    print(f"{done}; the file holds only the key's SHA-256, so the key above is shown this once. Running "
          "gateways take it on SIGHUP (systemctl reload llm-gateway) or POST /admin/reload.", file=sys.stderr)
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    from server.tenants.cli import print_usage

    if args.usage_db:
        db = Path(args.usage_db)
    else:
        settings = _load(args)
        db = settings.auth.usage_path(settings.server.state_dir)
    return print_usage(db, args.tenant, getattr(args, "from"), args.to)


def cmd_reload(args: argparse.Namespace) -> int:
    from server.lifecycle.rolling_reload import RollError, roll

    admin_key = args.admin_key or os.environ.get("LLM_GATEWAY_ADMIN_KEY")
    try:
        roll(args.urls, admin_key=admin_key, config=args.config, ready_timeout_s=args.ready_timeout)
    except RollError as exc:
        print(f"reload: {exc}", file=sys.stderr)
        return 1
    return 0


def _day(text: str) -> str:
    import datetime

    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a day (YYYY-MM-DD): {text!r}") from None
    return text


def cmd_bench(argv: list[str]) -> int:
    from loadtest.cli import main as loadtest_main

    return loadtest_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # Forwarded untouched: argparse would otherwise eat the load tester's own flags and --help.
        return cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="llm-gateway", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI API")
    _add_config_args(serve)
    serve.add_argument("--replicas", type=int, default=None, metavar="N",
                       help="N gateway processes (each with its engine) on ports server.port+1..+N behind nginx "
                            "on server.host:server.port; on a GPU each takes 1/N of gpu_memory_utilization less 0.05 "
                            "(default: the profile's server.replicas, 1 unless set: one process, no nginx)")
    serve.add_argument("--no-client-limits", action="store_true",
                       help="with --replicas: leave out the shipped nginx site's per-client request and "
                            "connection limits (a load test from one address)")
    serve.set_defaults(func=cmd_serve)

    prep = sub.add_parser("prepare-model", help="download, verify and convert the embedded model")
    _add_config_args(prep)
    prep.add_argument("--force", action="store_true", help="convert again even if verified")
    prep.add_argument("--if-needed", action="store_true",
                      help="do nothing unless the profile uses the embedded model")
    prep.add_argument("--second-version", action="store_true",
                      help="also write a second version of the embedded model (same architecture and "
                           "tokenizer, deterministically perturbed weights) to <state_dir>/models/"
                           f"{EMBEDDED_MODEL_DIRNAME}-v2, for trying an in-place reload")
    prep.set_defaults(func=cmd_prepare_model)

    check = sub.add_parser("check-config", help="validate a profile and print the effective settings")
    _add_config_args(check)
    check.set_defaults(func=cmd_check_config)

    keys = sub.add_parser("keys", help="the keys file (auth.keys_file)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    add = keys_sub.add_parser("add", help="print a new random key for NAME once, and write its SHA-256 to the keys file")
    add.add_argument("name", help="the tenant's name (its metrics label); an existing name gets a second key")
    add.add_argument("--keys-file", help="the keys file (default: $LLM_GATEWAY_AUTH__KEYS_FILE, else the "
                     "profile's auth.keys_file)")
    add.add_argument("--config", "-c", help="the profile naming auth.keys_file")
    add.add_argument("--requests-per-minute", type=int)
    add.add_argument("--tokens-per-minute", type=int, help="prompt + completion tokens per minute")
    add.add_argument("--max-concurrent", type=int, help="requests running at once")
    add.add_argument("--budget-tokens", type=int, help="prompt + completion tokens per --budget-period")
    add.add_argument("--budget-period", choices=["day", "month"])
    add.add_argument("--model", dest="models", action="append", help="an allowed model; repeatable (default: all)")
    add.add_argument("--share", type=float, help="weight when the engine is full (auth.fair_share; default 1)")
    add.set_defaults(func=cmd_keys_add)

    usage = sub.add_parser("usage", help="print the usage store (per tenant and UTC day) as a table")
    _add_config_args(usage)
    usage.add_argument("--usage-db", help="the usage store (default: the profile's auth.usage_db, else "
                       "<state_dir>/usage.sqlite3)")
    usage.add_argument("--from", type=_day, help="first UTC day, YYYY-MM-DD")
    usage.add_argument("--to", type=_day, help="last UTC day, YYYY-MM-DD")
    usage.add_argument("--tenant", help="only this tenant")
    usage.set_defaults(func=cmd_usage)

    rolling = sub.add_parser("reload", help="reload running instances one at a time (POST /admin/reload, then "
                             "/ready before the next): the replicas behind one nginx site")
    rolling.add_argument("urls", nargs="+", metavar="URL", help="an instance, e.g. http://127.0.0.1:8000")
    rolling.add_argument("--admin-key", help="one of auth.admin_keys (default: $LLM_GATEWAY_ADMIN_KEY)")
    rolling.add_argument("--config", help="another profile file for every instance (default: each one's own)")
    rolling.add_argument("--ready-timeout", type=float, default=900.0,
                         help="seconds an instance may take to answer /ready after its reload (default 900)")
    rolling.set_defaults(func=cmd_reload)

    sub.add_parser("bench", add_help=False, help="load test a server (= python -m loadtest; see loadtest/README.md)")

    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.replicas is not None and args.replicas < 1:
            parser.error("--replicas needs a number >= 1")
        args.serve_argv = argv[1:]
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
