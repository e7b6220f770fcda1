"""Settings: YAML < env < CLI precedence, cross-field rules with clear messages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from server.settings import ConfigFileError, EngineProfile, Settings, load_settings
from server.settings.engine import detect_device
from server.settings.schema import DEFAULT_PROFILES, PROFILES_DIR

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return path


def test_shipped_profiles_load() -> None:
    for name in ("embedded-cpu.yaml", "gemma4-e2b-h200.yaml", "gemma4-e2b-h200-vllm-defaults.yaml"):
        settings = load_settings(ROOT / "configs" / name)
        assert settings.engine.max_num_seqs >= 1 and settings.engine.max_num_batched_tokens >= 1


def test_tuned_gpu_profile_values() -> None:
    s = load_settings(ROOT / "configs" / "gemma4-e2b-h200.yaml")
    assert s.engine.kv_sharing_fast_prefill is True
    assert s.engine.enforce_eager is False
    assert s.engine.enable_prefix_caching is False
    assert s.engine.gpu_memory_utilization == 0.90


def test_precedence_file_env_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "server: {port: 1111, host: 0.0.0.0}\nengine: {device: cpu, kv_cache_memory_bytes: 1024, max_model_len: 100}\n")
    assert load_settings(path).server.port == 1111
    monkeypatch.setenv("LLM_GATEWAY_SERVER__PORT", "2222")
    monkeypatch.setenv("LLM_GATEWAY_ENGINE__MAX_MODEL_LEN", "200")
    s = load_settings(path)
    assert (s.server.port, s.engine.max_model_len, s.server.host) == (2222, 200, "0.0.0.0")
    s = load_settings(path, server={"port": 3333})
    assert (s.server.port, s.engine.max_model_len) == (3333, 200)
    assert s.engine.kv_cache_memory_bytes == 1024  # untouched keys survive the nested merge


def test_config_from_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "server: {port: 4444}\nengine: {device: cpu, kv_cache_memory_bytes: 1}\n")
    monkeypatch.setenv("LLM_GATEWAY_CONFIG", str(path))
    assert load_settings().server.port == 4444


def test_unknown_key_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "engine: {device: cpu, kv_cache_memory_bytes: 1, max_num_seq: 8}\n")
    with pytest.raises(ValidationError, match="max_num_seq"):
        load_settings(path)


def test_missing_file() -> None:
    with pytest.raises(FileNotFoundError):
        load_settings("/nonexistent.yaml")


def test_no_config_is_the_shipped_profile_for_this_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """`llm-gateway serve` without --config serves what `make serve` serves on this machine."""
    monkeypatch.delenv("LLM_GATEWAY_CONFIG", raising=False)
    device = detect_device()
    assert load_settings().model_dump() == load_settings(ROOT / "configs" / DEFAULT_PROFILES[device]).model_dump()
    assert (PROFILES_DIR / DEFAULT_PROFILES[device]).resolve() == (ROOT / "configs" / DEFAULT_PROFILES[device]).resolve()


def test_every_profile_in_configs_ships_with_the_package() -> None:
    """server/profiles/ links each configs/*.yaml, so an installed gateway (and the engine-args check
    on both vLLM releases) has every profile the README lists."""
    shipped = {p.name: p.resolve() for p in PROFILES_DIR.glob("*.yaml")}
    assert shipped == {p.name: p.resolve() for p in (ROOT / "configs").glob("*.yaml")}


def test_the_replicas_profile_is_the_decode_profile_run_twice() -> None:
    """configs/gemma4-e2b-h200-replicas.yaml copies the decode profile (profiles have no includes):
    a change to one that misses the other fails here. The replicas share the GPU through CUDA MPS,
    and the first one takes up to 256 streams alone."""
    decode = yaml.safe_load((ROOT / "configs" / "gemma4-e2b-h200-decode.yaml").read_text())
    replicas = yaml.safe_load((ROOT / "configs" / "gemma4-e2b-h200-replicas.yaml").read_text())
    assert replicas.pop("server").pop("replicas") == 2
    assert replicas == {k: v for k, v in decode.items() if k != "server"}
    own = {"replicas", "cuda_mps", "replicas_fill_first"}
    assert load_settings(ROOT / "configs" / "gemma4-e2b-h200-replicas.yaml").server.model_dump(exclude=own) == \
        load_settings(ROOT / "configs" / "gemma4-e2b-h200-decode.yaml").server.model_dump(exclude=own)
    shipped = load_settings(ROOT / "configs" / "gemma4-e2b-h200-replicas.yaml").server
    assert shipped.cuda_mps and shipped.replicas_fill_first == 256


@pytest.mark.parametrize("content,why", [
    (b"server: {port: 1\x00}", "not valid YAML"),
    (b"engine: [1, 2\n", "not valid YAML (line 2, column 1)"),
    (b"- a\n- b\n", "must hold a mapping of sections"),
    (b"just words", "must hold a mapping of sections"),
    (b"\xff\xfe\x00", "not UTF-8 text"),
])
def test_unreadable_config_file_names_the_file_and_the_problem(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "profile.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigFileError, match=re.escape(why)) as info:
        load_settings(path)
    assert str(path) in str(info.value)


def test_config_that_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="not a regular file"):
        load_settings(tmp_path)


def test_fast_prefill_with_eagle_names_both_fields() -> None:
    with pytest.raises(ValidationError) as info:
        EngineProfile(device="gpu", kv_sharing_fast_prefill=True,
                      speculative_config={"method": "eagle3", "model": "x", "num_speculative_tokens": 2})
    message = str(info.value)
    assert "kv_sharing_fast_prefill" in message and "speculative_config" in message


def test_fast_prefill_with_ngram_is_allowed() -> None:
    EngineProfile(device="gpu", kv_sharing_fast_prefill=True,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_cpu_profile_needs_kv_cache_bytes() -> None:
    with pytest.raises(ValidationError, match="kv_cache_memory_bytes"):
        EngineProfile(device="cpu")
    EngineProfile(device="cpu", kv_cache_memory_bytes=1 << 30)


def test_fast_prefill_without_shared_layers_warns(tmp_path: Path) -> None:
    from server.settings.checks import profile_warnings

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    s = Settings(engine=EngineProfile(device="gpu", model=str(model), kv_sharing_fast_prefill=True))
    assert any("no KV-shared layers" in w for w in profile_warnings(s))
    (model / "config.json").write_text('{"text_config": {"num_kv_shared_layers": 20}}')
    assert not any("KV-shared" in w for w in profile_warnings(s))


def test_embedded_model_resolves_under_state_dir(tmp_path: Path) -> None:
    s = Settings(server={"state_dir": tmp_path}, engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1))
    assert s.model_path() == str((tmp_path / "models" / "smollm2-135m-instruct").resolve())


def test_every_field_is_documented() -> None:
    import ast
    import inspect

    import server.settings as mod
    import server.settings.engine as engine_mod

    tree = ast.parse(inspect.getsource(mod) + "\n" + inspect.getsource(engine_mod))
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert "EngineProfile" in classes
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in {"ServerSettings", "AuthSettings", "LimitSettings", "ReloadSettings", "EngineProfile", "Settings"}:
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), (
                        f"{node.name}.{stmt.target.id} has no docstring")  # type: ignore[union-attr]


def test_parallelism_is_checked_against_visible_gpus(tmp_path: Path) -> None:
    from server.settings.checks import check_parallelism, visible_gpus

    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}) == 2
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert visible_gpus({}, dev=tmp_path) == 2
    s = Settings(engine=EngineProfile(device="gpu", tensor_parallel_size=2, data_parallel_size=2))
    with pytest.raises(ValueError, match="tensor_parallel_size.*needs 4 GPUs, but 2"):
        check_parallelism(s, gpus=2)
    check_parallelism(s, gpus=4)
    check_parallelism(Settings(engine=EngineProfile(device="cpu", kv_cache_memory_bytes=1)), gpus=0)
