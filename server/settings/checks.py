"""Profile checks that need to look at files (the model's config), run before the engine starts.

Hard rules live in `server.settings` (they fail validation); these only warn.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from server.settings import Settings


def _kv_shared_layers(config: dict[str, Any]) -> int | None:
    for section in (config, config.get("text_config") or {}):
        if "num_kv_shared_layers" in section:
            return int(section["num_kv_shared_layers"] or 0)
    return None


def visible_gpus(environ: dict[str, str] | None = None, dev: Path = Path("/dev")) -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else the NVIDIA device nodes."""
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        return len([d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip() and d.strip() != "-1"])
    return len([p for p in dev.glob("nvidia[0-9]*") if p.name[6:].isdigit()])


def check_parallelism(settings: Settings, gpus: int | None = None) -> None:
    """Refuse a profile that needs more GPUs than are visible, before any engine starts."""
    engine = settings.engine
    needed = engine.tensor_parallel_size * engine.data_parallel_size
    if engine.resolved_device() != "gpu" or needed == 1:
        return
    have = visible_gpus() if gpus is None else gpus
    if needed > have:
        raise ValueError(
            f"engine.tensor_parallel_size ({engine.tensor_parallel_size}) x engine.data_parallel_size "
            f"({engine.data_parallel_size}) needs {needed} GPUs, but {have} are visible "
            "(CUDA_VISIBLE_DEVICES / /dev/nvidia*)."
        )


def profile_warnings(settings: Settings) -> list[str]:
    warnings: list[str] = []
    engine = settings.engine
    config_path = Path(settings.model_path()) / "config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except ValueError:
            warnings.append(f"{config_path} is not valid JSON")
    if engine.kv_sharing_fast_prefill:
        shared = _kv_shared_layers(config) if config else None
        if config and not shared:
            warnings.append(
                "engine.kv_sharing_fast_prefill is on but the model has no KV-shared layers "
                f"(num_kv_shared_layers={shared}); it only costs (vLLM falls back to the V1 "
                "model runner) and gains nothing here."
            )
    if engine.enforce_eager and engine.resolved_device() == "gpu":
        warnings.append("engine.enforce_eager is on: no CUDA graphs, decode is several times slower.")
    return warnings
