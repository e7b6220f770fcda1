"""The `engine` section of the settings (`EngineProfile`): what vLLM's engine is built from.

A section of the one settings model (`server.settings.schema.Settings.engine`), in a module of
its own because it is the largest and the one engine profiles are about.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

EMBEDDED_MODEL = "embedded"
"""The `engine.model` value that means the SmolLM2 model prepared under the state directory."""

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"
"""Where a bare `engine.chat_template` file name is looked up."""

# EAGLE-family drafters read hidden states of every layer; vLLM refuses them with fast prefill.
_EAGLE_METHODS = {"eagle", "eagle3", "mtp"}


def detect_device() -> Literal["cpu", "gpu"]:
    """`gpu` when an NVIDIA device node exists, else `cpu`."""
    return "gpu" if Path("/dev/nvidiactl").exists() else "cpu"



class EngineProfile(BaseModel):
    """The engine profile: every field maps onto vLLM's ``AsyncEngineArgs``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = EMBEDDED_MODEL
    """Model directory or hub id; ``embedded`` means the SmolLM2 model from `llm-gateway prepare-model`."""

    served_model_name: str | None = None
    """Name clients send as `model`; defaults to the model directory's name."""

    tokenizer: str | None = None
    """Tokenizer directory or hub id, when it differs from `model`."""

    device: Literal["auto", "cpu", "gpu"] = "auto"
    """Which build of vLLM this profile is for; `auto` looks for an NVIDIA device node."""

    dtype: str = "auto"
    """Weight and activation dtype (auto, bfloat16, float16, float32)."""

    max_model_len: int | None = Field(None, ge=1)
    """Context length (prompt + completion tokens); None takes the model's own."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of GPU memory vLLM may take for weights, activations and KV cache."""

    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    """KV cache size in bytes; overrides gpu_memory_utilization. Required on CPU."""

    enforce_eager: bool = False
    """True disables torch.compile and CUDA graphs (faster start, slower decode)."""

    compilation_config: dict[str, Any] | None = None
    """vLLM compilation config (cudagraph_mode, cudagraph_capture_sizes, mode, ...)."""

    enable_prefix_caching: bool | None = None
    """Automatic prefix caching; None keeps vLLM's default (on)."""

    kv_sharing_fast_prefill: bool = False
    """Skip prefill compute of KV-shared layers (Gemma 3n/4). Breaks prompt logprobs."""

    max_num_seqs: int = Field(256, ge=1)
    """Most sequences scheduled in one step. Always passed: the in-process default is far lower."""

    max_num_batched_tokens: int = Field(8192, ge=1)
    """Most tokens scheduled in one step. Always passed: the in-process default is far lower."""

    attention_backend: str | None = None
    """Force an attention backend (e.g. TRITON_ATTN, FLASH_ATTN); None lets vLLM choose."""

    load_format: str = "auto"
    """Weight loading format; `dummy` gives real shapes with random weights (benchmarks)."""

    seed: int = 0
    """Engine seed for sampling without a per-request seed."""

    async_scheduling: bool | None = None
    """vLLM's asynchronous scheduling (overlaps scheduling with the forward pass); None = vLLM default."""

    speculative_config: dict[str, Any] | None = None
    """Speculative decoding config, passed through (method, model, num_speculative_tokens)."""

    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one model copy is split over (vLLM tensor parallelism)."""

    data_parallel_size: int = Field(1, ge=1)
    """Model copies inside this engine (vLLM data parallelism); needs tp x dp visible GPUs."""

    distributed_executor_backend: Literal["mp", "uni", "ray", "external_launcher"] | None = None
    """How vLLM runs its workers: `mp` (processes, the default for >1 GPU), `uni` (in the engine
    process; saves a process start on one device), `ray` (a Ray cluster)."""

    max_logprobs: int = Field(20, ge=0)
    """Most logprobs a request may ask for."""

    chat_template: str | None = None
    """Chat template file replacing the model's: a bare file name is looked up in `server/templates/`."""

    tool_call_parser: str | None = None
    """vLLM tool parser (e.g. hermes) for `tool_choice` auto; None refuses auto (400)."""

    reasoning_parser: str | None = None
    """vLLM reasoning parser (e.g. gemma4) that splits the model's reasoning from its content
    (the message's `reasoning` field, as `vllm serve --reasoning-parser`); None: all content.
    The name is checked against vLLM's before the model loads."""

    extra_engine_args: dict[str, Any] = Field(default_factory=dict)
    """Any other `AsyncEngineArgs` field, passed through as is (checked against vLLM at start)."""

    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set before vLLM is imported (e.g. VLLM_CPU_NUM_OF_RESERVED_CPU)."""

    def chat_template_path(self) -> Path | None:
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        return path if path.is_absolute() or path.parent != Path(".") else TEMPLATES_DIR / path

    def resolved_device(self) -> Literal["cpu", "gpu"]:
        return self.device if self.device != "auto" else detect_device()

    @model_validator(mode="after")
    def _cross_field_rules(self) -> EngineProfile:
        if self.kv_sharing_fast_prefill and self.speculative_config:
            method = str(self.speculative_config.get("method", "")).lower()
            if method in _EAGLE_METHODS or "eagle" in method:
                raise ValueError(
                    "engine.kv_sharing_fast_prefill cannot be combined with "
                    f"engine.speculative_config method {method!r}: vLLM rejects EAGLE-style "
                    "speculative decoding with fast prefill. Turn one of them off."
                )
        if (template := self.chat_template_path()) is not None and not template.is_file():
            raise ValueError(f"engine.chat_template: no file at {template}.")
        if self.resolved_device() == "cpu" and self.kv_cache_memory_bytes is None:
            raise ValueError(
                "engine.kv_cache_memory_bytes is required for a CPU profile: vLLM's CPU "
                "memory probe misreads these machines, so the KV cache size must be explicit "
                "(e.g. 1073741824 for 1 GiB)."
            )
        return self
