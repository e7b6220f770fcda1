"""The engine seam: the only package that imports vLLM.

- `types`: the plain data exchanged with the serving layer and the `Engine` Protocol;
- `runtime`: environment, engine arguments and the abandonable start (no vLLM import);
- `compat`: one function per difference between the supported vLLM releases (0.26 and 0.32);
- `tool_parsing`: vLLM's tool-call parsers and tool-choice schemas behind plain data;
- `tool_call_prefix`: tool calls read while they are written (certain prefixes of the arguments);
- `reasoning_parsing`: vLLM's reasoning parsers (reasoning split from content) behind plain data;
- `vllm_engine`: `VllmEngine`, `AsyncLLM` behind the Protocol.
"""

from server.engine.runtime import (
    engine_args_kwargs,
    engine_runtime_dirs,
    prepare_engine_environment,
    release_freed_memory,
    run_abandonable,
)
from server.engine.types import (
    CallPrefixReader,
    ChoiceOutput,
    Engine,
    EngineInfo,
    EngineProgress,
    GenerationOutput,
    ParsedToolCall,
    PartialCall,
    ReasoningParser,
    SamplingOptions,
    ToolCallExtraction,
    ToolCallParser,
    TokenLogprob,
    TopLogprob,
)
from server.engine.vllm_engine import VllmEngine, note_stop_signal

__all__ = [
    "CallPrefixReader",
    "ChoiceOutput",
    "Engine",
    "EngineInfo",
    "EngineProgress",
    "GenerationOutput",
    "ParsedToolCall",
    "PartialCall",
    "ReasoningParser",
    "SamplingOptions",
    "ToolCallExtraction",
    "ToolCallParser",
    "TokenLogprob",
    "TopLogprob",
    "VllmEngine",
    "engine_args_kwargs",
    "engine_runtime_dirs",
    "note_stop_signal",
    "prepare_engine_environment",
    "release_freed_memory",
    "run_abandonable",
]
