"""`llm-gateway serve --replicas N`: N gateway processes on loopback ports and nginx in front of them
on the profile's address, in the foreground until Ctrl-C or SIGTERM.

- Replica `i` listens on 127.0.0.1:(server.port + 1 + i); nginx on server.host:server.port with the
  shipped site (least_conn, retries of requests a replica refused or never got), or with
  `server.replicas_fill_first`, the first replica filled up to that many open requests before the
  others get any (front.upstream_lines). No failure counting (front.render_site's
  `count_failures`): a replica that refuses is asked again with the next request.
- The replicas start one after another, each once the previous one answers /ready: on a GPU, vLLM
  checks the free memory when an engine starts, so each replica takes 1/N of the profile's
  `gpu_memory_utilization` less a reserve for what an engine holds past vLLM's own accounting
  (memory_share).
- A replica that exits while the others serve is started again (nginx's connections to it are
  refused meanwhile, and each request goes on to another);
  one that keeps dying waits longer each time, up to a minute. The supervisor is a subreaper: the
  engine core of a replica killed outright is adopted and ended, not left holding its memory.
- `/ready` on the front door answers from a file the supervisor keeps (every second): 200 with how
  many replicas are ready while at least one is, else 503; not ready while draining.
- `/metrics` on the front door is every replica's, labelled `replica` (metrics_view.py).
- With a keys file, the tenants' limits and budgets hold across the replicas: they share
  `auth.redis_url`, or a private redis-server the supervisor runs (shared_limits.py).
- With `server.cuda_mps` on a GPU, the replicas are clients of one CUDA MPS daemon the supervisor
  runs (mps.py), started before them and asked to quit after them.
- Ctrl-C or SIGTERM: every replica drains (server.drain_timeout_s), then nginx quits.
- SIGHUP: a rolling reload, one replica at a time (`llm-gateway reload` on their URLs), in a
  thread, so that /ready, restarts and the watchdog go on while engines swap (minutes on a GPU).
  A replica's reload queue is 0 (RELOAD_QUEUE_ENV): a request that reaches a reloading replica
  gets 503 at once, and nginx sends it on to another one (proxy_next_upstream) instead of leaving
  it to wait for the new engine. The front counts no failures (front.render_site's
  count_failures), so nginx takes a reloaded replica back at once.
- Under systemd (`Type=notify`), the supervisor is the main process and speaks sd_notify itself:
  READY=1 once nginx serves, RELOADING=1 ... READY=1 around a roll, STOPPING=1, STATUS with the
  ready replicas, and WATCHDOG=1 while its loop runs. The replicas get no NOTIFY_SOCKET: systemd
  would drop their messages (NotifyAccess=main), and their own stall rule ends a stalled engine.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from server.lifecycle.rolling_reload import RollError, ready, roll
from server.replicas.front import READY_FILE, nginx_binary, write_front
from server.replicas.metrics_view import MetricsView
from server.replicas.mps import PROCESS_PREFIX, MpsDaemon, MpsError
from server.replicas.shared_limits import PrivateRedis
from server.runner.notify import Notifier
from server.runner.processes import become_subreaper, end_processes
from server.settings import Settings

logger = logging.getLogger("llm_gateway.replicas")

RESTART_BACKOFF_MAX_S = 60.0
READY_POLL_S = 1.0  # how often /ready's file is brought up to date
SYSTEMD_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")  # the supervisor's, not the replicas'
# A reloading replica refuses what would wait for its new engine (503), and nginx sends that on to
# another replica. Not nginx taking the replica out of rotation instead: that needs nginx to reload,
# and its old workers then close their idle client connections, losing a request sent on one at
# that moment (a few in every thirty reloads under load, measured).
RELOAD_QUEUE_ENV = {"LLM_GATEWAY_RELOAD__QUEUE_SIZE": "0"}
REPLICA_RESERVE = 0.07  # of the GPU's memory, per replica, beyond vLLM's own accounting (memory_share)


@dataclass
class Replica:
    index: int
    port: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 1.0
    awaiting_ready: bool = False
    ready: bool = False  # its /ready at the supervisor's last look

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.ready = False  # until the new process answers
        with self.log_path.open("ab") as log:
            # its own session: Ctrl-C reaches the supervisor only, which drains the replicas in order
            self.proc = subprocess.Popen([sys.executable, "-m", "server", *self.argv], env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started_at = time.monotonic()
        logger.info("replica %d: started (pid %d, port %d, log %s)", self.index, self.proc.pid, self.port, self.log_path)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def child_argv(serve_argv: list[str], port: int) -> list[str]:
    """`serve`'s own arguments for one replica: without --replicas, --host and --port, then bound to
    127.0.0.1:port (only nginx faces the clients) as one process."""
    out: list[str] = []
    skip = False
    for arg in serve_argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--replicas", "--host", "--port", "--no-client-limits"):
            skip = "=" not in arg and name != "--no-client-limits"
            continue
        out.append(arg)
    # --replicas 1: a profile's own server.replicas must not make each replica a supervisor in turn
    return ["serve", *out, "--host", "127.0.0.1", "--port", str(port), "--replicas", "1"]


def memory_share(settings: Settings, replicas: int) -> str | None:
    """Each replica's gpu_memory_utilization on a GPU (two decimals, rounded down); None on CPU,
    where each engine's KV cache is its own `kv_cache_memory_bytes`."""
    if settings.engine.resolved_device() != "gpu":
        return None
    share = settings.engine.gpu_memory_utilization / replicas
    if replicas > 1:
        # vLLM sizes an engine's KV cache to fill its share, yet the engine then holds GiBs more
        # (the CUDA context, allocator caches, what its batches allocate): on the H100 a replica
        # of the decode profile at 0.45 held 41 of 79 GiB, and the second one ran out of memory at
        # its start; two at 0.40 held 0.94 of the card after a burst of 320 requests. Each replica
        # leaves REPLICA_RESERVE of the GPU for that.
        share -= REPLICA_RESERVE
    return f"{math.floor(share * 100 + 1e-9) / 100:.2f}"


