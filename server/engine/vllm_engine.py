"""`VllmEngine`: vLLM's `AsyncLLM` behind the `Engine` Protocol.

vLLM is imported lazily inside `VllmEngine.start` (and the methods that need its types), so
importing the gateway has no side effects and unit tests can pass a fake engine. Differences
between the supported vLLM releases live in `server.engine.compat`, not here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from server.engine import compat, reasoning_parsing, tool_parsing, worker_extension
from server.engine.runtime import engine_args_kwargs, prepare_engine_environment, run_abandonable
from server.engine.types import (
    ChoiceOutput,
    EngineInfo,
    EngineProgress,
    GenerationOutput,
    SamplingOptions,
    TokenLogprob,
    TopLogprob,
)
from server.errors import (
    EngineDeadError,
    GatewayError,
    InternalError,
    InvalidRequestError,
    ServiceUnavailableError,
)
from server.settings import Settings
from server.settings.checks import check_parallelism

logger = logging.getLogger("llm_gateway.engine")

# An abort reaches the engine core over a socket; a stalled core must not hold up the caller.
ABORT_TIMEOUT_S = 5.0

_stop_signalled = threading.Event()


def note_stop_signal() -> None:
    """A stop signal arrived: from now on the engine core may exit on its own.

    A terminal's Ctrl-C (and any signal sent to the process group) reaches vLLM's engine
    processes too, and they stop at once, before the gateway has drained and stopped the
    engine in order. `AsyncLLM`'s output handler then sees the core die and would log
    `EngineDeadError` at ERROR with a traceback, for a stop the operator asked for.
    """
    _stop_signalled.set()


class _CoreExitOnStopSignal(logging.Filter):
    """Turns the output handler's EngineDeadError traceback into one INFO line once a stop
    signal arrived; an engine that dies while serving is still logged as the error it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        if _stop_signalled.is_set() and record.exc_info and isinstance(record.exc_info[1], VllmEngineDead):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = "the engine core exited during shutdown (the stop signal reached it too): %s"
            record.args = (record.exc_info[1],)
            record.exc_info, record.exc_text = None, None
        return True


def _install_core_exit_filter() -> None:
    # vLLM 0.26 and 0.32 both log from AsyncLLM's module logger.
    vllm_logger = logging.getLogger("vllm.v1.engine.async_llm")
    if not any(isinstance(f, _CoreExitOnStopSignal) for f in vllm_logger.filters):
        vllm_logger.addFilter(_CoreExitOnStopSignal())


def check_parser_names(settings: Settings) -> None:
    """Raise ValueError naming the choices when the profile names a tool or reasoning parser
    that vLLM does not register."""
    for setting, kind, name, registered in (
        ("engine.tool_call_parser", "tool parser", settings.engine.tool_call_parser,
         tool_parsing.available_tool_parsers),
        ("engine.reasoning_parser", "reasoning parser", settings.engine.reasoning_parser,
         reasoning_parsing.available_reasoning_parsers),
    ):
        if name and name not in (names := registered()):
            raise ValueError(f"{setting}: vLLM has no {kind} {name!r}; available: {', '.join(names)}.")


def _to_token_logprob(token_id: int, position: Any, limit: int) -> TokenLogprob:
    # vLLM returns the chosen token first, then the top-k; OpenAI wants at most k+1 entries.
    candidates = []
    for i, (cand_id, lp) in enumerate(position.items()):
        if i > limit:
            break
        candidates.append(TopLogprob(cand_id, lp.decoded_token or "", max(lp.logprob, -9999.0)))
    chosen = position[token_id]
    return TokenLogprob(token_id, chosen.decoded_token or "", max(chosen.logprob, -9999.0), candidates)


