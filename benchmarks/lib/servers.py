"""Shared pieces of the HTTP benchmarks (http_overhead.py, reload_under_load.py): one effective gateway
profile written to a YAML file, servers started in their own process group and stopped with all
their engine processes, JSON-lines result files.

No vLLM import here: the parent processes of the benchmarks stay light.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.settings.schema import deep_merge  # noqa: F401  (the drivers call servers.deep_merge)

from benchmarks.fixtures import synth_tokenizer

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIG = ROOT / "configs" / "gemma4-e2b-h200.yaml"
CPU_CONFIG = ROOT / "configs" / "embedded-cpu.yaml"


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def add_profile_args(ap: Any, set_help: str) -> None:
    """--device, --config and --set: which gateway profile a driver starts from, and its overrides."""
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--config", type=Path, help="gateway profile (default: configs/gemma4-e2b-h200.yaml "
                    "on gpu, configs/embedded-cpu.yaml on cpu)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help=set_help)


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set engine.max_num_seqs=256 --set reload.drain_timeout_s=10` -> nested overrides (YAML values)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise SystemExit(f"--set wants SECTION.FIELD=VALUE, got {item!r}")
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = yaml.safe_load(raw)
    return out


def rpc_dir(workdir: Path, name: str) -> Path:
    """A directory for vLLM's IPC sockets (VLLM_RPC_BASE_PATH): under `workdir` when the socket
    paths fit a Unix socket's 107 characters (a 36-character id is added), else a fresh one in /tmp
    (pytest's tmp paths grow past it)."""
    preferred = workdir / name
    path = preferred if len(str(preferred)) + 45 <= 107 else Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/tmp"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def gpu_model_dir(default: Path) -> Path:
    """Where the GPU tools put the synthetic Gemma 4 E2B directory: `GPU_MODEL_DIR` (set by
    benchmarks/device/env.sh), else `default`. vLLM's compile cache is keyed by the model
    path (not the load format or memory share), so one path for the tests, part 2 and part 3
    lets every engine after the first on a machine start warm (~60 s instead of ~4 min)."""
    return Path(os.environ.get("GPU_MODEL_DIR") or default)


def device_overrides(device: str, workdir: Path, synth_dir: Path | None) -> dict[str, Any]:
    """What the benchmark changes in the profile: the dummy Gemma model (GPU) or the embedded
    SmolLM2 resolved to an absolute path (CPU), and a private state directory."""
    over: dict[str, Any] = {"server": {"state_dir": str(workdir / "state"), "host": "127.0.0.1"}}
    if device == "gpu":
        assert synth_dir is not None
        over["engine"] = {"model": str(synth_dir), "load_format": "dummy", "device": "gpu"}
    else:
        from server.settings.schema import embedded_model_dir

        over["engine"] = {"model": str(embedded_model_dir(ROOT / ".state").resolve()), "device": "cpu"}
    return over


def gateway_profile(a: Any, config: Path, workdir: Path, defaults: dict[str, Any] | None = None):  # noqa: ANN201
    """The effective profile of an HTTP benchmark run: `config`, the device's model (the synthetic
    Gemma directory on the GPU), `defaults`, then `--set`; written to WORKDIR/profile.yaml.
    Fills `a.vocab_size` from the model's config when not given. Returns (settings, profile path,
    the merged overrides)."""
    synth = None
    if a.device == "gpu":
        synth = synth_tokenizer.build(gpu_model_dir(workdir / "gemma-4-e2b-synth"))
    overrides = deep_merge(deep_merge(device_overrides(a.device, workdir, synth), defaults or {}), parse_set(a.set))
    settings = effective_settings(config, overrides)
    profile = write_settings(settings, workdir / "profile.yaml")
    if a.vocab_size is None:
        a.vocab_size = int(json.loads((Path(settings.model_path()) / "config.json").read_text())["vocab_size"])
    return settings, profile, overrides


def effective_settings(config: Path, overrides: dict[str, Any]):  # -> server.settings.Settings
    from server.settings import load_settings

    # LLM_GATEWAY_* variables of the caller's shell would leak into the profile: leave them out
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("LLM_GATEWAY_")}
    try:
        return load_settings(config, **overrides)
    finally:
        os.environ.update(saved)


