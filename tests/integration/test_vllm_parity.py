"""Differential test: the gateway against vLLM's own OpenAI server, same model and engine settings.

Every request in tests/data/parity_completions.jsonl goes to both servers (temperature 0 or a
fixed seed). Compared: status, error type and param, text, finish_reason, stop_reason, usage,
logprobs, and the field sets. Differences kept on purpose are listed below with the reason.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import SERVED_NAME, ServerProcess

DATA = Path(__file__).parents[1] / "data"
REQUESTS = [
    {**json.loads(line), "endpoint": endpoint}
    for name, endpoint in (("parity_completions.jsonl", "/v1/completions"), ("parity_chat.jsonl", "/v1/chat/completions"))
    for line in (DATA / name).read_text().splitlines()
    if line.strip()
]

# Deliberate differences from `vllm serve` (field -> why we leave it out):
VLLM_ONLY_RESPONSE_FIELDS = {
    "service_tier": "always null in vLLM; we have no service tiers",
    "kv_transfer_params": "vLLM disaggregated-prefill plumbing, not part of the OpenAI API",
    "ec_transfer_params": "vLLM encoder-cache plumbing, not part of the OpenAI API",
    "metrics": "vLLM-internal per-request metrics (null); ours are on /metrics",
    "prompt_logprobs": "vLLM extension on chat responses (null unless prompt_logprobs is sent)",
    "prompt_token_ids": "vLLM extension (null unless return_token_ids is sent)",
    "prompt_text": "vLLM extension (null unless return_prompt_text is sent)",
}
VLLM_ONLY_MESSAGE_FIELDS = {
    "annotations": "web-search annotations; always null here",
    "audio": "audio output; text-only models",
    "function_call": "deprecated OpenAI field; always null without a tool parser",
    "tool_calls": "compared in test_vllm_parity_tools.py; an empty list is sent by the gateway, left out by vLLM 0.32",
}
VLLM_ONLY_CHOICE_FIELDS = {
    "token_ids": "null unless vLLM's return_token_ids extension is sent; not supported here",
    "prompt_token_ids": "same as token_ids",
    "prompt_logprobs": "vLLM's raw per-token dicts duplicate the OpenAI logprobs block (echo+logprobs)",
    "routed_experts": "MoE debugging extension, null for dense models",
    "prompt_text": "vLLM's return_prompt_text extension (null unless asked)",
}
VLLM_ONLY_USAGE_FIELDS = {
    "prompt_tokens_details": "null unless prompt caching stats are enabled in vLLM",
    "completion_tokens_details": "always null in vLLM for this model",
}
# `system_fingerprint` is present in both but names the server (vllm-0.32.0-... vs llm-gateway-...);
# vLLM also puts it on the final usage chunk of a stream, we do not.
# Error messages are worded differently; status, type and (where both set it) param must match.
# Error `type`: vLLM 0.26 names some 400s by the status phrase ("Bad Request": an empty prompt,
# top_logprobs without logprobs) and others by the class name; vLLM 0.32 and the gateway always use
# the class name ("BadRequestError"), so a phrase from the reference is compared as its class name.
# A prompt longer than the context: vLLM says param "input_tokens", we say "prompt" (the field
# the client sent); not in the request list because vLLM reports only "at least N" tokens.


def strip(payload: dict[str, Any]) -> dict[str, Any]:
    payload = {k: v for k, v in payload.items() if k not in VLLM_ONLY_RESPONSE_FIELDS}
    payload.pop("id", None)
    payload.pop("created", None)
    payload.pop("system_fingerprint", None)
    payload["choices"] = [
        {k: v for k, v in c.items() if k not in VLLM_ONLY_CHOICE_FIELDS} for c in payload.get("choices", [])
    ]
    for c in payload["choices"]:
        if "message" in c:
            c["message"] = {k: v for k, v in c["message"].items() if k not in VLLM_ONLY_MESSAGE_FIELDS}
    if payload.get("usage"):
        payload["usage"] = {k: v for k, v in payload["usage"].items() if k not in VLLM_ONLY_USAGE_FIELDS}
    return payload


def error_type_as_class_name(error_type: str, status: int) -> str:
    """vLLM 0.26's "Bad Request" as vLLM 0.32's "BadRequestError"; class names unchanged."""
    phrase = HTTPStatus(status).phrase
    return phrase.replace(" ", "") + "Error" if error_type == phrase else error_type


def call(base_url: str, endpoint: str, body: dict[str, Any]) -> tuple[int, Any]:
    body = {"model": SERVED_NAME, **body}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        if not body.get("stream"):
            r = client.post(endpoint, json=body)
            return r.status_code, r.json()
        with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                r.read()
                return r.status_code, r.json()
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return 200, [json.loads(e) for e in events[:-1]]


def close(a: Any, b: Any, tol: float = 1e-3) -> bool:
    """Equal, with logprob floats compared to a tolerance (two engines, same kernels)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol * max(1.0, abs(a))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b, strict=True))
    return a == b