class Supervisor:
    def __init__(self, settings: Settings, serve_argv: list[str], replicas: int, *, client_limits: bool = True) -> None:
        self.settings = settings
        self.n = replicas
        self.client_limits = client_limits
        # one folder per front port: two fronts on one state dir keep their nginx files apart
        self.prefix = Path(settings.server.state_dir).resolve() / f"replicas-{settings.server.port}"
        self.stopping = False
        self.reload_requested = False
        self.notifier = Notifier()
        self._watchdog_s = self.notifier.watchdog_interval_s()
        self._pinged = 0.0
        self._roll: threading.Thread | None = None
        self._roll_ended = False
        self._status = ""
        env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_ENV}
        if replicas > 1:
            env.update(RELOAD_QUEUE_ENV)
        share = memory_share(settings, replicas)
        if share is not None:
            env["LLM_GATEWAY_ENGINE__GPU_MEMORY_UTILIZATION"] = share
        self.redis: PrivateRedis | None = None
        if settings.auth.keys_file is not None and not settings.auth.redis_url:
            self.redis = PrivateRedis(self.prefix / "redis")
            env["LLM_GATEWAY_AUTH__REDIS_URL"] = self.redis.url
        self.mps: MpsDaemon | None = None
        if settings.server.cuda_mps and replicas > 1:
            if settings.engine.resolved_device() == "gpu":
                self.mps = MpsDaemon(self.prefix / "mps")
                env.update(self.mps.env())
            else:
                logger.warning("server.cuda_mps is for replicas on a GPU: ignored on CPU")
        base = settings.server.port
        self.replicas = [
            Replica(i, base + 1 + i, child_argv(serve_argv, base + 1 + i), env, self.prefix / f"replica-{i}.log")
            for i in range(replicas)
        ]
        self.nginx: subprocess.Popen[bytes] | None = None
        self.metrics = MetricsView([r.url for r in self.replicas])
        self.probe = httpx.Client()  # the /ready polls
        self._ready_checked = 0.0

    # -- signals ---------------------------------------------------------------------------

    def _on_stop(self, signum: int, _frame: object) -> None:
        if not self.stopping:
            logger.info("%s: draining %d replica(s)", signal.Signals(signum).name, self.n)
            self.notifier.stopping(f"draining {self.n} replica(s)")
        self.stopping = True

    def _on_hup(self, _signum: int, _frame: object) -> None:
        self.reload_requested = True

    # -- systemd ---------------------------------------------------------------------------

    def _ping(self) -> None:
        """WATCHDOG=1 every half WatchdogSec while the supervisor's loop runs (each replica's own
        stall rule ends a stalled engine; the supervisor then starts that replica again)."""
        if self._watchdog_s is not None and not self.stopping and time.monotonic() - self._pinged >= self._watchdog_s:
            self._pinged = time.monotonic()
            self.notifier.watchdog()

    def _tell(self, status: str) -> None:
        if status != self._status:
            self._status = status
            self.notifier.status(status)

    def _serving_status(self) -> str:
        s = self.settings.server
        up = sum(1 for r in self.replicas if r.ready)
        return (f"serving {self.settings.served_model_name} on http://{s.host}:{s.port} through nginx: "
                f"{up} of {self.n} replicas ready")

    def _announce_ready(self) -> None:
        """READY=1 with the ready count of the last /ready poll as its STATUS."""
        self._status = self._serving_status()
        self.notifier.ready(self._status)

    # -- steps -----------------------------------------------------------------------------

    def _wait_ready(self, replica: Replica, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.stopping and time.monotonic() < deadline:
            self._ping()
            if not replica.alive():
                logger.error("replica %d exited with %s before it was ready; its log: %s", replica.index,
                             replica.proc.returncode if replica.proc else None, replica.log_path)
                return False
            if ready(self.probe, replica.url, timeout_s=2.0):
                logger.info("replica %d: ready on %s", replica.index, replica.url)
                return True
            time.sleep(0.5)
        return False

    def _start_nginx(self, binary: str) -> bool:
        s = self.settings.server
        host = f"[{s.host}]" if ":" in s.host else s.host
        self._publish_ready()
        conf = write_front(self.prefix, upstreams=[r.port for r in self.replicas], listen=f"{host}:{s.port}",
                           client_limits=self.client_limits, ready_dir=self.prefix, metrics_port=self.metrics.port,
                           fill_first=s.replicas_fill_first, count_failures=False)
        checked = subprocess.run([binary, "-t", "-p", str(self.prefix), "-c", str(conf)],
                                 capture_output=True, text=True, timeout=30)
        if checked.returncode != 0:
            logger.error("nginx -t refused the front's configuration:\n%s", checked.stderr)
            return False
        with (self.prefix / "nginx.out").open("ab") as log:
            self.nginx = subprocess.Popen([binary, "-p", str(self.prefix), "-c", str(conf), "-g", "daemon off;"],
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        time.sleep(0.3)
        if self.nginx.poll() is not None:
            logger.error("nginx exited at start: %s", (self.prefix / "error.log").read_text()[-2000:])
            return False
        return True

    def _publish_ready(self) -> None:
        """/ready's file (front.ready_from_file): present with the ready replicas while at least one
        is ready and the supervisor is not stopping, absent otherwise (nginx then answers 503)."""
        path = self.prefix / READY_FILE
        for r in self.replicas:
            # a slow answer (an event loop busy under load) keeps what it said last, so a loaded
            # replica does not drop out of the count
            r.ready = r.alive() and ready(self.probe, r.url, timeout_s=2.0, on_timeout=r.ready)
        up = [] if self.stopping else [r for r in self.replicas if r.ready]
        self._ready_checked = time.monotonic()
        if not up:
            path.unlink(missing_ok=True)
            return
        body = {"status": "ready", "replicas": self.n, "ready_replicas": len(up),
                "ready_ports": [r.port for r in up]}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body) + "\n")
        os.replace(tmp, path)

    def _end_orphans(self) -> None:
        """A replica killed outright leaves its engine core running, with gigabytes of memory; as
        a subreaper the supervisor adopts it, and ends it here."""
        known = {r.proc.pid for r in self.replicas if r.proc is not None}
        if self.nginx is not None:
            known.add(self.nginx.pid)
        if self.redis is not None and self.redis.proc is not None:
            known.add(self.redis.proc.pid)
        try:
            orphans = strays(psutil.Process().children(), known, mps=self.mps is not None)
        except psutil.Error:
            return
        if orphans:
            logger.warning("ending %d process(es) a dead replica left: %s", len(orphans),
                           ", ".join(f"{o.pid}" for o in orphans))
            end_processes(orphans, grace_s=5.0)

    def _restart_dead(self) -> None:
        for replica in self.replicas:
            if replica.alive() or self.stopping:
                continue
            if time.monotonic() - replica.started_at < replica.backoff_s:
                continue
            code = replica.proc.returncode if replica.proc else None
            # one that died soon after its start waits longer before the next try
            lived = time.monotonic() - replica.started_at
            replica.backoff_s = min(RESTART_BACKOFF_MAX_S, replica.backoff_s * 2) if lived < 60 else 1.0
            replica.restarts += 1
            logger.warning("replica %d exited (%s); starting it again (restart %d); nginx serves from the others",
                           replica.index, code, replica.restarts)
            replica.start()
            replica.awaiting_ready = True
        for replica in self.replicas:
            # `ready` comes from _publish_ready's poll of every replica
            if replica.awaiting_ready and replica.alive() and replica.ready:
                replica.awaiting_ready = False
                logger.info("replica %d: ready again on %s, %.0f s after its restart", replica.index, replica.url,
                            time.monotonic() - replica.started_at)

    def _start_roll(self) -> None:
        """A rolling reload in a thread; a SIGHUP during one waits for it to end, then rolls again."""
        if self._roll is not None and self._roll.is_alive():
            return
        self.reload_requested = False
        self.notifier.reloading(f"rolling reload of {self.n} replicas")
        self._roll = threading.Thread(target=self._rolling_reload, name="rolling-reload", daemon=True)
        self._roll.start()

    def _rolling_reload(self) -> None:
        keys = self.settings.auth.admin_keys
        try:
            steps = roll([r.url for r in self.replicas], admin_key=keys[0] if keys else None, report=logger.info)
            logger.info("rolling reload: %d replica(s) reloaded", len(steps))
        except RollError as exc:
            logger.error("rolling reload stopped: %s", exc)
        finally:
            self._roll_ended = True  # the main loop says READY=1 with a fresh count of ready replicas

    def _stop_all(self) -> None:
        if not self.stopping:  # not a signal: a failed start, or nginx gone
            self.notifier.stopping("stopping")
        self.stopping = True
        (self.prefix / READY_FILE).unlink(missing_ok=True)  # draining: /ready says 503 from now on
        for replica in self.replicas:
            if replica.alive() and replica.proc is not None:
                replica.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.server.drain_timeout_s + 60
        for replica in self.replicas:
            if replica.proc is None:
                continue
            try:
                replica.proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("replica %d did not stop in time: killed", replica.index)
                os.killpg(replica.proc.pid, signal.SIGKILL)
                replica.proc.wait()
        if self.nginx is not None and self.nginx.poll() is None:
            self.nginx.send_signal(signal.SIGQUIT)  # graceful: open connections finish first
            try:
                self.nginx.wait(15)
            except subprocess.TimeoutExpired:
                self.nginx.kill()
                self.nginx.wait()
        if self.redis is not None:
            self.redis.stop()  # after the replicas: draining requests still settle their limits
        if self.mps is not None:
            self.mps.stop()  # after the replicas, its clients
        self.metrics.stop()
        self._end_orphans()

    def _start_redis(self) -> bool:
        """Start the private redis-server, if the replicas need one; False (logged) when it fails."""
        if self.redis is None:
            return True
        try:
            self.redis.start()
        except RuntimeError as exc:
            logger.error("%s", exc)
            return False
        logger.info("tenant limits shared by the replicas through a private redis-server (%s)", self.redis.url)
        return True

    def _start_mps(self) -> bool:
        """Start the CUDA MPS daemon, if the replicas use one; False (logged) when it fails."""
        if self.mps is None:
            return True
        try:
            self.mps.start()
        except (MpsError, OSError, subprocess.TimeoutExpired) as exc:
            logger.error("server.cuda_mps: the CUDA MPS daemon did not start: %s", exc)
            return False
        logger.info("replicas share the GPU through CUDA MPS (daemon's pipe and logs under %s)", self.mps.pipe_dir.parent)
        return True

    def _restart_redis(self) -> None:
        if self.redis is None or self.redis.alive() or self.stopping:
            return
        # meanwhile each replica counts on its own (the limiter fails open, and says so)
        logger.warning("the private redis-server exited: starting it again")
        self._start_redis()

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> int:
        binary = nginx_binary()
        if binary is None:
            logger.error("--replicas needs nginx in front of the replicas (Debian: apt install nginx-light)")
            return 2
        self.prefix.mkdir(parents=True, exist_ok=True)
        become_subreaper()
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)
        try:
            if not self._start_redis() or not self._start_mps():
                return 2
            self.metrics.start()
            for replica in self.replicas:
                self._tell(f"starting replica {replica.index + 1} of {self.n}")
                replica.start()
                if not self._wait_ready(replica, timeout_s=1800):
                    return 0 if self.stopping else 1
            if not self._start_nginx(binary):
                return 1
            s = self.settings.server
            logger.info("serving %s on http://%s:%d through nginx: %d replicas on ports %s (/metrics: all of them, "
                        "labelled by replica); logs under %s", self.settings.served_model_name, s.host, s.port, self.n,
                        ", ".join(str(r.port) for r in self.replicas), self.prefix)
            self._announce_ready()  # /ready's file is written (_start_nginx): nginx answers 200
            while not self.stopping:
                time.sleep(0.5)
                self._ping()
                if self.nginx is not None and self.nginx.poll() is not None:
                    logger.error("nginx exited (%s): stopping the replicas", self.nginx.returncode)
                    return 1
                self._end_orphans()
                self._restart_redis()
                self._restart_dead()
                if self._roll_ended:  # a fresh count of ready replicas goes with READY=1
                    self._roll_ended = False
                    self._publish_ready()
                    self._announce_ready()
                elif time.monotonic() - self._ready_checked >= READY_POLL_S:
                    self._publish_ready()
                    self._tell(self._serving_status())
                if self.reload_requested:
                    self._start_roll()
            return 0
        finally:
            self._stop_all()


def strays(children: list[psutil.Process], known: set[int], *, mps: bool) -> list[psutil.Process]:
    """The supervisor's children it did not start itself: what dead replicas left. With CUDA MPS
    the daemon, which forks itself into the background, is one of them and stays."""
    out = []
    for child in children:
        if child.pid in known:
            continue
        if mps:
            try:
                if child.name().startswith(PROCESS_PREFIX):
                    continue
            except psutil.Error:
                continue  # gone meanwhile
        out.append(child)
    return out


def run_replicas(settings: Settings, serve_argv: list[str], replicas: int, *, client_limits: bool = True) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per /ready poll
    code = Supervisor(settings, serve_argv, replicas, client_limits=client_limits).run()
    logger.info("stopped (exit %d)", code)
    return code
