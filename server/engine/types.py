"""The plain data the engine seam speaks, and the `Engine` Protocol (no vLLM types cross it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    """One position: the chosen token and the candidates vLLM returned (chosen + top-k).

    `logprob` and `candidates` are None for the first prompt token, which has no logprob.
    """

    token_id: int
    token: str
    logprob: float | None
    candidates: list[TopLogprob] | None


@dataclass(slots=True)
class ChoiceOutput:
    """One sequence's progress: a delta when streaming, the whole result otherwise."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None

    @property
    def ended_on_stop_token(self) -> bool:
        """Stopped on EOS or a stop token id (not a stop string): vLLM's detokenizer (0.26, 0.32)
        left that last token's text out, though its id is in `token_ids`."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str)


@dataclass(slots=True)
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob] | None
    choices: list[ChoiceOutput]
    finished: bool


@dataclass(slots=True)
class SamplingOptions:
    """What a request asks of the sampler; mirrors vLLM's `SamplingParams` fields."""

    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured: dict[str, Any] | None = None  # vLLM StructuredOutputsParams fields (json, json_object, ...)
    stream: bool = False


@dataclass(slots=True)
class ParsedToolCall:
    """One tool call the model made; `arguments` is JSON text, `id` empty when the parser gave none."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallExtraction:
    """A completion split into the text around the tool calls (None when only calls) and the calls."""

    content: str | None
    calls: list[ParsedToolCall]


@dataclass(slots=True)
class PartialCall:
    """A tool call recognised while the model writes it: its name and a prefix of its arguments
    that the finished parse's arguments are certain to begin with."""

    name: str
    arguments: str


class CallPrefixReader(Protocol):
    """The calls of one streamed choice so far (`ToolCallParser.call_prefixes`)."""

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls recognised in `text` (the choice's text from its first call opener on), in
        order; the list stops at the first call not yet recognised."""
        ...


class ToolCallParser(Protocol):
    """One request's tool-call parser (the model's own call syntax, e.g. Hermes `<tool_call>`)."""

    start_marker: str | None
    """The text that opens a call (`<tool_call>`, Gemma 4's `<|tool_call>`); None when the syntax
    has no fixed opener (then a streamed choice is held whole)."""

    forced_by_schema: bool
    """Whether `required` and named `tool_choice` constrain the output to vLLM's JSON schema,
    whose calls the gateway reads (False: they constrain it to the model's own call syntax, by
    vLLM's structural tag or the gateway's grammar, and this parser reads it, e.g. gemma4)."""

    strips_calls_without_tools: bool
    """Whether `tool_choice: none` still runs this parser to drop call syntax from the content,
    as `vllm serve` does for vLLM's engine-based parsers (gemma4)."""

    structured: dict[str, Any] | None
    """The output constraint for this request's tools and `tool_choice` (`SamplingOptions.structured`
    fields): what vLLM's parser sets (a structural tag, a JSON schema), or for `required` and a
    named function where it sets none, the gateway's (a grammar of the call syntax); None for
    `auto`/`none` without one."""

    skip_special_tokens: bool
    """False when the call syntax uses special tokens the text must keep."""

    def extract(self, text: str) -> ToolCallExtraction: ...

    def call_prefixes(self) -> CallPrefixReader | None:
        """A reader of one streamed choice's calls as they are written (None: the syntax has
        none, its calls go whole once the choice finishes)."""
        ...


class ReasoningParser(Protocol):
    """One choice's reasoning parser: splits the model's reasoning (e.g. Gemma 4's
    `<|channel>...<channel|>`) from its content, as `vllm serve --reasoning-parser` does."""

    keeps_special_tokens: bool
    """Whether the parser needs special tokens in the text (`skip_special_tokens=False`, what
    vLLM's `adjust_request` sets for gemma4, whose markers are special tokens)."""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished choice."""
        ...

    def stream(
        self, delta_text: str, delta_token_ids: Sequence[int], *, finished: bool = False
    ) -> tuple[str | None, str | None]:
        """(reasoning delta, content delta) of one streamed delta of this choice, in order;
        `finished` on its last delta (what the parser still holds comes out then)."""
        ...


@dataclass(slots=True)
class EngineInfo:
    served_model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    vllm_version: str
    max_logprobs: int
    kv_sharing_fast_prefill: bool
    default_sampling: dict[str, Any] = field(default_factory=dict)
    tool_call_parser: str | None = None
    """The profile's `engine.tool_call_parser` (None: `tool_choice` auto is refused)."""
    reasoning_parser: str | None = None
    """The profile's `engine.reasoning_parser` (None: the output is all content)."""


@dataclass(slots=True)
class EngineProgress:
    """Whether the engine moves: what the stall rule and the systemd watchdog read."""

    pending: int
    """The gateway's requests inside the engine now (running or queued there)."""

    quiet_s: float
    """Seconds without engine output while requests were pending (0 when idle)."""

    last_output_at: float
    """`time.monotonic()` of the engine's last output (0.0 before the first)."""


@runtime_checkable
class Engine(Protocol):
    """What the gateway needs from an inference engine."""

    info: EngineInfo

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, continue_final_message: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The model's chat template applied to `messages` (and `tools`, OpenAI's dicts), as text."""
        ...

    def tool_parser(
        self, tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool | None,
        response_format: dict[str, Any] | None = None,
    ) -> ToolCallParser:
        """A fresh parser for one request, built from `info.tool_call_parser` (which must be set);
        `response_format` (OpenAI's dict) is what vLLM may fold into the tool constraint."""
        ...

    def tool_choice_schema(
        self, tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool | None
    ) -> dict[str, Any] | None:
        """The JSON schema `required` or a named `tool_choice` constrains the output to, as
        `vllm serve` builds it; None for `auto` and `none`."""
        ...

    def reasoning_parser(self, prompt_token_ids: Sequence[int]) -> ReasoningParser | None:
        """A fresh parser for one choice of a request with this prompt (which may leave
        reasoning open), built from `info.reasoning_parser`; None when the profile has none."""
        ...

    def make_sampling(self, options: SamplingOptions) -> Any:
        """Validate options and build the engine's own sampling object (raises InvalidRequestError)."""
        ...

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: Any
    ) -> AsyncIterator[GenerationOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def abort_all(self, message: str) -> int:
        """Abort every running request; their streams raise ServiceUnavailableError(message)."""
        ...

    def is_dead(self) -> bool: ...

    def progress(self) -> EngineProgress: ...

    async def num_unfinished_requests(self) -> int: ...

    async def pause_generation(self) -> None:
        """Stop scheduling: running and new requests wait (none is aborted) until resumed."""
        ...

    async def prefetch_weights(self, weights_path: str, timeout_s: float) -> str | None:
        """Read `weights_path`'s tensors into memory while generation goes on, so the next
        `reload_weights` of that path only copies them; returns why not (None when done)."""
        ...

    async def reload_weights(self, weights_path: str) -> None:
        """Copy the weights in `weights_path` into the loaded model (paused engine only)."""
        ...

    async def resume_generation(self) -> None: ...

    async def shutdown(self) -> None: ...
