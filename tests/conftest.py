"""Shared fixtures: a real gateway subprocess on a free loopback port, its reference vLLM server.

Engines take ~30 s to start on 2 CPU cores, so the default gateway is shared by the whole
session; tests that need another configuration start their own with `start_gateway`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import yaml

from server.engine.runtime import ENGINE_PROCESS_ENV, SAME_ANSWERS_ONLY

if TYPE_CHECKING:
    import psutil

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "embedded-cpu.yaml"
STATE_DIR = ROOT / ".state"
MODEL_DIR = STATE_DIR / "models" / "smollm2-135m-instruct"
SERVED_NAME = "smollm2-135m-instruct"
READY_TIMEOUT_S = 420.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")
    parser.addoption("--timing-rounds", type=int, default=1, metavar="N",
                     help="run each test marked `timing` N times in a row (make test-timing ROUNDS=N, under load)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """With --timing-rounds N, every `timing` test runs N times in a row on the same fixtures: a
    wall-clock bound must hold every time on a loaded machine, not once."""
    rounds = metafunc.config.getoption("--timing-rounds")
    if rounds > 1 and metafunc.definition.get_closest_marker("timing") is not None:
        metafunc.fixturenames.append("timing_round")
        metafunc.parametrize("timing_round", range(1, rounds + 1), ids=lambda n: f"round{n}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--run-slow"):
        skip = pytest.mark.skip(reason="slow test: run with `make test-slow`")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    if not Path("/dev/nvidiactl").exists():
        skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device machine)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.25):  # type: ignore[no-untyped-def]
    """`predicate()` again every `interval` s until it returns something true or `timeout` s
    passed; returns its last result (falsy on timeout), so the caller's assert says what failed."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(interval)


def running(process: psutil.Process | int) -> bool:
    """The process (or pid) exists and is not a zombie; one that ends while it is looked at is not
    running (no NoSuchProcess escapes, as `pid_exists(p) and Process(p).status()` could raise)."""
    import psutil

    try:
        if isinstance(process, int):
            process = psutil.Process(process)
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def ports_free(*ports: int) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def front_port(replicas: int = 2) -> int:
    """A port p with the next `replicas` ports free too (`serve --replicas`: replica i on p + 1 + i)."""
    for _ in range(50):
        port = free_port()
        if port < 65000 and ports_free(*range(port, port + replicas + 1)):
            return port
    raise RuntimeError(f"no {replicas + 1} free consecutive ports")


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc.pid)
                self.proc.wait(10)
        return self.proc.returncode


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def wait_for_engine_core(pid: int, timeout: float = 120.0, count: int = 1) -> list[int]:
    """The descendants of `pid` once `count` vLLM engine-core processes are among them (2: a
    blue-green reload's new engine beside the serving one)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cores = 0
        for child in descendants(pid):
            try:
                proc = psutil.Process(child)
                if "EngineCor" in proc.name() or "EngineCore" in " ".join(proc.cmdline()):
                    cores += 1
            except psutil.NoSuchProcess:
                pass
        if cores >= count:
            return descendants(pid)
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} vLLM engine-core process(es) under {pid} after {timeout} s")


def engine_core_processes(pid: int, timeout: float = 60.0) -> list:  # list[psutil.Process]
    """vLLM's engine-core process(es) under `pid` (the process a stall test stops)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cores = []
        for child in psutil.Process(pid).children(recursive=True):
            try:
                if "EngineCor" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                    cores.append(child)
            except psutil.NoSuchProcess:
                pass
        if cores:
            return cores
        time.sleep(0.1)
    raise AssertionError(f"no vLLM engine-core process under {pid} after {timeout} s")


def kill_tree(pid: int) -> None:
    import psutil

    for child in descendants(pid):
        try:
            psutil.Process(child).kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_ready(server: ServerProcess, path: str = "/ready", timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-6000:]}")
        try:
            if httpx.get(server.base_url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    kill_tree(server.proc.pid)  # the engine processes too, not just the gateway
    server.proc.wait(10)
    raise TimeoutError(f"server not ready after {timeout} s:\n{server.log()[-6000:]}")


def seed_vllm_cache(cache_root: Path) -> None:
    """Give a fresh vLLM cache root what the shared state dir's already holds about the model's
    class (vLLM's `modelinfos`): without it every engine start inspects the model class again in
    a subprocess of its own, seconds of a start on 2 cores. vLLM checks each entry against its
    own source and inspects again when it does not match (another release)."""
    known = STATE_DIR / "cache" / "vllm" / "modelinfos"
    if known.is_dir():
        shutil.copytree(known, cache_root / "modelinfos", dirs_exist_ok=True)


def start_gateway(
    tmp_dir: Path,
    *,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    config: Path | None = CONFIG,
    wait: bool = True,
    own_process_group: bool = False,
) -> ServerProcess:
    """`llm-gateway serve` as a subprocess on a free port, sharing the prepared model.

    `config=None` passes no --config: the gateway picks the shipped profile for this machine.
    `own_process_group=True` makes it lead a process group (as a shell job is), so a test can
    signal it and its engine processes together, as a terminal's Ctrl-C does.
    """
    port = free_port()
    log_path = tmp_dir / f"gateway-{port}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [
        sys.executable, "-m", "server", "serve",
        *(["--config", str(config)] if config is not None else []),
        "--port", str(port),
        "--state-dir", str(STATE_DIR),
        *(extra_args or []),
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=own_process_group)
    server = ServerProcess(proc, port, log_path)
    if wait:
        wait_ready(server)
    return server


