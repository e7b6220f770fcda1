"""The keys file, the settings rules around it, and the max_tokens reservation rule."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from server.settings import EngineProfile, Settings, load_settings
from server.tenants.keys import DEFAULT_TENANT, KeysFileError, load_directory, load_keys_file
from server.tenants.reservation import reserved_tokens

ROOT = Path(__file__).resolve().parents[2]
CPU = {"engine": EngineProfile(device="cpu", kv_cache_memory_bytes=1)}


def keys_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return path


GOOD = f"""
tenants:
  acme:
    keys: [sk-acme-1, "sha256:{hashlib.sha256(b'sk-acme-2').hexdigest()}"]
    requests_per_minute: 600
    tokens_per_minute: 100000
    monthly_tokens: 5000000
  research:
    keys: [sk-research]
  default:
    requests_per_minute: 10
"""


def test_directory_maps_plain_and_hashed_keys_to_tenants(tmp_path: Path) -> None:
    directory = load_directory(keys_file(tmp_path, GOOD), ["sk-inline"], ["sk-admin"])
    assert directory.lookup(b"sk-acme-1").name == "acme"
    assert directory.lookup(b"sk-acme-2").name == "acme"  # written as its SHA-256 in the file
    assert directory.lookup(b"sk-research").limits.any is False
    inline = directory.lookup(b"sk-inline")
    assert inline.name == DEFAULT_TENANT and inline.limits.requests_per_minute == 10  # auth.api_keys
    assert directory.lookup(b"sk-acme") is None and directory.lookup(b"sk-admin") is None
    acme = directory.tenants["acme"].limits
    assert (acme.requests_per_minute, acme.tokens_per_minute, acme.monthly_tokens) == (600, 100000, 5000000)
    assert not directory.open
    assert load_directory(None, [], []).open  # no key anywhere: the API is open


@pytest.mark.parametrize("text, problem", [
    ("tenants: [a, b]", "tenants: Input should be a valid dictionary"),
    ("- just a list", "must be a mapping with a `tenants:` section"),
    ("tenants:\n  acme: {keys: [k1], requests_per_minute: 0}", "tenants.acme.requests_per_minute"),
    ("tenants:\n  acme: {keys: [k1], tokens_per_min: 5}", "tenants.acme.tokens_per_min: Extra inputs"),
    ("tenants:\n  'a b': {keys: [k1]}", "tenant name 'a b'"),
    ("tenants:\n  acme: {keys: ['has space']}", "printable ASCII without spaces"),
    ("tenants:\n  acme: {keys: ['sha256:abc']}", "64 lower-case hex digits"),
    ("tenants:\n  a: {keys: [k1]}\n  b: {keys: [k1]}", "tenants 'a' and 'b' share a key"),
    ("tenants: {a: {keys: [k1]}\n", "not valid YAML"),
])
def test_bad_keys_files_say_what_is_wrong(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(KeysFileError, match="keys file .*keys.yaml") as caught:
        load_keys_file(keys_file(tmp_path, text))
    assert problem in str(caught.value)


def test_settings_check_the_keys_file_before_any_engine_loads(tmp_path: Path) -> None:
    path = keys_file(tmp_path, GOOD)
    settings = Settings(tenants={"keys_file": path}, **CPU)
    assert settings.tenants.usage_path(Path("/srv/state")) == Path("/srv/state/usage.sqlite3")
    with pytest.raises(ValidationError, match="tenants.keys_file: keys file .* cannot be read"):
        Settings(tenants={"keys_file": tmp_path / "missing.yaml"}, **CPU)
    with pytest.raises(ValidationError, match="tenant 'acme' has a key that is also an admin key"):
        Settings(tenants={"keys_file": path}, auth={"admin_keys": ["sk-acme-1"]}, **CPU)
    with pytest.raises(ValidationError, match="also in auth.api_keys"):
        Settings(tenants={"keys_file": path}, auth={"api_keys": ["sk-research"]}, **CPU)
    with pytest.raises(ValidationError, match="tenants.limiter is `redis` but tenants.redis_url is not set"):
        Settings(tenants={"limiter": "redis"}, **CPU)
    with pytest.raises(ValidationError, match="on_redis_error"):
        Settings(tenants={"on_redis_error": "ignore"}, **CPU)


def test_cli_and_env_reach_the_tenant_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = keys_file(tmp_path, GOOD)
    monkeypatch.setenv("LLM_GATEWAY_TENANTS__LIMITER", "redis")
    monkeypatch.setenv("LLM_GATEWAY_TENANTS__REDIS_URL", "redis://:secret@127.0.0.1:6390/2")
    settings = load_settings(ROOT / "configs" / "embedded-cpu.yaml", tenants={"keys_file": str(path)})
    assert settings.tenants.keys_file == path and settings.tenants.limiter == "redis"
    shown = subprocess.run(
        [sys.executable, "-m", "server", "check-config", "-c", str(ROOT / "configs" / "embedded-cpu.yaml"),
         "--keys-file", str(path)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert '"keys_file": "' + str(path) in shown.stdout
    assert "secret" not in shown.stdout and "redis://***@127.0.0.1:6390/2" in shown.stdout
    (tmp_path / "broken").mkdir()
    broken = keys_file(tmp_path / "broken", "tenants:\n  acme: {keys: [k], monthly_tokens: -1}")
    refused = subprocess.run(
        [sys.executable, "-m", "server", "check-config", "-c", str(ROOT / "configs" / "embedded-cpu.yaml"),
         "--keys-file", str(broken)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert refused.returncode != 0
    assert "tenants.acme.monthly_tokens: Input should be greater than or equal to 1" in refused.stderr


# -- the max_tokens rule ---------------------------------------------------------------------------


def test_reservation_is_prompt_plus_max_tokens_times_n() -> None:
    # token-id prompts are counted exactly, text as characters / 4 rounded up
    assert reserved_tokens({"prompt": [1, 2, 3], "max_tokens": 10}, False, 128) == 13
    assert reserved_tokens({"prompt": "x" * 9, "max_tokens": 10}, False, 128) == 3 + 10
    assert reserved_tokens({"prompt": [1, 2, 3], "max_tokens": 10, "n": 3}, False, 128) == 3 + 30
    assert reserved_tokens({"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 4, "n": 2}, False, 128) == 2 + 8 + 3 + 8
    # no max_tokens: the engine may fill the context, so the whole context is reserved
    assert reserved_tokens({"prompt": [1] * 28}, False, 128) == 128
    assert reserved_tokens({"prompt": [1] * 28, "n": 2}, False, 128) == 28 + 200
    # max_tokens beyond the room left is clamped to it, as vLLM does
    assert reserved_tokens({"prompt": [1] * 28, "max_tokens": 1000}, False, 128) == 128


def test_chat_reservation_and_unreadable_bodies() -> None:
    body = {"messages": [{"role": "system", "content": "x" * 8},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 4}]}],
            "max_completion_tokens": 20, "max_tokens": 99}
    assert reserved_tokens(body, True, 1000) == 3 + (3 + 2) + (3 + 1) + 20  # max_completion_tokens wins
    assert reserved_tokens({**body, "max_completion_tokens": None}, True, 1000) == 12 + 99
    # invalid values are refused by validation later; they reserve no completion here
    for bad in ({"prompt": [1, 2], "max_tokens": -5}, {"prompt": [1, 2], "max_tokens": True},
                {"prompt": [1, 2], "max_tokens": "10"}):
        assert reserved_tokens(bad, False, None) == 2
    assert reserved_tokens(None, False, 128) == 0 and reserved_tokens([1, 2], False, 128) == 0
    assert reserved_tokens({"messages": "hi"}, True, 128) == 0
    # no engine yet (context unknown): only what the body names
    assert reserved_tokens({"prompt": [1, 2], "max_tokens": 5}, False, None) == 7
