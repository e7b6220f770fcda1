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


def test_stream_interval_reaches_the_engine_args() -> None:
    """docs/performance/replicas.md names `engine.extra_engine_args: {stream_interval: k}` (the engine
    hands on a stream's tokens every k steps) as a lever for the front's event loop, for vLLM 0.26 and
    0.32 alike: the key must reach `AsyncEngineArgs` as itself, and both releases must know it."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    settings = load_settings(PROFILES_DIR / "embedded-cpu.yaml", engine={"extra_engine_args": {"stream_interval": 4}})
    kwargs = engine_args_kwargs(settings)
    assert kwargs["stream_interval"] == 4
    assert "stream_interval" in {f.name for f in dataclasses.fields(AsyncEngineArgs)}


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


def test_cpu_engines_rank_logprobs_without_compiling() -> None:
    """What `patch_engine_process` does to the logprob ranks in a gateway's engine processes on
    CPU (0.26 and 0.32): the sampler's `batched_count_greater_than` is no longer a
    `torch.compile` wrapper (its first call compiled for 12-24 s), and counts the same."""
    import torch
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    shipped = sampler.batched_count_greater_than, logprobs.batched_count_greater_than
    assert hasattr(shipped[0], "_torchdynamo_orig_callable")  # what vLLM ships: compiled
    try:
        compat.rank_logprobs_eagerly_on_cpu()
        compat.rank_logprobs_eagerly_on_cpu()  # applied once, however often vLLM loads the plugin
        count = sampler.batched_count_greater_than
        assert count is logprobs.batched_count_greater_than and getattr(count, "gateway_eager", False)
        assert not hasattr(count, "_torchdynamo_orig_callable")
        x = torch.tensor([[0.1, 0.5, 0.5, -1.0], [3.0, 2.0, 1.0, 0.0]])
        values = torch.tensor([[0.5], [0.0]])
        assert count(x, values).tolist() == [2, 4]  # a rank counts the token and every one at least as likely
        x = torch.randn(64, 1000)
        values = x[:, :1]
        assert torch.equal(count(x, values), (x >= values).sum(-1))
    finally:
        sampler.batched_count_greater_than, logprobs.batched_count_greater_than = shipped


def test_cpu_engines_of_0_26_sample_without_compiling() -> None:
    """What `patch_engine_process` does to the sampler in a gateway's engine processes: on vLLM
    0.26 on CPU, a batch without seeds is drawn eagerly (the compiled draw cost each engine's first
    sampled request seconds), and still right: a token masked to -inf is never drawn and a
    dominant one nearly always. On 0.32 the sampler is left as vLLM ships it."""
    import torch
    from vllm.v1.sample.ops import topk_topp_sampler

    shipped = topk_topp_sampler.compiled_random_sample
    try:
        compat.sample_eagerly_on_cpu()
        compat.sample_eagerly_on_cpu()  # applied once, however often vLLM loads the plugin
        draw = topk_topp_sampler.compiled_random_sample
        if not vllm.__version__.startswith("0.26."):
            assert draw is shipped
            return
        assert draw is not shipped and getattr(draw, "gateway_eager", False)
        assert not hasattr(draw, "_torchdynamo_orig_callable")  # not a torch.compile wrapper
        torch.manual_seed(0)
        logits = torch.full((64, 1000), -5.0)
        logits[:, 7] = 5.0  # ~98% of the probability
        logits[:, 8] = float("-inf")  # masked, as top-k/top-p leave it
        tokens = torch.cat([draw(logits.clone()) for _ in range(50)])
        assert tokens.shape == (3200,) and 8 not in tokens.tolist()
        assert 0.95 < (tokens == 7).float().mean().item() < 1.0
    finally:
        topk_topp_sampler.compiled_random_sample = shipped


@pytest.mark.parametrize("mode", ["same-answers-only", None])
def test_a_vllm_serve_beside_the_gateway_gets_at_most_the_patches_that_change_no_answer(
        mode: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests' `vllm serve` reference asks for the patches that change no answer alone
    (`SAME_ANSWERS_ONLY`): vLLM 0.26's CPU runner skips its eager-mode dummy forward and logprob
    ranks are counted by the same expression uncompiled, as in the gateway's engine, while the
    sampler stays as vLLM ships it, so parity compares against vLLM's own draws. A `vllm serve`
    that asks for nothing (the variable unset) gets nothing."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs, topk_topp_sampler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from server.engine.runtime import ENGINE_PROCESS_ENV, SAME_ANSWERS_ONLY

    assert mode in (SAME_ANSWERS_ONLY, None)
    shipped = (CPUModelRunner.warming_up_model, topk_topp_sampler.compiled_random_sample,
               sampler.batched_count_greater_than, logprobs.batched_count_greater_than)
    if mode is None:
        monkeypatch.delenv(ENGINE_PROCESS_ENV, raising=False)
    else:
        monkeypatch.setenv(ENGINE_PROCESS_ENV, mode)
    try:
        compat.patch_engine_process()
        warm_up = CPUModelRunner.warming_up_model
        skips = mode is not None and vllm.__version__.startswith("0.26.")
        assert getattr(warm_up, "gateway_skips_eager", False) is skips
        assert (warm_up is shipped[0]) is not skips
        ranks = sampler.batched_count_greater_than
        assert (ranks is shipped[2]) is (mode is None)
        assert getattr(ranks, "gateway_eager", False) is (mode is not None)
        assert logprobs.batched_count_greater_than is ranks
        assert topk_topp_sampler.compiled_random_sample is shipped[1]
    finally:
        (CPUModelRunner.warming_up_model, topk_topp_sampler.compiled_random_sample,
         sampler.batched_count_greater_than, logprobs.batched_count_greater_than) = shipped
