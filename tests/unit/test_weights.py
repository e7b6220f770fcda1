"""server.lifecycle.weights: what an in-place reload may swap, read from config.json and safetensors headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from server.lifecycle.weights import (
    WeightsError,
    in_place_refusal,
    model_difference,
    profile_difference,
    read_model_files,
)
from server.settings import EngineProfile, ReloadSettings, Settings

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4,
          "num_hidden_layers": 1, "vocab_size": 8, "transformers_version": "5.0"}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A real safetensors file, written by hand: 8-byte header length, JSON header, data."""
    header, data = {}, b""
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def model_dir(root: Path, name: str, *, fill: int = 1, config: dict | None = None,
              tensors: dict | None = None, tokenizer: str = '{"v": 1}') -> Path:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config or CONFIG))
    (d / "tokenizer.json").write_text(tokenizer)
    write_safetensors(d / "model.safetensors", tensors or {
        "embed.weight": ("F32", [8, 4], bytes([fill]) * 128),
        "norm.weight": ("F32", [4], bytes([fill]) * 16),
    })
    return d


def test_two_versions_of_one_model_match_and_have_different_fingerprints(tmp_path: Path) -> None:
    a = read_model_files(model_dir(tmp_path, "a", fill=1))
    b = read_model_files(model_dir(tmp_path, "b", fill=2))
    assert model_difference(a, b) is None
    assert a.fingerprint != b.fingerprint
    assert read_model_files(tmp_path / "a").fingerprint == a.fingerprint  # stable
    assert a.tensors["embed.weight"].shape == (8, 4)
    assert a.identity() == {"path": str((tmp_path / "a").resolve()), "fingerprint": a.fingerprint}


@pytest.mark.parametrize(("change", "expected"), [
    ({"config": {**CONFIG, "num_hidden_layers": 2}}, "config.json num_hidden_layers: 1 -> 2"),
    ({"config": {**CONFIG, "architectures": ["MistralForCausalLM"]}}, "config.json architectures"),
    ({"tensors": {"embed.weight": ("F32", [8, 4], b"\0" * 128)}}, "tensor norm.weight: missing from the new weights"),
    ({"tensors": {"embed.weight": ("F32", [8, 4], b"\0" * 128), "norm.weight": ("F32", [4], b"\0" * 16),
                  "extra.weight": ("F32", [1], b"\0" * 4)}}, "tensor extra.weight: not in the running model"),
    ({"tensors": {"embed.weight": ("F32", [4, 8], b"\0" * 128), "norm.weight": ("F32", [4], b"\0" * 16)}},
     "tensor embed.weight: F32[8, 4] -> F32[4, 8]"),
    ({"tensors": {"embed.weight": ("F16", [8, 4], b"\0" * 64), "norm.weight": ("F32", [4], b"\0" * 16)}},
     "tensor embed.weight: F32[8, 4] -> F16[8, 4]"),
    ({"tokenizer": '{"v": 2}'}, "tokenizer file tokenizer.json differs"),
])
def test_the_first_difference_is_named(tmp_path: Path, change: dict, expected: str) -> None:
    running = read_model_files(model_dir(tmp_path, "a"))
    other = read_model_files(model_dir(tmp_path, "b", **change))
    assert expected in (model_difference(running, other) or "")


def test_a_nested_text_config_is_compared_too(tmp_path: Path) -> None:
    nested = {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": {"hidden_size": 1536}}
    a = read_model_files(model_dir(tmp_path, "a", config=nested))
    b = read_model_files(model_dir(tmp_path, "b", config={**nested, "text_config": {"hidden_size": 2048}}))
    assert model_difference(a, b) == "config.json text_config.hidden_size: 1536 -> 2048"


def test_unreadable_directories_raise_weights_errors(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="no model directory"):
        read_model_files(tmp_path / "nowhere")
    d = model_dir(tmp_path, "a")
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no \\*.safetensors files"):
        read_model_files(d)
    (d / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(WeightsError, match="not a safetensors file"):
        read_model_files(d)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 50) + b"{")
    with pytest.raises(WeightsError, match="unreadable safetensors header|truncated"):
        read_model_files(d)
    (d / "config.json").unlink()
    with pytest.raises(WeightsError, match="no config.json"):
        read_model_files(d)


def settings(model: str, **engine: object) -> Settings:
    return Settings(engine=EngineProfile(model=model, device="cpu", kv_cache_memory_bytes=1,
                                         served_model_name="m", **engine),
                    reload=ReloadSettings(strategy="in-place"))


def test_only_engine_model_may_change(tmp_path: Path) -> None:
    assert profile_difference(settings("/a"), settings("/b")) is None
    assert profile_difference(settings("/a"), settings("/b", max_model_len=2048)) == "engine.max_model_len: None -> 2048"


def test_in_place_refusal_reasons(tmp_path: Path) -> None:
    a, b = model_dir(tmp_path, "a"), model_dir(tmp_path, "b", fill=3)
    running = read_model_files(a)
    reason, candidate = in_place_refusal(settings(str(a)), running, settings(str(b)))
    assert reason == "" and candidate is not None and candidate.path == b.resolve()
    reason, _ = in_place_refusal(settings(str(a)), running, settings(str(b), max_num_seqs=8))
    assert "engine.max_num_seqs" in reason and "drain-swap or blue-green" in reason
    reason, _ = in_place_refusal(settings(str(a)), running, settings(str(tmp_path / "missing")))
    assert "no model directory" in reason
    reason, _ = in_place_refusal(settings(str(a), load_format="dummy"), None, settings(str(b), load_format="dummy"))
    assert "load_format is dummy" in reason
