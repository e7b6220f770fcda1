"""What an in-place weight swap may load: the model directory's identity, read without the weights.

An in-place reload (`reload.strategy: in-place`) keeps the running engine, its KV cache and its
tokenizer, and only copies new tensors into the loaded model. So the new directory must hold the
same model with other values:
- every field of `ARCHITECTURE_FIELDS` in `config.json` (and in its `text_config`, where the model
  nests one) equal to the running model's;
- the same safetensors tensors: names, shapes and dtypes, read from the files' headers;
- the same tokenizer files (`TOKENIZER_FILES`, byte for byte: the running tokenizer stays);
- the same engine profile, apart from `engine.model`.

Nothing here reads the tensors: a header is a few KiB at the start of each file. The fingerprint
shown in /admin/status and the metrics hashes the headers, the file sizes and a sample of each
file's data (`SAMPLES` blocks of `SAMPLE_BYTES`), so two versions of one architecture, whose
headers are equal, still get different fingerprints at the cost of ~1 MiB read per file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.settings import Settings

ARCHITECTURE_FIELDS = (
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
    "tie_word_embeddings", "rope_theta", "rope_scaling", "sliding_window", "layer_types",
    "num_kv_shared_layers", "hidden_size_per_layer_input", "torch_dtype", "dtype",
)
"""config.json fields an in-place swap must not change (a different value means another model)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")
"""Files of the tokenizer the running engine keeps; each must be equal (or absent) in both."""

logger = logging.getLogger("llm_gateway.weights")

SAMPLES = 16
SAMPLE_BYTES = 64 * 1024
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


class WeightsError(ValueError):
    """The directory cannot be swapped in place; the message names the first reason."""


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelFiles:
    """One model directory as an in-place swap sees it."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, Tensor]
    tokenizer: dict[str, str | None]  # file name -> sha256, None when absent
    fingerprint: str

    def identity(self) -> dict[str, str]:
        return {"path": str(self.path), "fingerprint": self.fingerprint}


def _read_header(path: Path) -> tuple[bytes, dict[str, Any]]:
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise WeightsError(f"{path.name}: not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw_len)
        if length > _MAX_HEADER_BYTES:
            raise WeightsError(f"{path.name}: not a safetensors file (header length {length})")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise WeightsError(f"{path.name}: unreadable safetensors header ({exc})") from None
    if len(raw) != length or not isinstance(header, dict):
        raise WeightsError(f"{path.name}: truncated safetensors header")
    return raw, header


def _sampled_digest(path: Path, digest: Any) -> None:
    size = path.stat().st_size
    digest.update(str(size).encode())
    with path.open("rb") as f:
        for i in range(SAMPLES):
            f.seek(size * i // SAMPLES)
            digest.update(f.read(SAMPLE_BYTES))


def _file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def read_model_files(model_dir: str | Path) -> ModelFiles:
    """The config, tensor table, tokenizer hashes and fingerprint of a local model directory."""
    path = Path(model_dir)
    if not path.is_dir():
        raise WeightsError(f"no model directory at {path}")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise WeightsError(f"{path}: no config.json") from None
    except ValueError as exc:
        raise WeightsError(f"{path}/config.json: not JSON ({exc})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors files")
    tensors: dict[str, Tensor] = {}
    digest = hashlib.sha256()
    for file in files:
        raw, header = _read_header(file)
        digest.update(file.name.encode() + raw)
        _sampled_digest(file, digest)
        for name, entry in header.items():
            if name != "__metadata__":
                tensors[name] = Tensor(str(entry.get("dtype")), tuple(entry.get("shape") or ()))
    tokenizer = {name: _file_sha256(path / name) for name in TOKENIZER_FILES}
    return ModelFiles(path.resolve(), config, tensors, tokenizer, digest.hexdigest()[:16])


def _architecture_difference(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> str | None:
    for key in ARCHITECTURE_FIELDS:
        if old.get(key) != new.get(key):
            return f"config.json {prefix}{key}: {old.get(key)!r} -> {new.get(key)!r}"
    old_text, new_text = old.get("text_config"), new.get("text_config")
    if isinstance(old_text, dict) or isinstance(new_text, dict):
        return _architecture_difference(old_text or {}, new_text or {}, prefix + "text_config.")
    return None


def model_difference(old: ModelFiles, new: ModelFiles) -> str | None:
    """The first difference that rules out an in-place swap from `old` to `new`, or None."""
    found = _architecture_difference(old.config, new.config)
    if found:
        return found
    for name in sorted(old.tensors.keys() | new.tensors.keys()):
        before, after = old.tensors.get(name), new.tensors.get(name)
        if before is None:
            return f"tensor {name}: not in the running model"
        if after is None:
            return f"tensor {name}: missing from the new weights"
        if before != after:
            return (f"tensor {name}: {before.dtype}{list(before.shape)} -> "
                    f"{after.dtype}{list(after.shape)}")
    for name, digest in old.tokenizer.items():
        if new.tokenizer.get(name) != digest:
            return f"tokenizer file {name} differs (the running tokenizer stays in an in-place reload)"
    return None


def profile_difference(old: Settings, new: Settings) -> str | None:
    """The first engine profile field other than `engine.model` that differs, or None."""
    before = old.engine.model_dump(exclude={"model"})
    after = new.engine.model_dump(exclude={"model"})
    for key in before:
        if before[key] != after.get(key):
            return f"engine.{key}: {before[key]!r} -> {after.get(key)!r}"
    if old.served_model_name != new.served_model_name:
        return f"served model name: {old.served_model_name!r} -> {new.served_model_name!r}"
    return None


def in_place_refusal(old: Settings, running: ModelFiles | None, new: Settings) -> tuple[str, ModelFiles | None]:
    """Why `new` cannot be swapped into the engine running `old` in place ('' when it can), and
    the new directory's files when they could be read."""
    hint = "; use reload.strategy drain-swap or blue-green for this change"
    changed = profile_difference(old, new)
    if changed:
        return f"in-place reload changes only the weights, but {changed}{hint}", None
    if new.engine.load_format == "dummy" or old.engine.load_format == "dummy":
        return f"in-place reload reads weights from disk, and engine.load_format is dummy{hint}", None
    if running is None:
        return f"in-place reload needs the running model's files, and {old.model_path()} is not a local directory{hint}", None
    try:
        candidate = read_model_files(new.model_path())
    except (WeightsError, OSError) as exc:
        return f"in-place reload: {exc}", None
    found = model_difference(running, candidate)
    if found:
        return f"in-place reload needs the same model with other weights, but {found}{hint}", candidate
    return "", candidate


def local_model_files(settings: Settings) -> ModelFiles | None:
    """The serving model's files, for /admin/status and in-place reloads (None: dummy weights,
    a hub id, or a directory that cannot be read; in-place reloads then say why they refuse)."""
    if settings.engine.load_format == "dummy":
        return None
    try:
        return read_model_files(settings.model_path())
    except (WeightsError, OSError) as exc:
        logger.debug("no local model files for %s: %s", settings.model_path(), exc)
        return None
