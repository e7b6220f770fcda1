"""`llm-gateway serve --replicas 2` (`make serve REPLICAS=2`, server/replicas/): two real gateways on
the real vLLM CPU engine behind real nginx on one port. Requests through the front reach both; the
front's /ready counts the ready replicas and its /metrics merges theirs; a tenant's limit holds across
both (a private redis-server); a replica killed under load loses no request (nginx retries what it had
sent there on the other one), /ready says one is left, and it is started again; SIGTERM drains
everything and leaves no process behind. A stalled replica is not staged here: its gateway exits
3 (tests/integration/test_stall.py), nginx resends its plain requests (tests/e2e/test_nginx.py's
stalled instance), and the supervisor restarts a replica whatever its exit code (the kill here).
SIGHUP after a profile change rolls a reload over the replicas, one engine swap at a time, under
load: no request fails, none waits for a new engine (nginx resends what a reloading replica
refuses), and the front's /ready counts the swapping replica out meanwhile. Under
systemd the supervisor is the main process: it alone sends sd_notify (READY once nginx serves,
RELOADING around the roll, STOPPING, watchdog pings)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml
from prometheus_client.parser import text_string_to_metric_families

from server.replicas import front
from server.settings.keys_file import hashed
from server.replicas.supervisor import child_argv
from tests.conftest import CONFIG, ROOT, STATE_DIR, SERVED_NAME, front_port, running, wait_for
from tests.e2e.conftest import NotifyListener, nginx_binary
from tests.load import Load

COMPLETIONS = "/v1/completions"
LOAD_KEY, METERED_KEY, ADMIN_KEY = "sk-load", "sk-metered", "sk-admin"
METERED_RPM = 4
KEYS = [{"name": "load", "key": hashed(LOAD_KEY)},
        {"name": "metered", "key": hashed(METERED_KEY), "requests_per_minute": METERED_RPM}]
LOAD = {"Authorization": f"Bearer {LOAD_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def served(port: int, tenant: str | None = None) -> float:
    """Completions answered by the gateway on `port` (200 or not), of one tenant or all."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    if tenant is not None:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("gateway_tenant_requests_total{") and f'tenant="{tenant}"' in line)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gateway_requests_total{") and f'route="{COMPLETIONS}"' in line)


def complete(client: httpx.Client, base: str, prompt: str, max_tokens: int = 4,
             headers: dict[str, str] = LOAD) -> httpx.Response:
    return client.post(base + COMPLETIONS, json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens},
                       headers=headers, timeout=120)


def test_child_arguments_drop_the_front_and_bind_loopback() -> None:
    argv = ["--config", "c.yaml", "--replicas", "2", "--host=0.0.0.0", "--port", "9000", "--no-client-limits",
            "--log-level", "debug"]
    assert child_argv(argv, 9001) == ["serve", "--config", "c.yaml", "--log-level", "debug",
                                      "--host", "127.0.0.1", "--port", "9001", "--replicas", "1"]


