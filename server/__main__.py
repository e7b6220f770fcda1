"""`llm-gateway` (= `python -m server`): serve, prepare-model, check-config, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from typing import Any

from pydantic import ValidationError

from server.settings import EMBEDDED_MODEL, ConfigFileError, Settings, deep_merge, load_settings

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
    parser.add_argument("--keys-file", help="tenants' keys file: keys, limits, quotas (tenants.keys_file)")


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
    }
    out: dict[str, Any] = {}
    if args.keys_file is not None:
        out["tenants"] = {"keys_file": args.keys_file}
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
    from server.lifespan import run

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
    from server.model_prep import prepare_embedded_model

    prepare_embedded_model(settings.server.state_dir, force=args.force)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    settings = _load(args)
    from server.profile_checks import profile_warnings

    shown = settings.model_dump(mode="json")
    for field in ("api_keys", "admin_keys"):
        shown["auth"][field] = ["***"] * len(shown["auth"][field])  # never print secrets
    if shown["tenants"]["redis_url"]:
        shown["tenants"]["redis_url"] = re.sub(r"//[^@/]*@", "//***@", shown["tenants"]["redis_url"])
    print(json.dumps(shown, indent=2))
    for warning in profile_warnings(settings):
        print(f"warning: {warning}", file=sys.stderr)
    return 0


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
    serve.set_defaults(func=cmd_serve)

    prep = sub.add_parser("prepare-model", help="download, verify and convert the embedded model")
    _add_config_args(prep)
    prep.add_argument("--force", action="store_true", help="convert again even if verified")
    prep.add_argument("--if-needed", action="store_true",
                      help="do nothing unless the profile uses the embedded model")
    prep.set_defaults(func=cmd_prepare_model)

    check = sub.add_parser("check-config", help="validate a profile and print the effective settings")
    _add_config_args(check)
    check.set_defaults(func=cmd_check_config)

    sub.add_parser("bench", add_help=False, help="load test a server (= python -m loadtest; see loadtest/README.md)")

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