def start_gateway_with_own_config(tmp_dir: Path, engine: dict[str, object] | None = None) -> tuple[ServerProcess, Path]:
    """A gateway on a private copy of the CPU profile, which the test may edit (then SIGHUP);
    `engine` overrides fields of its engine section."""
    config = tmp_dir / "profile.yaml"
    if engine:
        profile = yaml.safe_load(CONFIG.read_text())
        profile["engine"].update(engine)
        config.write_text(yaml.safe_dump(profile))
    else:
        shutil.copy(CONFIG, config)
    return start_gateway(tmp_dir, config=config), config


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.fail("the embedded model is missing: run `make test` (it runs prepare-model first)")
    return MODEL_DIR


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class _Running:
    """A server started outside the test run (LLM_GATEWAY_TEST_URL / ..._VLLM_URL, for development)."""

    def __init__(self, url: str) -> None:
        self.base_url = url.rstrip("/")

    def stop(self) -> int:
        return 0


@pytest.fixture(scope="session")
def gateway(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    if url := os.environ.get("LLM_GATEWAY_TEST_URL"):
        yield _Running(url)  # type: ignore[misc]
        return
    server = start_gateway(tmp_path_factory.mktemp("gateway"))
    yield server
    server.stop()


def launch_vllm_reference(model_dir: Path, tmp: Path) -> ServerProcess:
    """vLLM's own OpenAI server on the same model and engine settings as configs/embedded-cpu.yaml,
    started (not yet ready) with its cache, sockets and temp files under `tmp`."""
    import yaml

    profile = yaml.safe_load(CONFIG.read_text())["engine"]
    for sub in ("cache", "run", "tmp"):
        (tmp / sub).mkdir()
    seed_vllm_cache(tmp / "cache")
    port = free_port()
    log_path = tmp / "vllm.log"
    env = {
        **os.environ,
        **{k: str(v) for k, v in profile.get("env", {}).items()},
        "PYTHONUNBUFFERED": "1",
        "VLLM_CACHE_ROOT": str(tmp / "cache"),
        "VLLM_RPC_BASE_PATH": str(tmp / "run"),
        "TMPDIR": str(tmp / "tmp"),
        # Starts and ranks logprobs as fast as the gateway's engine (vLLM 0.26's CPU runner would
        # otherwise run a 4096-token dummy forward that compiles nothing, a minute of both cores
        # under the tests it overlaps, and each version compiles the rank count at the first
        # logprobs request) and answers as vLLM alone: not the gateway's eager sampler.
        ENGINE_PROCESS_ENV: SAME_ANSWERS_ONLY,
    }
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model_dir),
        "--served-model-name", profile["served_model_name"],
        "--dtype", profile["dtype"],
        "--max-model-len", str(profile["max_model_len"]),
        "--kv-cache-memory-bytes", str(profile["kv_cache_memory_bytes"]),
        "--max-num-seqs", str(profile["max_num_seqs"]),
        "--max-num-batched-tokens", str(profile["max_num_batched_tokens"]),
        "--seed", str(profile["seed"]),
        "--disable-uvicorn-access-log",
    ]
    if profile.get("chat_template"):  # the profile's tool-aware template, as the gateway renders it
        cmd += ["--chat-template", str(ROOT / "server" / "templates" / profile["chat_template"])]
    if profile.get("tool_call_parser"):
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", profile["tool_call_parser"]]
    if profile.get("reasoning_parser"):  # the reference splits reasoning as the gateway does
        cmd += ["--reasoning-parser", profile["reasoning_parser"]]
    if profile.get("enforce_eager"):
        cmd.append("--enforce-eager")
    if profile.get("enable_prefix_caching") is False:
        cmd.append("--no-enable-prefix-caching")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, env=env)
    return ServerProcess(proc, port, log_path)


@dataclass
class _EarlyReference:
    """The reference server, launched when the first integration test starts if a parity test
    will need it, so its start (the longest of the session's: ~45 s on vLLM 0.26 here) overlaps
    the tests before the parity modules instead of adding to them. Not during tests/e2e, which
    already runs up to four engines at once (about 4 GB each)."""

    wanted: bool = False
    server: ServerProcess | None = None
    tmp: Path | None = None


_early_reference = _EarlyReference()


def pytest_collection_finish(session: pytest.Session) -> None:
    _early_reference.wanted = not os.environ.get("LLM_GATEWAY_TEST_VLLM_URL") and any(
        "vllm_reference" in getattr(item, "fixturenames", ()) for item in session.items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    early = _early_reference
    if early.wanted and early.server is None and item.nodeid.startswith("tests/integration/") \
            and MODEL_DIR.joinpath("config.json").is_file():
        early.tmp = item.config._tmp_path_factory.mktemp("vllm-reference")  # type: ignore[attr-defined]
        early.server = launch_vllm_reference(MODEL_DIR, early.tmp)


def pytest_sessionfinish(session: pytest.Session) -> None:
    server = _early_reference.server  # launched, but no test took it (a failed session)
    if server is not None and server.proc.poll() is None:
        kill_tree(server.proc.pid)
        server.proc.wait(30)


@pytest.fixture(scope="session")
def vllm_reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """vLLM's own OpenAI server on the same model and engine settings as configs/embedded-cpu.yaml
    (launched early, see `_EarlyReference`)."""
    if url := os.environ.get("LLM_GATEWAY_TEST_VLLM_URL"):
        yield _Running(url)  # type: ignore[misc]
        return
    early = _early_reference
    if early.server is not None and early.tmp is not None:
        server, tmp = early.server, early.tmp
    else:
        tmp = tmp_path_factory.mktemp("vllm-reference")
        server = launch_vllm_reference(model_dir, tmp)
    early.server = None
    wait_ready(server, path="/health")
    yield server
    server.stop()
    shutil.rmtree(tmp / "run", ignore_errors=True)
