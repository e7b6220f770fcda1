"""The command line the HTTP drivers share, and the setup after it is parsed: the workload
(`--input-tokens`, `--output-tokens`, `--vocab-size`, `--seed`), where a run writes (`--label`,
`--out`, `--workdir`, `--deadline-s`, `--doc`), and the run's deadline and work folder.
(`servers.add_profile_args` adds which profile a driver starts from.)"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def add_workload_args(ap: argparse.ArgumentParser, *, input_tokens: int | None = 512, output_tokens: int | None = 256,
                      input_help: str | None = None, output_help: str | None = None, seed: bool = True) -> None:
    """Prompt and output length in tokens, the prompt ids' range, and the prompts' seed."""
    ap.add_argument("--input-tokens", type=int, default=input_tokens, help=input_help)
    ap.add_argument("--output-tokens", type=int, default=output_tokens, help=output_help)
    ap.add_argument("--vocab-size", type=int, default=None, help="prompt ids in [0, N) (default: the model's)")
    if seed:
        ap.add_argument("--seed", type=int, default=0)


def add_run_args(ap: argparse.ArgumentParser, *, out: str | None, deadline_s: float, label: bool = True,
                 doc: bool = True, workdir_help: str = "profiles, server logs and raw client files") -> None:
    """`out` is the results file's default name (None: no --out, the driver names its own output)."""
    if label:
        ap.add_argument("--label", default=None, help="free text stored with the results (e.g. 'CPU smoke')")
    if out is not None:
        ap.add_argument("--out", type=Path, default=Path(out))
    ap.add_argument("--workdir", type=Path, default=None, help=workdir_help + " (default: a new temp folder)")
    ap.add_argument("--deadline-s", type=float, default=deadline_s)
    if doc:
        ap.add_argument("--doc", type=Path, default=None, help="also write {meta, results} of this run here")


@dataclass(frozen=True, slots=True)
class Run:
    t_end: float  # time.monotonic() by which the driver must be done
    workdir: Path


def start_run(a: argparse.Namespace, prefix: str) -> Run:
    """After parse_args: the deadline from now, the work folder (made; a temp folder named `prefix`
    unless --workdir), and --out made absolute (the servers run in other folders)."""
    t_end = time.monotonic() + a.deadline_s
    workdir = (a.workdir or Path(tempfile.mkdtemp(prefix=f"{prefix}-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if getattr(a, "out", None) is not None:
        a.out = a.out.resolve()
    return Run(t_end, workdir)
