"""The keys file, the settings rules around it, `llm-gateway keys add` / `usage`, the usage file's
opening, and the max_tokens reservation rule."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.settings import EngineProfile, Settings, load_settings
from server.settings.keys_file import UNNAMED, KeysFileError, load_keys_file
from server.tenants.directory import load_directory
from server.tenants.reservation import reserved_tokens
from server.tenants.usage import SCHEMA, UPSERT, open_usage_db

ROOT = Path(__file__).resolve().parents[2]
CPU = {"engine": EngineProfile(device="cpu", kv_cache_memory_bytes=1)}


def keys_file(tmp_path: Path, text: str, name: str = "keys.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "server", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, **(env or {})})


GOOD = f"""
keys:
  - name: team-a
    key: "sha256:{hashlib.sha256(b'sk-a-1').hexdigest()}"
    requests_per_minute: 600
    tokens_per_minute: 100000
    max_concurrent: 8
    budget_tokens: 5000000
    budget_period: day
    models: [smollm2-135m-instruct]
    share: 3
  - name: team-b
    key: [sk-b-plain, "sha256:{hashlib.sha256(b'sk-b-2').hexdigest()}"]
"""


def test_directory_maps_hashed_and_plain_keys_to_named_tenants(tmp_path: Path) -> None:
    directory = load_directory(keys_file(tmp_path, GOOD), ["sk-inline"], ["sk-admin"])
    a = directory.lookup(b"sk-a-1")
    assert a.name == "team-a" and a.limits.budget_period == "day" and a.limits.models == ["smollm2-135m-instruct"]
    assert (a.limits.requests_per_minute, a.limits.tokens_per_minute, a.limits.max_concurrent,
            a.limits.budget_tokens) == (600, 100000, 8, 5000000)
    assert a.limits.share == 3 and directory.lookup(b"sk-b-2").limits.share == 1  # a weight, not a limit
    assert not directory.lookup(b"sk-b-2").limits.any
    assert directory.lookup(b"sk-b-plain").name == directory.lookup(b"sk-b-2").name == "team-b"
    assert directory.plain_key_names == ["team-b"]  # warned about at start
    # --api-key keys keep working: unlimited and unnamed
    inline = directory.lookup(b"sk-inline")
    assert inline.name == UNNAMED and not inline.limits.any and inline.limits.models is None
    assert directory.lookup(b"sk-a-") is None and directory.lookup(b"sk-admin") is None
    assert not directory.open and load_directory(None, [], []).open


@pytest.mark.parametrize("text, problem", [
    ("keys: {a: b}", "keys: Input should be a valid list"),
    ("- just a list", "must be a mapping with a `keys:` list"),
    ("keys:\n  - {name: a, key: k1, requests_per_minute: 0}", "keys[0] (a).requests_per_minute: Input should be greater"),
    ("keys:\n  - {name: a, key: k1, tokens_per_min: 5}", "keys[0] (a).tokens_per_min: Extra inputs are not permitted"),
    ("keys:\n  - {name: a, key: k1, share: 0}", "keys[0] (a).share: Input should be greater than 0"),
    ("keys:\n  - {name: a, key: k1, budget_period: week}", "keys[0] (a).budget_period: Input should be 'day' or 'month'"),
    ("keys:\n  - {name: 'a b', key: k1}", "keys[0] (a b).name: letters, digits"),
    ("keys:\n  - {name: unnamed, key: k1}", "'unnamed' is reserved"),
    ("keys:\n  - {name: a}", "keys[0] (a).key: Field required"),
    ("keys:\n  - {name: a, key: 'has space'}", "printable ASCII without spaces"),
    ("keys:\n  - {name: a, key: 'sha256:abc'}", "64 lower-case hex digits"),
    ("keys:\n  - {name: a, key: k1}\n  - {name: b, key: k1}", "entries 'a' and 'b' share a key"),
    ("keys:\n  - {name: a, key: k1}\n  - {name: a, key: k2}", "two entries are named 'a'"),
    ("keys: [{name: a, key: k1}\n", "not valid YAML"),
])
def test_bad_keys_files_say_what_is_wrong(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(KeysFileError, match="keys file .*keys.yaml") as caught:
        load_keys_file(keys_file(tmp_path, text))
    assert problem in str(caught.value)


def test_settings_check_the_keys_file_before_any_engine_loads(tmp_path: Path) -> None:
    path = keys_file(tmp_path, GOOD)
    settings = Settings(auth={"keys_file": path}, **CPU)
    assert settings.auth.usage_path(Path("/srv/state")) == Path("/srv/state/usage.sqlite3")
    with pytest.raises(ValidationError, match="auth.keys_file: keys file .* cannot be read"):
        Settings(auth={"keys_file": tmp_path / "missing.yaml"}, **CPU)
    with pytest.raises(ValidationError, match="the key of 'team-b' is also an admin key"):
        Settings(auth={"keys_file": path, "admin_keys": ["sk-b-plain"]}, **CPU)
    with pytest.raises(ValidationError, match="the key of 'team-a' is also in auth.api_keys"):
        Settings(auth={"keys_file": path, "api_keys": ["sk-a-1"]}, **CPU)
    with pytest.raises(ValidationError, match="auth.redis_url shares tenant limits, but no auth.keys_file"):
        Settings(auth={"redis_url": "redis://127.0.0.1:6379/0"}, **CPU)


def test_cli_and_env_reach_the_auth_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = keys_file(tmp_path, GOOD)
    config = str(ROOT / "configs" / "embedded-cpu.yaml")
    monkeypatch.setenv("LLM_GATEWAY_AUTH__REDIS_URL", "redis://:secret@127.0.0.1:6390/2")
    settings = load_settings(config, auth={"keys_file": str(path)})
    assert settings.auth.keys_file == path and settings.auth.redis_url.endswith(":6390/2")
    shown = cli("check-config", "-c", config, "--keys-file", str(path))
    assert shown.returncode == 0, shown.stderr
    assert '"keys_file": "' + str(path) in shown.stdout
    assert "secret" not in shown.stdout and "redis://***@127.0.0.1:6390/2" in shown.stdout
    broken = keys_file(tmp_path, "keys:\n  - {name: a, key: k, budget_tokens: -1}", "broken.yaml")
    refused = cli("check-config", "-c", config, "--keys-file", str(broken))
    assert refused.returncode != 0
    assert "keys[0] (a).budget_tokens: Input should be greater than or equal to 1" in refused.stderr


def test_keys_add_prints_a_key_once_and_writes_its_hash(tmp_path: Path) -> None:
    path = keys_file(tmp_path, "# the teams of this host\nkeys:\n  - name: first  # kept\n    key: sk-first\n")
    added = cli("keys", "add", "team-b", "--keys-file", str(path), "--requests-per-minute", "60",
                "--budget-tokens", "1000", "--budget-period", "day", "--model", "m1", "--model", "m2",
                "--share", "2.5")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    assert key.startswith("sk-") and len(key) > 40 and key not in path.read_text()
    assert "# the teams of this host" in path.read_text() and "# kept" in path.read_text()  # appended
    directory = load_directory(path, [], [])
    tenant = directory.lookup(key.encode())
    assert tenant.name == "team-b" and tenant.limits.requests_per_minute == 60
    assert tenant.limits.budget_tokens == 1000 and tenant.limits.budget_period == "day"
    assert tenant.limits.models == ["m1", "m2"] and tenant.limits.share == 2.5
    # an existing name gets a second key; both work
    second = cli("keys", "add", "team-b", "--keys-file", str(path))
    assert second.returncode == 0 and "second key" in second.stderr
    directory = load_directory(path, [], [])
    assert directory.lookup(key.encode()).name == directory.lookup(second.stdout.strip().encode()).name == "team-b"
    # limits of an existing name are changed in the file, not here; a new file is created
    assert cli("keys", "add", "team-b", "--keys-file", str(path), "--max-concurrent", "2").returncode != 0
    fresh = tmp_path / "new" / "keys.yaml"
    fresh.parent.mkdir()
    made = cli("keys", "add", "solo", env={"LLM_GATEWAY_AUTH__KEYS_FILE": str(fresh)})
    assert made.returncode == 0 and load_directory(fresh, [], []).lookup(made.stdout.strip().encode()).name == "solo"
    assert oct(fresh.stat().st_mode & 0o777) == "0o640"
    assert cli("keys", "add", "x y", "--keys-file", str(fresh)).returncode != 0  # refused, file untouched
    assert list(load_keys_file(fresh).keys)[0].name == "solo" and len(load_keys_file(fresh).keys) == 1


def test_usage_prints_a_table(tmp_path: Path) -> None:
    db = tmp_path / "usage.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.execute(SCHEMA)
        conn.executemany(UPSERT, [("a", "2026-11-30", 3, 1, 30, 60, 0, 0), ("a", "2026-12-01", 2, 0, 20, 40, 1, 250),
                                  ("b", "2026-12-01", 1, 0, 5, 5, 0, 0)])
    shown = cli("usage", "--usage-db", str(db), "--from", "2026-12-01")
    assert shown.returncode == 0, shown.stderr
    lines = [line.split() for line in shown.stdout.splitlines()]
    assert lines[0] == ["tenant", "day", "requests", "errors", "prompt_tokens", "completion_tokens", "total_tokens",
                        "queued", "queue_ms"]
    assert ["a", "2026-12-01", "2", "0", "20", "40", "60", "1", "250"] in lines
    assert ["b", "total", "1", "0", "5", "5", "10", "0", "0"] in lines
    assert not any(line[1] == "2026-11-30" for line in lines[1:])
    only = cli("usage", "--usage-db", str(db), "--tenant", "a", "--to", "2026-11-30").stdout.splitlines()
    assert [line.split()[:3] for line in only[1:]] == [["a", "2026-11-30", "3"], ["a", "total", "3"]]
    assert cli("usage", "--usage-db", str(db), "--from", "yesterday").returncode != 0
    assert cli("usage", "--usage-db", str(tmp_path / "none.sqlite3")).returncode == 1


def test_usage_file_opens_when_instances_start_at_once(tmp_path: Path) -> None:
    # Two gateways on one new file raced to switch it to WAL, and SQLite's immediate "database is
    # locked" stopped one at startup (CI, stop 30). Without the retry, 4 openers lose ~7% of rounds.
    for round_ in range(60):
        path = tmp_path / f"usage-{round_}.sqlite3"
        start, errors = threading.Barrier(4), []

        def open_one(path: Path = path, start: threading.Barrier = start, errors: list = errors) -> None:
            start.wait()
            try:
                db = open_usage_db(path)
                db.execute(UPSERT, ("a", "2026-12-03", 1, 0, 2, 3, 0, 0))
                db.close()
            except sqlite3.Error as exc:
                errors.append(exc)

        openers = [threading.Thread(target=open_one) for _ in range(4)]
        for opener in openers:
            opener.start()
        for opener in openers:
            opener.join()
        assert errors == [], f"round {round_}"
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            assert conn.execute("SELECT requests, prompt_tokens + completion_tokens FROM usage").fetchall() == [(4, 20)]


@pytest.mark.timing
def test_usage_file_gives_up_on_other_errors_at_once_and_on_a_held_lock_in_time(tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        open_usage_db(tmp_path)  # a directory, not a file: not worth a retry
    assert time.monotonic() - began < 1.0
    path = tmp_path / "usage.sqlite3"
    open_usage_db(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA journal_mode=DELETE")
    holder.execute("BEGIN EXCLUSIVE")  # another process holding the file past the timeout
    try:
        began = time.monotonic()
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            open_usage_db(path, timeout_s=0.5)
        assert 0.4 < time.monotonic() - began < 5.0
    finally:
        holder.execute("ROLLBACK")
        holder.close()


# -- the max_tokens rule ---------------------------------------------------------------------------


def test_reservation_is_prompt_plus_max_tokens_times_n() -> None:
    # (prompt tokens, max_tokens) per prompt, n completions each; serving passes the exact counts
    assert reserved_tokens([(3, 10)]) == 13
    assert reserved_tokens([(3, 10)], 3) == 3 + 30
    assert reserved_tokens([(2, 4), (3, 4)], 2) == 2 + 8 + 3 + 8
    assert reserved_tokens([]) == 0
