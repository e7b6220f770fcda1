"""`llm-gateway serve` as a process: layered settings, clean shutdown, no leftovers, start failures."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from tests.conftest import (
    MODEL_DIR,
    ROOT,
    ServerProcess,
    descendants,
    running,
    seed_vllm_cache,
    start_gateway,
    wait_for_engine_core,
    wait_ready,
)


def new_private_state() -> Path:
    """A state dir of its own (so leftovers are attributable), sharing the prepared model.

    Short on purpose: engine socket paths must fit in 107 bytes.
    """
    state = Path(tempfile.mkdtemp(prefix="gw-", dir="/tmp"))
    (state / "models").mkdir(parents=True)
    (state / "models" / "smollm2-135m-instruct").symlink_to(MODEL_DIR)
    seed_vllm_cache(state / "cache" / "vllm")
    return state


@pytest.fixture
def private_state(model_dir: Path) -> Iterator[Path]:
    state = new_private_state()
    yield state
    shutil.rmtree(state, ignore_errors=True)


@dataclass
class Launched:
    server: ServerProcess  # launched, maybe not ready yet: the test waits for it
    state: Path  # its private state dir


@pytest.fixture(scope="module")
def launched(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Launched]]:
    """The gateways of the two shutdown tests below, launched together (two engine starts at once
    take little longer than one on 2 cores): `layers` as `llm-gateway serve` without --config and
    with CLI and environment overrides, `ctrl-c` leading its own process group as a shell job."""
    tmp = tmp_path_factory.mktemp("lifecycle")
    states = {name: new_private_state() for name in ("layers", "ctrl-c")}
    servers: dict[str, ServerProcess] = {}
    try:
        (tmp / "layers").mkdir()
        servers["layers"] = start_gateway(
            tmp / "layers", config=None, wait=False,
            extra_args=["--state-dir", str(states["layers"]), "--served-model-name", "from-cli"],
            env={"LLM_GATEWAY_ENGINE__SERVED_MODEL_NAME": "from-env", "LLM_GATEWAY_ENGINE__MAX_MODEL_LEN": "1024"},
        )
        (tmp / "ctrl-c").mkdir()
        servers["ctrl-c"] = start_gateway(tmp / "ctrl-c", extra_args=["--state-dir", str(states["ctrl-c"])],
                                          own_process_group=True, wait=False)
        yield {name: Launched(server, states[name]) for name, server in servers.items()}
    finally:
        for server in servers.values():
            if server.proc.poll() is None:
                server.stop()
        for state in states.values():
            shutil.rmtree(state, ignore_errors=True)


def test_layers_shutdown_and_no_leftovers(launched: dict[str, Launched]) -> None:
    """Also `llm-gateway serve` without --config: on a machine without a GPU that is the embedded
    CPU profile (as `make serve`), whose max_model_len 4096 the environment then overrides."""
    server, private_state = launched["layers"].server, launched["layers"].state
    try:
        wait_ready(server)
        models = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]
        assert models[0]["id"] == "from-cli"  # CLI beats env
        assert models[0]["max_model_len"] == 1024  # env beats the file's 4096
        r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                       json={"model": "from-cli", "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200
        children = descendants(server.proc.pid)
        assert children, "vLLM runs its engine core in child processes"
        names = [psutil.Process(pid).name() for pid in children if psutil.pid_exists(pid)]
        # The CPU profile keeps vLLM's worker inside the engine-core process: one spawned vLLM
        # process per engine, not two (each imports torch and vLLM again).
        assert any("EngineCor" in n for n in names) and not any("Worker" in n for n in names), names
        sockets = list((private_state / "run").rglob("*"))
        assert any(p.is_socket() for p in sockets)
    finally:
        code = server.stop(signal.SIGTERM, timeout=60)
    log = server.log()
    assert code == 0, log[-3000:]
    assert f"on http://127.0.0.1:{server.port}" in log
    assert "effective profile" in log
    time.sleep(1)
    assert not [pid for pid in children if running(pid)]
    assert list((private_state / "run").iterdir()) == []
    # A clean stop logs no error: vLLM's output handler used to log EngineDeadError with a
    # traceback when the engine core stopped under it (issue: at every Ctrl-C / systemctl stop).
    assert error_lines(log) == []
    assert "EngineDeadError" not in log


def assert_all_exit(pids: list[int], timeout: float = 15.0) -> None:
    """The processes end (zombies count as ended) within `timeout`."""
    deadline = time.monotonic() + timeout
    alive = pids
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if running(pid)]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"still running {timeout} s after the gateway exited: "
                         f"{[(pid, psutil.Process(pid).name()) for pid in alive if psutil.pid_exists(pid)]}")


def error_lines(log: str) -> list[str]:
    return re.findall(r"^.*(?:\bERROR\b|Traceback).*$", log, re.MULTILINE)


def test_ctrl_c_stops_the_gateway_then_its_engine_cleanly(launched: dict[str, Launched]) -> None:
    """Ctrl-C in a terminal signals the whole foreground process group. It used to reach vLLM's
    engine processes too, which then stopped on their own before the gateway stopped them, with
    an error and a traceback (at every Ctrl-C of `make serve` from the output handler; on vLLM
    0.26 also from the engine core when its worker exited first). The engine processes now lead
    their own process group: the stop is the gateway's ordered one, with no error line."""
    server = launched["ctrl-c"].server
    try:
        wait_ready(server)
        r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 8})
        assert r.status_code == 200
        children = descendants(server.proc.pid)
        engine = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                  if "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's helper
        assert engine and all(os.getpgid(p.pid) != os.getpgid(server.proc.pid) for p in engine), engine
        os.killpg(server.proc.pid, signal.SIGINT)
        code = server.proc.wait(60)
    finally:
        server.stop()
    log = server.log()
    assert code == 0, log[-3000:]
    assert error_lines(log) == [], log[-3000:]
    assert "stopped (drained=True" in log
    assert "engine process(es) still running" not in log  # the ordered engine stop ended them all
    assert_all_exit(children)


@pytest.mark.timing
def test_sigterm_while_the_engine_starts(tmp_path: Path, private_state: Path) -> None:
    """`systemctl stop` during the first engine start: exit 0 within seconds, no engine process
    left, instead of waiting for a start that can take minutes on a GPU."""
    server = start_gateway(tmp_path, extra_args=["--state-dir", str(private_state)], wait=False)
    try:
        deadline = time.monotonic() + 120
        while "starting vLLM" not in server.log() and time.monotonic() < deadline:
            assert server.proc.poll() is None, server.log()[-3000:]
            time.sleep(0.1)
        children = wait_for_engine_core(server.proc.pid)  # the engine is loading
        assert httpx.get(server.base_url + "/ready", timeout=5).status_code == 503
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        took = time.monotonic() - signalled
    finally:
        server.stop()
    log = server.log()
    assert code == 0, log[-3000:]
    assert took < 20, (took, log[-3000:])
    time.sleep(1)
    assert not [pid for pid in children if running(pid)]


def test_missing_model_fails_fast_with_a_hint(tmp_path: Path) -> None:
    empty_state = tmp_path / "empty"
    empty_state.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--config", "configs/embedded-cpu.yaml",
         "--port", "0", "--state-dir", str(empty_state)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "prepare-model" in proc.stderr


def test_invalid_config_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  device: cpu\n  max_num_seqs: 8\n")
    proc = subprocess.run(
        [sys.executable, "-m", "server", "check-config", "--config", str(bad)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "kv_cache_memory_bytes" in proc.stderr
