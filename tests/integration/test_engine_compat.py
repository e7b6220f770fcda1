"""The engine seam against the vLLM installed here, without starting an engine.

`make test` runs this on vLLM 0.32 (CPU build) and `make test-compat` on vLLM 0.26 (the release
the H200 runs), so every vLLM name the gateway relies on is checked on both.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from server.engine import SamplingOptions, VllmEngine, compat, engine_args_kwargs
from server.errors import InvalidRequestError
from server.settings import load_settings
from server.settings.schema import PROFILES_DIR

vllm = pytest.importorskip("vllm")


@pytest.mark.parametrize("profile", sorted(p.name for p in PROFILES_DIR.glob("*.yaml")))
def test_every_shipped_profile_maps_onto_engine_args(profile: str) -> None:
    """A profile key the installed vLLM does not know would stop the engine at start (on the GPU,
    minutes in); here it fails in seconds on any machine."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    settings = load_settings(PROFILES_DIR / profile)
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    assert sorted(set(engine_args_kwargs(settings)) - known) == []


def _sampling(**fields: object) -> object:
    engine = object.__new__(VllmEngine)  # make_sampling needs no running engine
    return engine.make_sampling(SamplingOptions(**{"max_tokens": 8, **fields}))  # type: ignore[arg-type]


def test_valid_options_build_sampling_params() -> None:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = _sampling(n=2, temperature=0.5, seed=7, stop=["x"], logprobs=2, stream=True,
                       structured={"json_object": True}, logit_bias={3: 1.0})
    assert isinstance(params, SamplingParams)
    assert params.output_kind is RequestOutputKind.DELTA and params.seed == 7
    # fresh per prompt: AsyncLLM.add_request may skip its deepcopy, as it does for `vllm serve`
    assert params.skip_clone is True and params.clone() is not params and params.clone().stop == ["x"]


@pytest.mark.parametrize("fields", [
    {"temperature": -1.0},
    {"top_p": 1.5},
    {"n": 0},
    {"min_tokens": 9},  # above max_tokens
    {"presence_penalty": 3.0},
    {"repetition_penalty": 0.0},
    {"logprobs": -2},
    {"structured": {"json": {"type": "object"}, "regex": "a+"}},  # two kinds at once
])
def test_options_vllm_refuses_become_a_400(fields: dict[str, object]) -> None:
    """vLLM 0.32 raises VLLMValidationError (not a ValueError), 0.26 a ValueError subclass."""
    with pytest.raises(InvalidRequestError):
        _sampling(**fields)


def test_request_error_types_are_exception_classes() -> None:
    types = compat.request_error_types()
    assert all(inspect.isclass(t) and issubclass(t, BaseException) for t in types)
    from vllm.exceptions import VLLMValidationError

    assert issubclass(VLLMValidationError, types)


def test_async_llm_has_what_the_seam_uses() -> None:
    """The attributes `VllmEngine` and `compat` read on `AsyncLLM` (checked on the class and its
    constructor: an engine start takes too long for this test)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    for name in ("from_engine_args", "generate", "abort", "shutdown", "get_tokenizer", "errored"):
        assert hasattr(AsyncLLM, name), name
    init = inspect.getsource(AsyncLLM.__init__)
    for attribute in ("self.output_processor", "self.output_handler", "self.model_config"):
        assert attribute in init, attribute
    assert callable(OutputProcessor.get_num_unfinished_requests)
