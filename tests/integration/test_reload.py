"""Hot reload on real vLLM CPU engines under load: both strategies, SIGHUP, rollback, 409."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import CONFIG, ROOT, ServerProcess, running, start_gateway, start_gateway_with_own_config
from tests.load import LOAD_CLIENTS, Load


@pytest.fixture(scope="module")
def reloadable(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    server, config = start_gateway_with_own_config(tmp_path_factory.mktemp("reload"))
    yield server, config
    assert server.stop() == 0


def models(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]


def status(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/admin/status", timeout=10).json()


def metric(server: ServerProcess, sample: str) -> float:
    """The value of one exposed sample, e.g. 'gateway_engine_reloads_total{outcome="success"}'."""
    for line in httpx.get(server.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_reloading(server: ServerProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not status(server)["reloading"]:
        assert time.monotonic() < deadline, "the reload never started"
        time.sleep(0.1)


@pytest.mark.parametrize("strategy,name,max_len,trigger", [("drain-swap", "renamed-a", 2048, "sighup"),
                                                           ("blue-green", "renamed-b", 3072, "admin")])
def test_reload_under_load_loses_nothing(reloadable: tuple[ServerProcess, Path], strategy: str, name: str,
                                         max_len: int, trigger: str) -> None:
    """A reload under 8 clients loses no request, and a second reload while it runs gets 409.
    drain-swap is started as `systemctl reload` does (the config file changed, then SIGHUP),
    blue-green by POST /admin/reload with overrides."""
    server, config = reloadable
    before = status(server)["last_reload"]
    refrozen = server.log().count("heap frozen again after the reload")
    with Load(server.base_url) as load:
        time.sleep(3)
        t0 = time.monotonic()
        box: dict[str, httpx.Response] = {}
        if trigger == "sighup":
            profile = yaml.safe_load(config.read_text())
            profile["engine"].update(served_model_name=name, max_model_len=max_len)
            profile["reload"] = {"strategy": strategy}
            config.write_text(yaml.safe_dump(profile))
            server.proc.send_signal(signal.SIGHUP)
        else:
            first = threading.Thread(target=lambda: box.setdefault("r", httpx.post(
                server.base_url + "/admin/reload", timeout=600,
                json={"reload": {"strategy": strategy}, "engine": {"served_model_name": name, "max_model_len": max_len}})))
            first.start()
        wait_reloading(server)
        second = httpx.post(server.base_url + "/admin/reload", timeout=60, json={"engine": {"served_model_name": "second"}})
        if trigger == "sighup":
            deadline = time.monotonic() + 600
            while status(server)["reloading"] or status(server)["last_reload"] == before:
                assert time.monotonic() < deadline, "the SIGHUP reload never finished"
                time.sleep(0.2)
            result = status(server)["last_reload"]
        else:
            first.join(600)
            assert box["r"].status_code == 200, box["r"].text
            result = box["r"].json()
        took = time.monotonic() - t0
        time.sleep(3)
    print(f"\n{strategy} ({trigger}): reload {result['duration_s']:.1f} s (seen {took:.1f} s), queued {result['queued']}, "
          f"longest queue wait {result['max_queue_wait_s']:.1f} s, load ok={load.result.ok}")
    assert second.status_code == 409 and second.json()["error"]["type"] == "ConflictError", second.text
    assert result["outcome"] == "success" and result["strategy"] == strategy
    assert load.result.failures == []
    assert load.result.ok >= LOAD_CLIENTS
    assert name in load.result.models  # requests after the switch were served by the new engine
    assert models(server)["id"] == name and models(server)["max_model_len"] == max_len
    assert status(server)["last_reload"]["outcome"] == "success"
    if strategy == "blue-green":
        assert result["queued"] == 0
    # the refreeze's full collection waited for a moment with no request in flight (the load ended)
    deadline = time.monotonic() + 30
    while server.log().count("heap frozen again after the reload") == refrozen and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = [line for line in server.log().splitlines() if "heap frozen again after the reload" in line]
    assert len(lines) == refrozen + 1 and "no request in flight" in lines[-1], lines
    print(lines[-1].split("INFO")[-1].strip())


def test_invalid_config_is_refused_and_nothing_changes(reloadable: tuple[ServerProcess, Path]) -> None:
    server, _ = reloadable
    before = models(server)["id"]
    r = httpx.post(server.base_url + "/admin/reload", timeout=60, json={"engine": {"model": "/nonexistent/model"}})
    assert r.status_code == 400 and "engine.model" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/admin/reload", timeout=60, json={"engine": {"max_num_seqs": 0}})
    assert r.status_code == 400 and "max_num_seqs" in r.json()["error"]["message"]
    for path, why in (("/proc/self/environ", "not valid YAML"), ("/", "not a regular file"),
                      (str(ROOT / "pyproject.toml"), "not valid YAML"), (str(ROOT / "Makefile"), "not valid YAML"),
                      ("/nonexistent.yaml", "not found")):
        r = httpx.post(server.base_url + "/admin/reload", timeout=60, json={"config": path})
        assert r.status_code == 400 and why in r.json()["error"]["message"], (path, r.text)
    assert models(server)["id"] == before
    assert httpx.get(server.base_url + "/ready").status_code == 200


def test_engine_that_fails_to_start_rolls_back(reloadable: tuple[ServerProcess, Path]) -> None:
    server, _ = reloadable
    before = models(server)["id"]
    rolled_back = metric(server, 'gateway_engine_reloads_total{outcome="rolled_back"}')
    # Valid settings that vLLM refuses at start: a KV cache too small for one sequence.
    r = httpx.post(server.base_url + "/admin/reload", timeout=600, json={
        "reload": {"strategy": "blue-green"}, "engine": {"served_model_name": "never", "kv_cache_memory_bytes": 4096}})
    assert r.status_code == 422, r.text
    assert r.json()["reload"]["outcome"] == "rolled_back"
    assert models(server)["id"] == before
    assert status(server)["last_reload"]["outcome"] == "rolled_back"
    assert metric(server, 'gateway_engine_reloads_total{outcome="rolled_back"}') == rolled_back + 1
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


@pytest.mark.timing
@pytest.mark.parametrize("strategy", ["blue-green", "drain-swap"])
def test_sigterm_while_a_reload_starts_an_engine(request: pytest.FixtureRequest, tmp_path: Path, strategy: str) -> None:
    """SIGTERM while a reload is starting the new engine: the reload answers 503 at once, a request
    queued behind it gets 503, the process exits 0 within seconds and leaves no engine process.
    The drain-swap variant runs last in the module and ends the module's gateway; the blue-green
    one starts a gateway of its own."""
    import psutil

    from tests.conftest import descendants, wait_for_engine_core

    server = request.getfixturevalue("reloadable")[0] if strategy == "drain-swap" else None
    if server is None or server.proc.poll() is not None:  # blue-green, or a later round of make test-timing
        server = start_gateway(tmp_path, config=CONFIG)
    assert server.proc.poll() is None and server.log().count("starting vLLM") >= 1
    starts_before = server.log().count("starting vLLM")
    try:
        box: dict[str, httpx.Response] = {}

        def reload() -> None:
            box["reload"] = httpx.post(server.base_url + "/admin/reload", timeout=300, json={
                "reload": {"strategy": strategy}, "engine": {"served_model_name": "never-served"}})

        worker = threading.Thread(target=reload)
        worker.start()
        deadline = time.monotonic() + 120
        while server.log().count("starting vLLM") < starts_before + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.log().count("starting vLLM") == starts_before + 1, server.log()[-3000:]
        # The new engine is loading: beside the serving one (blue-green), or alone (drain-swap).
        wait_for_engine_core(server.proc.pid, count=2 if strategy == "blue-green" else 1)
        queued: dict[str, httpx.Response] = {}
        late = threading.Thread(target=lambda: queued.setdefault("r", httpx.post(
            server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)))
        if strategy == "drain-swap":
            late.start()  # waits in the reload queue
            queue_deadline = time.monotonic() + 60
            while status(server)["queued"] < 1:  # a bare sleep lost the race on a loaded machine
                assert time.monotonic() < queue_deadline, "the late request never reached the reload queue"
                time.sleep(0.1)
        children = descendants(server.proc.pid)
        assert children, "the engine processes should be running"
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        took = time.monotonic() - signalled
        worker.join(10)
        if strategy == "drain-swap":
            late.join(10)
            assert queued["r"].status_code == 503, queued["r"].text
            assert queued["r"].headers.get("retry-after")
        print(f"\n{strategy}: exited {code} {took:.1f} s after SIGTERM")
        assert code == 0, server.log()[-4000:]
        assert took < 30, server.log()[-4000:]
        answer = box["reload"]
        assert answer.status_code == 503, answer.text
        assert "shutting down" in answer.json()["error"]["message"]
        time.sleep(1)
        left = [p for p in children if running(p)]
        assert not left, [psutil.Process(p).cmdline() for p in left]
        assert "an engine was still starting" in server.log()
    finally:
        server.stop()
