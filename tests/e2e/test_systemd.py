"""The systemd units, the environment file and the install script.

`systemd-analyze verify` (systemd 252) loads the unit like the manager would and checks that
ExecStart='s binary exists and is executable. The shipped units point at
/opt/llm-gateway/venv/bin/llm-gateway, which only exists on an installed host; `--root=DIR`
does not help here because with a root it also wants the whole unit tree there (sysinit.target,
/bin/kill, ...). So the test copies the unit into a tmp dir with that one path replaced by this
checkout's own console script (.venv/bin/llm-gateway, the same entry point), and verifies the
copy. verify exits 0 on unknown keys or bad values (it only warns and ignores them), so the test
also requires that it prints nothing, and proves that check with a deliberately broken copy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from server.settings import HealthSettings
from tests.conftest import ROOT

SYSTEMD_DIR = ROOT / "systemd"
UNITS = ["llm-gateway.service", "llm-gateway@.service"]
INSTALLED_BIN = "/opt/llm-gateway/venv/bin/llm-gateway"
LOCAL_BIN = Path(sys.executable).parent / "llm-gateway"


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if not found:
        pytest.fail("systemd-analyze is not installed (CI installs it: .ci/run apt-installs systemd)")
    return found


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (keys repeat, e.g. DeviceAllow=)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, value = line.split("=", 1)
        assert current is not None
        current.setdefault(key, []).append(value)
    return sections


def verify(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([systemd_analyze(), "verify", str(path)], capture_output=True, text=True, timeout=60)


def unit_copy(tmp: Path, name: str, text: str | None = None) -> Path:
    text = text if text is not None else (SYSTEMD_DIR / name).read_text()
    assert text.count(INSTALLED_BIN) == 1, f"{name}: ExecStart should name {INSTALLED_BIN} once"
    assert LOCAL_BIN.is_file() and os.access(LOCAL_BIN, os.X_OK), LOCAL_BIN
    path = tmp / name
    path.write_text(text.replace(INSTALLED_BIN, str(LOCAL_BIN)))
    return path


@pytest.mark.parametrize("name", UNITS)
def test_systemd_analyze_verify_is_clean(name: str, tmp_path: Path) -> None:
    result = verify(unit_copy(tmp_path, name))
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == "", result.stdout + result.stderr


def test_verify_would_catch_mistakes(tmp_path: Path) -> None:
    """The check above is not vacuous: a typo'd key and an unusable binary both show up."""
    text = (SYSTEMD_DIR / "llm-gateway.service").read_text()
    typo = verify(unit_copy(tmp_path, "llm-gateway.service", text.replace("KillMode=mixed", "KilMode=mixed")))
    assert "Unknown key 'KilMode'" in typo.stderr
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "llm-gateway.service").write_text(text)
    unbuilt = verify(missing / "llm-gateway.service")
    assert unbuilt.returncode != 0 and f"Command {INSTALLED_BIN} is not executable" in unbuilt.stderr