def test_the_site_without_client_limits_passes_nginx_t(tmp_path: Path) -> None:
    conf = front.write_front(tmp_path, upstreams=[9001, 9002], listen="127.0.0.1:9000", client_limits=False,
                             ready_dir=tmp_path, metrics_port=9100)
    text = (tmp_path / "llm-gateway.conf").read_text()
    assert "zone $binary_remote_addr" not in text and text.count("server 127.0.0.1:900") == 2
    snippet = (tmp_path / "llm-gateway-proxy.conf").read_text()
    assert f"root {tmp_path};" in snippet and "try_files /ready.json =503;" in snippet
    checked = subprocess.run([nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(conf)],
                             capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr


def ready_count(base: str) -> tuple[int, int | None]:
    r = httpx.get(base + "/ready", timeout=10)
    return r.status_code, (r.json().get("ready_replicas") if r.status_code == 200 else None)


def test_two_replicas_behind_one_port(tmp_path: Path) -> None:
    port = front_port()
    log_path = tmp_path / "supervisor.log"
    config = tmp_path / "profile.yaml"  # edited before the SIGHUP below
    shutil.copy(CONFIG, config)
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"keys": KEYS}, sort_keys=False))
    listener = NotifyListener(tmp_path / "notify.sock")  # as systemd's Type=notify socket
    listener.base_url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--config", str(config), "--state-dir", str(STATE_DIR),
             "--port", str(port), "--no-client-limits", "--keys-file", str(tmp_path / "keys.yaml"),
             "--admin-key", ADMIN_KEY],
            # N from the profile (server.replicas), which the replicas inherit: each must still run
            # as one process, not as a supervisor of its own
            env={**os.environ, "LLM_GATEWAY_SERVER__REPLICAS": "2",
                 "LLM_GATEWAY_AUTH__USAGE_DB": str(tmp_path / "usage.sqlite3"),
                 "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "2000000"},
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    replica_ports = [port + 1, port + 2]

    def log() -> str:
        return log_path.read_text(errors="replace")

    try:
        assert wait_for(lambda: "through nginx" in log() or proc.poll() is not None, timeout=300, interval=0.5)
        assert proc.poll() is None, log()[-3000:]
        # sd_notify: READY=1 once the front answers /ready 200, with both replicas up; every message
        # from the supervisor (NotifyAccess=main): the replicas got no NOTIFY_SOCKET
        _, note = listener.wait_for("READY", "1", timeout=10)
        assert note.ready_status == 200 and "2 of 2 replicas ready" in note.fields["STATUS"], note.raw
        assert listener.messages[0].fields == {"STATUS": "starting replica 1 of 2"}, listener.messages[0].raw
        first_ping, _ = listener.wait_for("WATCHDOG", "1", timeout=5)
        listener.wait_for("WATCHDOG", "1", after=first_ping + 1, timeout=5)  # every second (WatchdogSec=2)
        assert {m.pid for m in listener.messages} == {proc.pid}
        with httpx.Client() as client:
            # least_conn with nothing open alternates: both replicas serve through the one port
            before = [served(p) for p in replica_ports]
            for i in range(6):
                r = complete(client, base, f"Request {i}:")
                assert r.status_code == 200, r.text
            after = [served(p) for p in replica_ports]
            assert all(a > b for a, b in zip(after, before)), (before, after)
            # no per-client limit with --no-client-limits: a burst past the shipped 10/s + 20 gets no 429
            codes = [client.get(base + "/v1/models", headers=LOAD, timeout=10).status_code for _ in range(40)]
            assert set(codes) == {200}, codes
            # /ready on the front door counts the replicas, not just the one nginx picked
            r = client.get(base + "/ready", timeout=10)
            assert r.status_code == 200 and r.json() == {"status": "ready", "replicas": 2, "ready_replicas": 2,
                                                         "ready_ports": replica_ports}, r.text

            # a tenant's requests_per_minute holds across the replicas (they count in the
            # supervisor's private redis-server): each replica alone would have let it through
            metered = [complete(client, base, f"Metered {i}:", headers={"Authorization": f"Bearer {METERED_KEY}"})
                       for i in range(2 * METERED_RPM)]
            codes = [r.status_code for r in metered]
            assert codes.count(200) == METERED_RPM and codes.count(429) == METERED_RPM, codes
            assert all(served(p, tenant="metered") > 0 for p in replica_ports), "least_conn used one replica"
            assert "private redis-server" in log()

            # /metrics on the front door: both replicas' families, each sample labelled by replica
            text = client.get(base + "/metrics", timeout=10).text
            families = {f.name: f for f in text_string_to_metric_families(text)}
            assert {s.labels["replica"]: s.value for s in families["gateway_replica_up"].samples} == {"0": 1, "1": 1}
            by_replica = {s.labels["replica"] for s in families["gateway_requests"].samples}
            assert by_replica == {"0", "1"}, by_replica
            tenant_rows = [s for s in families["gateway_tenant_requests"].samples
                           if s.labels.get("tenant") == "metered" and s.name.endswith("_total")]
            assert sum(s.value for s in tenant_rows) == 2 * METERED_RPM, tenant_rows
            assert all("replica" in s.labels for f in families.values() for s in f.samples)

        # a replica killed under load: nginx sends the plain requests it had open there to the other
        # one; a stream whose answer had begun there cannot be resent, so it ends cut short (a
        # chunked body without its last chunk: the client sees an error, never a short answer
        # that looks whole)
        with Load(base, clients=4, headers=LOAD) as load:  # 2 streaming, 2 plain
            time.sleep(3)
            [victim] = [c for c in psutil.Process(proc.pid).children()
                        if f"--port {replica_ports[0]}" in " ".join(c.cmdline())]
            left_behind = victim.children(recursive=True)  # its engine core
            assert left_behind
            victim.kill()
            killed_at = load.ended
            # within the supervisor's next look, /ready says one replica is left (still 200: it serves)
            assert wait_for(lambda: ready_count(base) == (200, 1), timeout=10, interval=0.2), ready_count(base)
            # the load goes on until 8 more requests ended (on the survivor, or retried there by nginx)
            assert wait_for(lambda: load.ended >= killed_at + 8, timeout=120, interval=0.2), load.result
        print(f"\n{load.ended} requests, {killed_at} before the kill; failures: {load.result.failures}")
        # at most the two streams open at the kill, each cut short
        assert len(load.result.failures) <= 2, load.result.failures
        assert all("incomplete chunked read" in f for f in load.result.failures), load.result.failures
        assert "replica 0 exited (-9)" in log()
        # what the killed replica left (its engine core, gigabytes) was adopted and ended
        assert wait_for(lambda: not [p for p in left_behind if running(p)], timeout=30), left_behind
        # ... and the supervisor started it again
        assert wait_for(lambda: "ready again" in log(), timeout=180, interval=0.5), log()[-3000:]
        assert httpx.get(f"http://127.0.0.1:{replica_ports[0]}/ready", timeout=5).status_code == 200
        assert wait_for(lambda: ready_count(base) == (200, 2), timeout=10, interval=0.2), ready_count(base)
        print([line.split("replicas: ")[-1] for line in log().splitlines() if "ready again" in line])

        # SIGHUP after a profile change (as `systemctl reload`): each replica swaps its engine in
        # turn (drain-swap), the other one serving meanwhile; no request fails
        profile = yaml.safe_load(config.read_text())
        profile["engine"]["max_num_seqs"] = 48
        config.write_text(yaml.safe_dump(profile))
        seen_ready: set[int | None] = set()

        def rolled() -> bool:
            # the roll runs in a thread: the front's /ready goes on, and counts a swapping replica out
            seen_ready.add(ready_count(base)[1])
            return "rolling reload: 2 replica(s) reloaded" in log() or "rolling reload stopped" in log()

        with Load(base, clients=4, headers=LOAD) as load:
            time.sleep(2)
            before_hup = len(listener.messages)
            proc.send_signal(signal.SIGHUP)
            assert wait_for(rolled, timeout=300, interval=0.5), log()[-3000:]
            swapped_at = load.ended
            assert wait_for(lambda: load.ended >= swapped_at + 4, timeout=120, interval=0.2), load.result
        print(f"{load.ended} requests across the rolling reload; failures: {load.result.failures}")
        assert "rolling reload: 2 replica(s) reloaded" in log(), log()[-3000:]
        assert load.result.failures == [], load.result.failures
        assert len([line for line in log().splitlines() if "(drain-swap, " in line]) == 2, log()[-3000:]
        assert 1 in seen_ready and 2 in seen_ready, seen_ready
        reloading, _ = listener.wait_for("RELOADING", "1", after=before_hup, timeout=5)
        _, back = listener.wait_for("READY", "1", after=reloading + 1, timeout=10)
        assert "2 of 2 replicas ready" in back.fields["STATUS"], back.raw
        for rp in replica_ports:
            status = httpx.get(f"http://127.0.0.1:{rp}/admin/status", headers=ADMIN, timeout=10).json()
            assert status["profile"]["max_num_seqs"] == 48, status["profile"]
            # no request waited for a replica's new engine: a reloading replica refuses (its reload
            # queue is 0) and nginx sends the request to the other one
            assert status["last_reload"]["queued"] == 0, status["last_reload"]

        # SIGTERM: the replicas drain, nginx quits, nothing is left
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        before_term = len(listener.messages)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log()[-3000:]
        listener.wait_for("STOPPING", "1", after=before_term, timeout=5)
        assert {m.pid for m in listener.messages} == {proc.pid}
        assert wait_for(lambda: not [p for p in family if running(p)], timeout=30), family
        assert "stopped (exit 0)" in log()
        assert not list((STATE_DIR / f"replicas-{port}" / "redis").glob("*.sock"))
    finally:
        listener.close()
        # after a failure too: the supervisor, its replicas, their engine cores (gigabytes each) and nginx
        try:
            family = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        if proc.poll() is None:
            proc.kill()
        for p in family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if any(f"--port {rp}" in cmd for rp in replica_ports) or f"replicas-{port}" in cmd:
                p.kill()
