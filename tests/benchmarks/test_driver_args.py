"""benchmarks/lib/driver.py: the drivers' shared command line and run setup."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.lib.driver import add_run_args, add_workload_args, start_run


def parser(**run: object) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    add_run_args(ap, out="x.jsonl", deadline_s=60.0, **run)  # type: ignore[arg-type]
    return ap


def test_defaults_and_a_temp_workdir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    a = parser().parse_args([])
    assert (a.input_tokens, a.output_tokens, a.vocab_size, a.seed, a.label, a.doc) == (512, 256, None, 0, None, None)
    run = start_run(a, "driver-test")
    try:
        assert a.out == tmp_path / "x.jsonl" and a.out.is_absolute()
        assert run.workdir.is_dir() and run.workdir.name.startswith("driver-test-")
    finally:
        run.workdir.rmdir()


def test_given_workdir_is_made_and_options_can_be_left_out(tmp_path: Path) -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap, input_tokens=None, seed=False)
    add_run_args(ap, out=None, deadline_s=1.0, label=False, doc=False)
    a = ap.parse_args(["--workdir", str(tmp_path / "w" / "deeper"), "--deadline-s", "5"])
    assert a.input_tokens is None and not hasattr(a, "seed") and not hasattr(a, "out") and not hasattr(a, "doc")
    run = start_run(a, "unused")
    assert run.workdir == (tmp_path / "w" / "deeper").resolve() and run.workdir.is_dir()
    with pytest.raises(SystemExit):
        parser(label=False).parse_args(["--label", "x"])