class VllmEngine:
    """`AsyncLLM` behind the `Engine` Protocol."""

    def __init__(self, llm: Any, info: EngineInfo, tokenizer: Any, rpc_dir: Path, *, gateway_workers: bool = False,
                 chat_template: str | None = None):
        self._llm = llm
        self._gateway_workers = gateway_workers  # the workers have GatewayWorkerExtension's methods
        self.info = info
        self._tokenizer = tokenizer
        self._chat_template = chat_template  # the profile's `engine.chat_template`, else the model's
        self._rpc_dir = rpc_dir
        self._closed = False
        self._active: set[str] = set()
        self._aborted: dict[str, str] = {}  # request id -> why the gateway aborted it
        self._last_output = 0.0  # monotonic time of the engine core's last batch of outputs
        self._busy_since = 0.0  # when requests last became pending after an idle spell
        compat.watch_core_outputs(llm, self._note_output)

    def _note_output(self) -> None:
        self._last_output = time.monotonic()

    @classmethod
    async def start(cls, settings: Settings) -> VllmEngine:
        """Build and start `AsyncLLM` from the profile (blocking work runs in a thread)."""
        model_path = settings.model_path()
        if settings.engine.load_format != "dummy" and model_path.startswith(("/", ".")):
            if not Path(model_path).exists():
                hint = (
                    " Run `llm-gateway prepare-model` first."
                    if settings.engine.model == "embedded"
                    else ""
                )
                raise FileNotFoundError(f"engine.model: no model at {model_path}.{hint}")
        check_parallelism(settings)
        template_path = settings.engine.chat_template_path()
        chat_template = template_path.read_text() if template_path else None
        rpc_dir = prepare_engine_environment(settings)
        kwargs = engine_args_kwargs(settings)
        # The gateway's worker methods (in-place weight reloads); a profile that names its own
        # extension keeps it, and in-place reloads then use vLLM's plain reload_weights.
        kwargs.setdefault("worker_extension_cls", worker_extension.QUALNAME)

        def build() -> tuple[Any, str]:
            # Importing vLLM takes seconds: do it here, off the event loop.
            import vllm
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM

            check_parser_names(settings)  # refused before the model loads
            known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
            unknown = sorted(set(kwargs) - known)
            if unknown:
                raise ValueError(
                    f"vLLM {vllm.__version__} has no engine argument(s) {unknown}; remove "
                    "them from the profile (engine.extra_engine_args or the named fields)."
                )
            _install_core_exit_filter()
            logger.info("starting vLLM %s engine: %s", vllm.__version__, kwargs)
            args = AsyncEngineArgs(**kwargs)
            return AsyncLLM.from_engine_args(args, usage_context=UsageContext.OPENAI_API_SERVER), vllm.__version__

        def discard(started: tuple[Any, str]) -> None:
            started[0].shutdown()
            shutil.rmtree(rpc_dir, ignore_errors=True)

        try:
            llm, vllm_version = await run_abandonable(build, discard, name="vllm-engine-start")
        except BaseException:
            shutil.rmtree(rpc_dir, ignore_errors=True)
            raise
        try:
            tokenizer = llm.get_tokenizer()
            if inspect.isawaitable(tokenizer):
                tokenizer = await tokenizer
            model_config = llm.model_config
            info = EngineInfo(
                served_model_name=settings.served_model_name,
                model_path=model_path,
                max_model_len=int(model_config.max_model_len),
                vocab_size=int(model_config.get_vocab_size()),
                vllm_version=vllm_version,
                max_logprobs=int(getattr(model_config, "max_logprobs", settings.engine.max_logprobs)),
                kv_sharing_fast_prefill=settings.engine.kv_sharing_fast_prefill,
                default_sampling=dict(model_config.get_diff_sampling_param() or {}),
                tool_call_parser=settings.engine.tool_call_parser,
                reasoning_parser=settings.engine.reasoning_parser,
            )
        except BaseException:
            llm.shutdown()
            shutil.rmtree(rpc_dir, ignore_errors=True)
            raise
        return cls(llm, info, tokenizer, rpc_dir, chat_template=chat_template,
                   gateway_workers=kwargs["worker_extension_cls"] == worker_extension.QUALNAME)

    # -- tokenizer -----------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids))

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, continue_final_message: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return self._tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools or None,
            chat_template=self._chat_template,
        )

    def tool_parser(
        self, tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool | None,
        response_format: dict[str, Any] | None = None,
    ) -> tool_parsing.VllmToolCallParser:
        if not self.info.tool_call_parser:
            raise ValueError("no engine.tool_call_parser is configured")
        return tool_parsing.VllmToolCallParser(
            self.info.tool_call_parser, self._tokenizer, tools, tool_choice, parallel_tool_calls,
            response_format,
        )

    def tool_choice_schema(
        self, tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool | None
    ) -> dict[str, Any] | None:
        return tool_parsing.tool_choice_json_schema(tools, tool_choice, parallel_tool_calls)

    def reasoning_parser(self, prompt_token_ids: Sequence[int]) -> reasoning_parsing.VllmReasoningParser | None:
        if not self.info.reasoning_parser:
            return None
        return reasoning_parsing.VllmReasoningParser(self.info.reasoning_parser, self._tokenizer, prompt_token_ids)

    # -- generation ----------------------------------------------------------------------

    def make_sampling(self, options: SamplingOptions) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        kwargs: dict[str, Any] = {
            "n": options.n,
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "top_p": options.top_p,
            "top_k": options.top_k,
            "min_p": options.min_p,
            "presence_penalty": options.presence_penalty,
            "frequency_penalty": options.frequency_penalty,
            "repetition_penalty": options.repetition_penalty,
            "seed": options.seed,
            "stop": list(options.stop),
            "stop_token_ids": list(options.stop_token_ids),
            "min_tokens": options.min_tokens,
            "ignore_eos": options.ignore_eos,
            "logprobs": options.logprobs,
            "prompt_logprobs": options.prompt_logprobs,
            "skip_special_tokens": options.skip_special_tokens,
            "include_stop_str_in_output": options.include_stop_str_in_output,
            "logit_bias": options.logit_bias,
            "output_kind": RequestOutputKind.DELTA if options.stream else RequestOutputKind.FINAL_ONLY,
            # One fresh object per prompt, never shared, so AsyncLLM.add_request's deepcopy of it
            # (vLLM 0.26 and 0.32 alike; `vllm serve` skips it the same way) is waste on the event
            # loop, and a deepcopy per request shows in a profile of a busy gateway.
            "skip_clone": True,
        }
        try:
            if options.structured is not None:
                from vllm.sampling_params import StructuredOutputsParams

                kwargs["structured_outputs"] = StructuredOutputsParams(**options.structured)
            return SamplingParams(**kwargs)
        except compat.request_error_types() as exc:
            raise InvalidRequestError(str(exc), param=getattr(exc, "parameter", None)) from exc

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Any
    ) -> AsyncIterator[GenerationOutput]:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        if self._closed:
            raise ServiceUnavailableError("the engine is shutting down")
        limit_out = sampling.logprobs if sampling.logprobs is not None else 0
        limit_prompt = sampling.prompt_logprobs if sampling.prompt_logprobs is not None else 0
        stream = self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt_token_ids), sampling, request_id
        )
        finished = False
        if not self._active:
            self._busy_since = time.monotonic()
        self._active.add(request_id)
        try:
            async for out in stream:
                if request_id in self._aborted:
                    break
                finished = out.finished
                yield self._convert(out, limit_out, limit_prompt)
            if request_id in self._aborted:
                finished = True
                raise ServiceUnavailableError(self._aborted[request_id], headers={"Retry-After": "1"})
        except VllmEngineDead as exc:
            raise EngineDeadError(f"the engine died: {exc}") from exc
        except compat.request_error_types() as exc:
            raise InvalidRequestError(str(exc), param=getattr(exc, "parameter", None)) from exc
        except GatewayError:
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            if self._llm.errored:
                raise EngineDeadError(f"the engine died: {exc!r}") from exc
            raise InternalError(f"generation failed: {exc!r}") from exc
        finally:
            self._active.discard(request_id)
            self._aborted.pop(request_id, None)
            if not finished:
                await stream.aclose()
                await self.abort(request_id)

    def _convert(self, out: Any, limit_out: int, limit_prompt: int) -> GenerationOutput:
        choices = []
        for c in out.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = [
                    _to_token_logprob(tid, pos, limit_out)
                    for tid, pos in zip(c.token_ids, c.logprobs, strict=False)
                ]
            choices.append(
                ChoiceOutput(
                    index=c.index,
                    text=c.text,
                    token_ids=list(c.token_ids),
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        prompt_logprobs = None
        if out.prompt_logprobs is not None:
            prompt_logprobs = [
                TokenLogprob(tid, self._tokenizer.decode([tid]), None, None)
                if pos is None
                else _to_token_logprob(tid, pos, limit_prompt)
                for tid, pos in zip(out.prompt_token_ids, out.prompt_logprobs, strict=False)
            ]
        return GenerationOutput(
            request_id=out.request_id,
            # vLLM's own list, not a copy: every delta carries the whole prompt, and a copy per
            # token grows with the prompt on the event loop
            prompt_token_ids=out.prompt_token_ids or [],
            prompt_logprobs=prompt_logprobs,
            choices=choices,
            finished=out.finished,
        )

    async def abort(self, request_id: str) -> None:
        if self._closed:
            return
        try:
            # The output processor ends the request's stream before the core is told, so even a
            # stalled core's requests end here; only the message to the core may time out.
            await asyncio.wait_for(self._llm.abort(request_id), ABORT_TIMEOUT_S)
        except Exception:  # an abort of a finished or dead request is not an error
            logger.debug("abort of %s failed", request_id, exc_info=True)

    async def abort_all(self, message: str) -> int:
        ids = list(self._active)
        for request_id in ids:
            self._aborted[request_id] = message
            await self.abort(request_id)
        return len(ids)

    def is_dead(self) -> bool:
        return not self._closed and bool(self._llm.errored)

    def progress(self) -> EngineProgress:
        pending = len(self._active)
        quiet = time.monotonic() - max(self._last_output, self._busy_since) if pending else 0.0
        return EngineProgress(pending, quiet, self._last_output)

    async def num_unfinished_requests(self) -> int:
        return compat.num_unfinished_requests(self._llm)

    async def pause_generation(self) -> None:
        # vLLM 0.26 and 0.32 alike: mode "keep" freezes the running requests in the scheduler;
        # clear_cache preempts them and resets the prefix cache, so nothing computed with the old
        # weights is reused: the kept requests recompute their KV with the new weights on resume.
        await self._llm.pause_generation(mode="keep", clear_cache=True)

    async def prefetch_weights(self, weights_path: str, timeout_s: float) -> str | None:
        if not self._gateway_workers:
            return "the profile names its own worker_extension_cls"
        await self._llm.collective_rpc("gateway_prefetch_weights", kwargs={"weights_path": weights_path})
        deadline = time.monotonic() + timeout_s
        while True:
            states = await self._llm.collective_rpc("gateway_prefetch_state", kwargs={"weights_path": weights_path})
            failed = [s for s in states if s != "done" and s != "running"]
            if failed:
                return failed[0]
            if all(s == "done" for s in states):
                return None
            if time.monotonic() > deadline:
                return f"not done after {timeout_s:.0f} s"
            await asyncio.sleep(0.05)

    async def reload_weights(self, weights_path: str) -> None:
        # vLLM 0.26 and 0.32 alike: every worker's model runner loads the checkpoint at
        # `weights_path` into the existing parameters (the model config now points there);
        # the gateway's worker method adds the CPU backend's fix and uses the prefetched tensors
        # (server.engine.worker_extension).
        method = "gateway_reload_weights" if self._gateway_workers else "reload_weights"
        await self._llm.collective_rpc(method, kwargs={"weights_path": weights_path})
        self.info = dataclasses.replace(self.info, model_path=weights_path)

    async def resume_generation(self) -> None:
        await self._llm.resume_generation()

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await compat.stop_output_handler(self._llm)
            await asyncio.to_thread(self._llm.shutdown)
        finally:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
