"""benchmarks/lib/pyspy.py on a hand-made collapsed-stack file (py-spy --format raw --threads), and
the summary tool that prints it (`python -m benchmarks.experiments.pyspy_summary`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.lib import pyspy

ROOT = Path(__file__).resolve().parents[2]

LOOP = ("thread (100): MainThread;<module> (server/__main__.py:5);run (asyncio/runners.py:190);"
        "BaseEventLoop._run_once (asyncio/base_events.py:1922)")
COLLAPSED = "\n".join([
    f"{LOOP};EpollSelector.select (selectors.py:468) 40",  # the loop waiting: headroom
    f"{LOOP};Handle._run (asyncio/events.py:80);OutputProcessor.process_outputs "
    f"(vllm/v1/engine/output_processor.py:500);IncrementalDetokenizer.update (vllm/v1/engine/detokenizer.py:120) 20",
    f"{LOOP};Handle._run (asyncio/events.py:80);OutputProcessor.process_outputs "
    f"(vllm/v1/engine/output_processor.py:510) 10",
    f"{LOOP};Handle._run (asyncio/events.py:80);stream (server/serving/completions.py:300);"
    f"BaseModel.model_dump_json (pydantic/main.py:400) 15",
    f"{LOOP};Handle._run (asyncio/events.py:80);stream (server/serving/completions.py:310) 5",
    f"{LOOP};Handle._run (asyncio/events.py:80);send (uvicorn/protocols/http/httptools_impl.py:500) 8",
    # uvloop: the loop in C has no Python frame, so `Runner.run` is the leaf while it waits in epoll
    "thread (100): MainThread;<module> (server/__main__.py:5);run (uvloop/__init__.py:92);Runner.run "
    "(asyncio/runners.py:118) 10",
    "thread (102): ThreadPoolExecutor-0_0;Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:81) 30",
    "thread (101): gateway-tokenize_0;Thread.run (threading.py:982);encode (tokenizers/__init__.py:10) 2",
    "not a stack line",
])


def test_summary_counts_self_inclusive_groups_and_threads(tmp_path: Path) -> None:
    prof = pyspy.parse(COLLAPSED)
    assert prof.total == 140 and prof.skipped_lines == 1
    assert prof.threads["thread (100): MainThread"] == 108 and prof.thread_idle["thread (100): MainThread"] == 50
    assert prof.thread_idle["thread (102): ThreadPoolExecutor-0_0"] == 30  # an idle pool worker waits
    # line numbers are dropped: the two process_outputs lines are one function
    assert prof.self_fn["OutputProcessor.process_outputs (vllm/v1/engine/output_processor.py)"] == 10
    assert prof.incl_fn["OutputProcessor.process_outputs (vllm/v1/engine/output_processor.py)"] == 30
    assert prof.self_fn["stream (server/serving/completions.py)"] == 5
    assert prof.incl_fn["stream (server/serving/completions.py)"] == 20
    assert prof.incl_fn["BaseEventLoop._run_once (asyncio/base_events.py)"] == 98  # once per stack
    assert prof.self_group[pyspy.WAITING] == 80
    assert prof.self_group["tokenizer / detokenizer"] == 22 and prof.self_group["vllm output processor"] == 10
    assert prof.self_group["pydantic"] == 15 and prof.self_group["gateway code"] == 5
    assert prof.self_group["uvicorn"] == 8
    assert prof.incl_group["gateway code"] == 108 and prof.incl_group["asyncio"] == 108
    assert pyspy.group_of("send (uvicorn/server.py:1)") == "uvicorn"  # not the gateway's server/

    text = pyspy.report(prof, top=3, window_samples=100)
    assert "samples: 140 (80 waiting: selector, uvloop in C, idle pool threads; 60 busy)" in text
    assert "MainThread  [busy 58% of the window]" in text  # (108 - 50) / 100
    assert "ThreadPoolExecutor-0_0  [busy 0% of the window]" in text
    assert "top 3 functions by self samples" in text
    self_rows = text.split("by self samples")[1].split("==")[0].strip().splitlines()[1:]
    assert "EpollSelector.select" in self_rows[0] and "_worker" in self_rows[1]
    assert "IncrementalDetokenizer.update" in self_rows[2] and "33.3%" in self_rows[2]  # 20 of 60 busy

    only_main = pyspy.parse(COLLAPSED, "MainThread")
    assert only_main.total == 108 and len(only_main.threads) == 1

    out, ss = tmp_path / "s.txt", tmp_path / "s.json"
    (tmp_path / "c.txt").write_text(COLLAPSED)
    run = subprocess.run([sys.executable, "-m", "benchmarks.experiments.pyspy_summary", str(tmp_path / "c.txt"),
                          "--top", "5", "--out", str(out), "--speedscope", str(ss), "--rate", "100", "--duration-s", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "MainThread only" in out.read_text()
    doc = json.loads(ss.read_text())
    assert [p["name"] for p in doc["profiles"]] == ["thread (100): MainThread", "thread (102): ThreadPoolExecutor-0_0",
                                                   "thread (101): gateway-tokenize_0"]
    main_profile = doc["profiles"][0]
    assert main_profile["endValue"] == 108 and len(main_profile["samples"]) == len(main_profile["weights"]) == 7
    frames = doc["shared"]["frames"]
    assert frames[main_profile["samples"][0][-1]] == {"name": "EpollSelector.select", "file": "selectors.py",
                                                      "line": 468}