def fold_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per choice index: concatenated text, finish/stop reason, logprob tokens; plus usage."""
    out: dict[str, Any] = {"choices": {}, "usage": None, "field_sets": set()}
    for chunk in chunks:
        out["field_sets"].add(tuple(sorted(k for k in chunk if k not in {*VLLM_ONLY_RESPONSE_FIELDS, "system_fingerprint"})))
        if chunk.get("usage"):
            out["usage"] = {k: v for k, v in chunk["usage"].items() if k not in VLLM_ONLY_USAGE_FIELDS}
        for c in chunk["choices"]:
            folded = out["choices"].setdefault(c["index"], {"text": "", "finish_reason": None, "stop_reason": None, "tokens": []})
            if "delta" in c:
                folded["text"] += c["delta"].get("content") or ""
                out["field_sets"].add(("delta",) + tuple(sorted(c["delta"])))
            else:
                folded["text"] += c["text"]
            if c.get("finish_reason"):
                folded["finish_reason"] = c["finish_reason"]
                folded["stop_reason"] = c.get("stop_reason")
            if c.get("logprobs"):
                lp = c["logprobs"]
                folded["tokens"] += lp["tokens"] if "tokens" in lp else [e["token"] for e in lp["content"]]
            out["field_sets"].add(tuple(sorted(k for k in c if k not in VLLM_ONLY_CHOICE_FIELDS)))
    return out


def test_request_list_is_big_enough() -> None:
    assert len(REQUESTS) >= 30
    assert {r["endpoint"] for r in REQUESTS} == {"/v1/completions", "/v1/chat/completions"}
    assert any(r["body"].get("stream") for r in REQUESTS)


@pytest.mark.parametrize("case", REQUESTS, ids=[r["name"] for r in REQUESTS])
def test_same_answer_as_vllm(case: dict[str, Any], gateway: ServerProcess, vllm_reference: ServerProcess) -> None:
    ours_status, ours = call(gateway.base_url, case["endpoint"], case["body"])
    ref_status, ref = call(vllm_reference.base_url, case["endpoint"], case["body"])
    assert ours_status == ref_status, (ours, ref)
    if ref_status != 200:
        assert ours["error"]["type"] == error_type_as_class_name(ref["error"]["type"], ref_status)
        assert set(ours["error"]) == set(ref["error"])
        if ref["error"]["param"] is not None:
            assert ours["error"]["param"] == ref["error"]["param"]
        return
    if isinstance(ref, list):
        a, b = fold_stream(ours), fold_stream(ref)
        assert a["choices"] == b["choices"]
        assert a["usage"] == b["usage"]
        assert a["field_sets"] == b["field_sets"]
        return
    a, b = strip(ours), strip(ref)
    assert set(a) == set(b)
    assert [set(c) for c in a["choices"]] == [set(c) for c in b["choices"]]
    assert a["usage"] == b["usage"]
    for ca, cb in zip(a["choices"], b["choices"], strict=True):
        assert ca.get("text") == cb.get("text")
        assert ca.get("message") == cb.get("message")
        assert ca["finish_reason"] == cb["finish_reason"]
        assert ca["stop_reason"] == cb["stop_reason"]
        assert close(ca["logprobs"], cb["logprobs"]), (ca["logprobs"], cb["logprobs"])
    assert close(a, b)
