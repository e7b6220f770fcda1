"""In-place weight reloads on the real vLLM CPU engine: a swap under load, refusals, rollback, SIGHUP.

Two versions of the embedded model (`prepare-model --second-version`): the swap must lose no
request, keep the one in flight, read the new files before it pauses, pause generation for at most
`MAX_PAUSE_S`, and afterwards answer exactly as a fresh gateway started on the new weights does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from server.lifecycle.weights import read_model_files
from server.model_prep import write_second_version
from tests.conftest import CONFIG, STATE_DIR, ServerProcess, start_gateway, start_gateway_with_own_config
from tests.integration.test_reload import metric, status
from tests.load import LOAD_CLIENTS, Load

PROMPT = {"prompt": "The three most useful kitchen tools are", "max_tokens": 24, "temperature": 0}
# The pause is the engine's stop (the step in progress) plus the weight load, which on the CPU is
# CPU work: the copy into the model and a new oneDNN handle for every linear layer. vLLM 0.26, 38
# in-place swaps beside `stress-ng --cpu 2`: the stop 0.02-1.7 s (up to 9 requests kept), the load
# 1.0-2.7 s, the pause 1.0-4.4 s; on 2 quiet cores the load takes 0.4-1.1 s. The bound is about twice
# the slowest pause seen under that load (shared CI machines have run twice as slow) and keeps the
# point of in-place: a drain-swap waits 16-21 s for a new engine on 2 quiet cores.
MAX_PAUSE_S = 8.0


@pytest.fixture(scope="module")
def versions(model_dir: Path) -> tuple[Path, Path]:
    return model_dir, write_second_version(STATE_DIR)


@pytest.fixture(scope="module")
def gateway(versions: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    server, config = start_gateway_with_own_config(tmp_path_factory.mktemp("in-place"))
    yield server, config
    assert server.stop() == 0
    # vLLM's worker logs the traceback of the load that the rollback test fails on purpose.
    gateway_lines = [line for line in server.log().splitlines() if not line.startswith(("(Worker", "(EngineCore"))]
    assert not any("Traceback" in line for line in gateway_lines)


def greedy(server: ServerProcess) -> str:
    r = httpx.post(server.base_url + "/v1/completions", json=PROMPT, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def reload_to(server: ServerProcess, model: Path, **reload: object) -> httpx.Response:
    return httpx.post(server.base_url + "/admin/reload", timeout=300, json={
        "engine": {"model": str(model)}, "reload": {"strategy": "in-place", **reload}})


def variant(tmp: Path, source: Path, name: str, *, config: dict | None = None,
            truncate_weights: bool = False, drop_weights: bool = False) -> Path:
    """A copy of `source` (weights linked, not copied) with one thing changed."""
    d = tmp / name
    d.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
        elif truncate_weights:  # the header intact, the data cut short: an interrupted copy
            with f.open("rb") as src:
                (length,) = struct.unpack("<Q", src.read(8))
                src.seek(0)
                (d / f.name).write_bytes(src.read(8 + length + 4096))
        elif not drop_weights:
            os.symlink(f, d / f.name)
    if config is not None:
        (d / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), **config}))
    return d


def test_refusals_name_the_difference_and_change_nothing(gateway: tuple[ServerProcess, Path],
                                                          versions: tuple[Path, Path], tmp_path: Path) -> None:
    server, _ = gateway
    v1, _ = versions
    before, answer = status(server)["weights"], greedy(server)
    cases = [
        (variant(tmp_path, v1, "deeper", config={"num_hidden_layers": 31}), "config.json num_hidden_layers: 30 -> 31"),
        (variant(tmp_path, v1, "no-weights", drop_weights=True), "no *.safetensors files"),
        (tmp_path / "missing", "no model at"),
    ]
    for model, expected in cases:
        r = reload_to(server, model)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert expected in error["message"] and error["type"] == "BadRequestError", error
    r = httpx.post(server.base_url + "/admin/reload", timeout=60, json={
        "engine": {"model": str(v1), "max_num_seqs": 8}, "reload": {"strategy": "in-place"}})
    assert r.status_code == 400 and "engine.max_num_seqs: 64 -> 8" in r.json()["error"]["message"]
    assert "drain-swap or blue-green" in r.json()["error"]["message"]
    assert status(server)["weights"] == before and status(server)["state"] == "serving"
    assert greedy(server) == answer


def test_a_failing_load_rolls_back_to_the_previous_weights(gateway: tuple[ServerProcess, Path],
                                                            versions: tuple[Path, Path], tmp_path: Path) -> None:
    server, _ = gateway
    v1, _ = versions
    before, answer = status(server)["weights"], greedy(server)
    broken = variant(tmp_path, v1, "truncated", truncate_weights=True)
    r = reload_to(server, broken)
    assert r.status_code == 422, r.text
    result = r.json()["reload"]
    assert result["outcome"] == "rolled_back" and result["strategy"] == "in-place", result
    assert str(broken) in result["error"]
    assert status(server)["weights"] == before and status(server)["state"] == "serving"
    assert greedy(server) == answer  # the previous weights again, byte for byte the same answer
    assert "loading the previous weights" in server.log()
    assert metric(server, 'gateway_engine_reloads_total{outcome="rolled_back"}') >= 1


@pytest.mark.timing
def test_swap_under_load_loses_nothing_and_answers_as_a_fresh_gateway(
        gateway: tuple[ServerProcess, Path], versions: tuple[Path, Path], tmp_path: Path) -> None:
    server, _ = gateway
    v1, v2 = versions
    if status(server)["weights"] != read_model_files(v1).identity():  # a round of make test-timing left v2
        assert reload_to(server, v1).status_code == 200
    old_answer = greedy(server)
    long_stream: dict[str, object] = {}

    def in_flight() -> None:
        body = {"prompt": "Write a long story about a lighthouse.", "max_tokens": 160, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=600) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        long_stream.update(status=r.status_code, done=events[-1] == "[DONE]",
                           errors=[c for c in chunks if "error" in c],
                           finish=[c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1],
                           tokens=chunks[-1]["usage"]["completion_tokens"])

    log_before = len(server.log())
    with Load(server.base_url) as load:
        worker = threading.Thread(target=in_flight)
        worker.start()
        time.sleep(4)
        r = reload_to(server, v2)
        time.sleep(3)
    worker.join(600)
    assert r.status_code == 200, r.text
    result = r.json()
    print(f"\nin-place: paused {result['pause_s']:.3f} s, reload {result['duration_s']:.2f} s, kept "
          f"{result['kept']}, queued {result['queued']}, load ok={load.result.ok}")
    assert result["outcome"] == "success" and result["strategy"] == "in-place"
    assert result["pause_s"] <= MAX_PAUSE_S
    reload_log = server.log()[log_before:]
    assert "before pausing" in reload_log and "no prefetch" not in reload_log  # the files were read beforehand
    assert result["kept"] >= 1  # at least the long stream was in flight across the swap
    assert load.result.failures == [] and load.result.ok >= LOAD_CLIENTS
    assert long_stream == {"status": 200, "done": True, "errors": [], "finish": "length", "tokens": 160}

    v2_files = read_model_files(v2)
    assert status(server)["weights"] == v2_files.identity()
    assert status(server)["last_reload"]["pause_s"] == result["pause_s"]
    assert metric(server, "gateway_engine_reload_pause_seconds_count") >= 1
    assert f'weights_fingerprint="{v2_files.fingerprint}"' in httpx.get(server.base_url + "/metrics").text
    assert f"weights={v2_files.fingerprint}" in server.log()  # access lines say which version answered
    new_answer = greedy(server)
    assert new_answer != old_answer, "the second version must answer differently, or the swap proves nothing"

    fresh = gateway_on(tmp_path, v2)
    try:
        assert greedy(fresh) == new_answer
    finally:
        assert fresh.stop() == 0


@pytest.mark.timing
def test_sighup_swaps_back_in_place(gateway: tuple[ServerProcess, Path], versions: tuple[Path, Path]) -> None:
    server, config = gateway
    v1, v2 = versions
    if status(server)["weights"] != read_model_files(v2).identity():  # a round of make test-timing left v1
        assert reload_to(server, v2).status_code == 200
    profile = yaml.safe_load(config.read_text())
    profile["engine"]["model"] = str(v1)
    profile.setdefault("reload", {})["strategy"] = "in-place"
    config.write_text(yaml.safe_dump(profile))
    reloads = metric(server, 'gateway_engine_reloads_total{outcome="success"}')
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 120
    while metric(server, 'gateway_engine_reloads_total{outcome="success"}') == reloads:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.5)
    last = status(server)["last_reload"]
    assert last["strategy"] == "in-place" and last["pause_s"] <= MAX_PAUSE_S
    assert status(server)["weights"] == read_model_files(v1).identity()


def gateway_on(tmp: Path, model: Path) -> ServerProcess:
    """A fresh gateway with the shipped CPU profile, started on `model`."""
    config = tmp / "fresh.yaml"
    profile = yaml.safe_load(CONFIG.read_text())
    profile["engine"]["model"] = str(model)
    config.write_text(yaml.safe_dump(profile))
    return start_gateway(tmp, config=config)