@pytest.mark.parametrize("name", UNITS)
def test_unit_settings(name: str) -> None:
    svc = parse_unit((SYSTEMD_DIR / name).read_text())["Service"]
    one = {k: v[-1] for k, v in svc.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert re.fullmatch(rf"{re.escape(INSTALLED_BIN)} serve --config /etc/llm-gateway/config\.yaml", one["ExecStart"])
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert one["Restart"] == "on-failure"
    assert one["KillMode"] == "mixed"
    assert one["User"] == one["Group"] == "llm-gateway"
    assert "-/etc/llm-gateway/llm-gateway.env" in svc["EnvironmentFile"]
    assert int(one["TimeoutStartSec"]) >= 600  # first start: compile + CUDA graph capture
    # The watchdog is on. Pings stop at the stall timeout; systemd fires up to WatchdogSec later,
    # so the gateway's own rule (clear 503s, exit code 3) acts first on the GPU profiles.
    assert int(one["WatchdogSec"]) >= 2 * HealthSettings().resolved_stall_timeout_s("gpu")
    # Stop must outlast the longest drain of any shipped profile plus the engine shutdown.
    drains = [yaml.safe_load(p.read_text()).get("server", {}).get("drain_timeout_s", 30)
              for p in (ROOT / "configs").glob("*.yaml")]
    assert int(one["TimeoutStopSec"]) >= max(drains) + 30, (one["TimeoutStopSec"], drains)
    assert int(one["LimitNOFILE"]) >= 65536
    # State and caches: the systemd-managed directories, which the env points vLLM & co. at.
    assert one["StateDirectory"] == "llm-gateway" and one["CacheDirectory"] == "llm-gateway"
    env = dict(v.split("=", 1) for v in svc["Environment"])
    assert env["LLM_GATEWAY_SERVER__STATE_DIR"] == "/var/lib/llm-gateway"
    for var in ("VLLM_CACHE_ROOT", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
        assert env[var].startswith("/var/cache/llm-gateway"), var
    # Hardening, with the GPU still reachable.
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectHome", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectControlGroups", "RestrictSUIDSGID", "LockPersonality", "RestrictRealtime"):
        assert one[key] == "yes", key
    assert one["ProtectSystem"] == "strict"
    assert "PrivateDevices" not in one and "MemoryDenyWriteExecute" not in one
    assert one["DevicePolicy"] == "closed"
    allowed = {v.split()[0] for v in svc["DeviceAllow"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0",
            "char-nvidia-frontend", "char-nvidia-uvm", "char-nvidia-caps"} <= allowed
    assert all(v.split()[1] in ("r", "rw") for v in svc["DeviceAllow"])


def test_template_is_the_single_unit_plus_instance_settings() -> None:
    single = parse_unit((SYSTEMD_DIR / "llm-gateway.service").read_text())
    template = parse_unit((SYSTEMD_DIR / "llm-gateway@.service").read_text())
    svc = template["Service"]
    assert "CUDA_VISIBLE_DEVICES=%i" in svc["Environment"]
    assert svc["EnvironmentFile"] == ["-/etc/llm-gateway/llm-gateway.env", "/etc/llm-gateway/instance-%i.env"]
    assert svc["SyslogIdentifier"] == ["llm-gateway@%i"]
    # Apart from those, the same service settings as the single unit.
    for key, values in single["Service"].items():
        if key in ("Environment", "EnvironmentFile"):
            assert set(values) <= set(svc[key]), key
        else:
            assert svc[key] == values, key
    assert set(svc) - set(single["Service"]) == {"SyslogIdentifier"}
    assert template["Install"] == single["Install"]


def test_security_exposure_is_low(tmp_path: Path) -> None:
    """`systemd-analyze security --offline`: the hardening is real (exposure < 4, "OK")."""
    path = unit_copy(tmp_path, "llm-gateway.service")
    result = subprocess.run([systemd_analyze(), "security", "--offline=yes", "--no-pager", str(path)],
                            capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for llm-gateway\.service: ([0-9.]+)", result.stdout)
    assert match, result.stdout[-2000:] + result.stderr
    assert float(match.group(1)) < 4.0, result.stdout[-4000:]


def test_env_example_is_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every LLM_GATEWAY_* line of the example (commented-out ones too) is a real setting:
    the settings model forbids unknown fields, so a typo would fail here."""
    from server.settings import load_settings

    lines = (SYSTEMD_DIR / "llm-gateway.env.example").read_text().splitlines()
    pairs = {}
    for line in lines:
        m = re.fullmatch(r"#?([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if m:
            assert not m.group(2).startswith(("'", '"')), line  # systemd would keep the quotes
            pairs[m.group(1)] = m.group(2)
    gateway_vars = {k: v for k, v in pairs.items() if k.startswith("LLM_GATEWAY_")}
    assert len(gateway_vars) >= 5
    for key, value in gateway_vars.items():
        monkeypatch.setenv(key, value)
    settings = load_settings(ROOT / "configs" / "gemma4-e2b-h200.yaml")
    assert settings.server.port == int(pairs["LLM_GATEWAY_SERVER__PORT"])
    assert settings.engine.model == pairs["LLM_GATEWAY_ENGINE__MODEL"]
    assert settings.engine.max_model_len == int(pairs["LLM_GATEWAY_ENGINE__MAX_MODEL_LEN"])


def test_install_script_stages_everything(tmp_path: Path) -> None:
    """deploy/install.sh with DESTDIR: the files land where the units expect them, the
    per-GPU instance files carry one port each, the nginx upstream lists every instance, and the
    privileged commands are the documented ones (printed, not run)."""
    root = tmp_path / "root"
    env = {**os.environ, "DESTDIR": str(root)}
    result = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--gpus", "2", "--nginx"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for cmd in ("useradd --system --user-group --home-dir /var/lib/llm-gateway",
                "-m pip install", "systemctl daemon-reload",
                "systemctl enable --now llm-gateway@0.service llm-gateway@1.service"):
        assert cmd in out, cmd
    etc = root / "etc"
    assert (etc / "systemd/system/llm-gateway@.service").read_text() == (SYSTEMD_DIR / "llm-gateway@.service").read_text()
    assert (etc / "llm-gateway/config.yaml").read_text() == (ROOT / "configs/gemma4-e2b-h200.yaml").read_text()
    assert (etc / "llm-gateway/llm-gateway.env").read_text() == (SYSTEMD_DIR / "llm-gateway.env.example").read_text()
    assert oct((etc / "llm-gateway/llm-gateway.env").stat().st_mode & 0o777) == "0o640"
    for i in range(2):
        assert f"LLM_GATEWAY_SERVER__PORT={8000 + i}\n" in (etc / f"llm-gateway/instance-{i}.env").read_text()
    site = (etc / "nginx/conf.d/llm-gateway.conf").read_text()
    assert re.findall(r"^    server (127\.0\.0\.1:\d+)", site, re.M) == ["127.0.0.1:8000", "127.0.0.1:8001"]
    assert "#server" not in site
    assert (etc / "nginx/snippets/llm-gateway-proxy.conf").is_file()
    assert (root / "opt/llm-gateway/docs/deploy.md").is_file()
    # Idempotent, and never overwrites what an operator edited.
    (etc / "llm-gateway/llm-gateway.env").write_text("EDITED=1\n")
    again = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--gpus", "2", "--nginx"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert again.returncode == 0, again.stderr
    assert (etc / "llm-gateway/llm-gateway.env").read_text() == "EDITED=1\n"
    assert "kept existing /etc/llm-gateway/llm-gateway.env" in again.stdout


def test_install_script_places_replicas_on_one_gpu(tmp_path: Path) -> None:
    """--replicas-per-gpu: instance i on GPU i / R with 1/R of the profile's memory share less the
    reserve `serve --replicas` leaves too (supervisor.memory_share: 0.90 / 2 - 0.07), one port
    each, every replica after the first of its GPU ordered after the previous one, and nginx in
    front of all of them. Nonsense combinations are refused before anything is written."""
    root = tmp_path / "root"
    env = {**os.environ, "DESTDIR": str(root)}
    result = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--gpus", "2", "--replicas-per-gpu", "2",
                             "--nginx"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    units = " ".join(f"llm-gateway@{i}.service" for i in range(4))
    assert f"systemctl enable --now {units}" in result.stdout
    etc = root / "etc"
    for i in range(4):
        pairs = dict(line.split("=", 1) for line in (etc / f"llm-gateway/instance-{i}.env").read_text().splitlines()
                     if line and not line.startswith("#"))
        assert pairs == {"LLM_GATEWAY_SERVER__PORT": str(8000 + i), "CUDA_VISIBLE_DEVICES": str(i // 2),
                         "LLM_GATEWAY_ENGINE__GPU_MEMORY_UTILIZATION": "0.38"}, (i, pairs)
        drop_in = etc / f"systemd/system/llm-gateway@{i}.service.d/10-replica.conf"
        if i % 2:
            assert f"After=llm-gateway@{i - 1}.service\n" in drop_in.read_text()
        else:
            assert not drop_in.exists()
    site = (etc / "nginx/conf.d/llm-gateway.conf").read_text()
    assert re.findall(r"^    server (127\.0\.0\.1:\d+)", site, re.M) == [f"127.0.0.1:{8000 + i}" for i in range(4)]
    # one engine per GPU (no --replicas-per-gpu) keeps the profile's whole share
    single = tmp_path / "single"
    done = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--gpus", "1"], capture_output=True,
                          text=True, env={**os.environ, "DESTDIR": str(single)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "GPU_MEMORY_UTILIZATION" not in (single / "etc/llm-gateway/instance-0.env").read_text()
    assert not list((single / "etc/systemd/system").glob("*.d"))
    for args, message in ((["--replicas-per-gpu", "2"], "--replicas-per-gpu needs --gpus N"),
                          (["--gpus", "1", "--replicas-per-gpu", "0"], "--replicas-per-gpu needs a number >= 1")):
        bad = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), *args], capture_output=True, text=True,
                             env={**os.environ, "DESTDIR": str(tmp_path / "bad")}, timeout=60)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
        assert not (tmp_path / "bad").exists()