def write_settings(settings, path: Path) -> Path:  # noqa: ANN001
    """The effective settings as a YAML profile every way starts from (no env, no CLI flags)."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLM_GATEWAY_")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


@dataclass
class Server:
    """A server (gateway or `vllm serve`) in its own session, logging to a file."""

    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    started: float = field(default_factory=time.monotonic)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, path: str, timeout_s: float) -> float:
        """Seconds until `path` answered 200; raises on exit or timeout."""
        import httpx

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + path, timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30.0) -> None:
        stop_group(self.proc, grace_s)


def start_server(name: str, cmd: list[str], log_path: Path, port: int, env: dict[str, str],
                 cwd: Path = ROOT) -> Server:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"\n==== {now_utc()} {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return Server(name, proc, port, log_path)


def run_logged(cmd: list[str], log_path: Path, header: str, t_end: float, tag: str) -> bool:
    """A load client to its end (or the driver's deadline `t_end`, monotonic), its output appended to
    `log_path` after a header line; False, with a line saying why, if it did not finish cleanly."""
    with log_path.open("a") as lf:
        lf.write(f"\n==== {header}\n")
        lf.flush()
        try:
            subprocess.run(cmd, cwd=ROOT, stdout=lf, stderr=subprocess.STDOUT, env=clean_env(),
                           timeout=max(1.0, t_end - time.monotonic()), check=True)
        except subprocess.TimeoutExpired:
            print(f"[{tag}] stopped at the deadline", flush=True)
            return False
        except subprocess.CalledProcessError as exc:
            print(f"[{tag}] exited {exc.returncode} (see {log_path})", flush=True)
            return False
    return True


def _descendants(pid: int) -> list[Any]:
    import psutil  # vLLM's dependency: present wherever a server runs

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process group (the server and its engine processes), then SIGKILL what is left.
    The gateway's engine processes lead their own group (server/process_group.py), so they are
    listed first and killed by pid if the gateway's ordered stop did not end them."""
    engine = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # engine cores outlive a killed parent otherwise
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for child in engine:
        try:
            child.kill()  # psutil checks the pid still names the same process
        except Exception:  # noqa: BLE001  (already gone)
            pass
    wait_group_gone(proc.pid)


def wait_group_gone(pgid: int, limit_s: float = 30.0) -> None:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.3)


def append_jsonl(path: Path, rec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def load_jsonl(paths: list[Path]) -> list[dict[str, Any]]:
    """Records from JSON-lines files, a JSON list, or a {"meta": ..., "results": [...]} document."""
    recs: list[dict[str, Any]] = []
    for p in paths:
        if not p.exists():
            continue
        text = p.read_text().strip()
        if not text:
            continue
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None
        if isinstance(doc, list):
            recs.extend(doc)
        elif isinstance(doc, dict) and isinstance(doc.get("results"), list):
            recs.extend(doc["results"])
        elif isinstance(doc, dict):
            recs.append(doc)
        else:
            recs.extend(json.loads(line) for line in text.splitlines() if line.strip())
    return recs


def write_doc(path: Path, meta: dict[str, Any], recs: list[dict[str, Any]]) -> Path:
    """A results document for benchmarks/results/: {"meta": {...}, "results": [lines]}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": recs}, indent=1) + "\n")
    return path


def fmt_num(v: float | None, unit: str = "") -> str:
    if v is None or v != v:  # None or NaN
        return "-"
    if abs(v) >= 10000:
        return f"{v / 1000:.1f}k{unit}"
    if abs(v) >= 100:
        return f"{v:.0f}{unit}"
    if abs(v) >= 10:
        return f"{v:.1f}{unit}"
    return f"{v:.2f}{unit}"
