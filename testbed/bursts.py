"""Request bodies for tenant burst tests: the shapes a characters / 4 estimate misses (a large tool
definition, CJK text, random tool schemas in many scripts, tool calls and tool results), and a
driver that sends a batch at once and sums what was served."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any

import httpx

# One sentence of Chinese, ~2 tokens a character for SmolLM2's tokenizer.
CJK = "今天天气很好我们去公园散步吧"
SCRIPTS = {
    "latin": "abcdefghijklmnopqrstuvwxyz",
    "cjk": CJK + "東京大阪北海道",
    "cyrillic": "абвгдежзийклмнопрстуфхцчшщэюя",
    "arabic": "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "devanagari": "अआइईउऊएऐओऔकखगघचछजझटठडढतथदधनपफबभमयरलवशसह",
    "emoji": "😀🚀🌍🎉🔥💡📦🧪",
}


def big_tool(fields: int = 17) -> dict[str, Any]:
    """A function tool of ~35 tokens a field (17 fields: ~600 tokens for SmolLM2)."""
    props = {f"field_{i}": {"type": "string", "description": f"The {i}th detail of the booking request, as the "
                            "customer wrote it"} for i in range(fields)}
    return {"type": "function", "function": {
        "name": "book_trip", "description": "Book a trip with every detail the customer gave.",
        "parameters": {"type": "object", "properties": props, "required": ["field_0"]}}}


def cjk_text(chars: int = 400) -> str:
    return (CJK * (chars // len(CJK) + 1))[:chars]


def _words(rng: random.Random, script: str, count: int) -> str:
    letters = SCRIPTS[script]
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 6))) for _ in range(count))


def random_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(path, body): a chat or /v1/responses request with 1-3 random tools, text in a random
    script, and sometimes an earlier tool call and its result; max_tokens 1-3. Sized to stay
    well under a 1,024-token context."""
    script = rng.choice(list(SCRIPTS))
    tools = []
    for t in range(rng.randint(1, 3)):
        props = {f"p{i}_{_words(rng, 'latin', 1)}": {"type": rng.choice(["string", "integer", "boolean"]),
                                                      "description": _words(rng, script, rng.randint(1, 4))}
                 for i in range(rng.randint(1, 4))}
        tools.append({"name": f"tool_{t}_{_words(rng, 'latin', 1)}", "description": _words(rng, script, 3),
                      "parameters": {"type": "object", "properties": props}})
    question = _words(rng, script, rng.randint(3, 20))
    arguments = json.dumps({"q": _words(rng, script, rng.randint(1, 8))}, ensure_ascii=False)
    result = _words(rng, script, rng.randint(1, 15))
    with_call = rng.random() < 0.5
    max_tokens = rng.randint(1, 3)
    if rng.random() < 0.5:
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        if with_call:
            messages += [{"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function", "function": {"name": tools[0]["name"], "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": result}]
        return "/v1/chat/completions", {
            "messages": messages, "max_tokens": max_tokens,
            "tools": [{"type": "function", "function": tool} for tool in tools]}
    items: list[dict[str, Any]] = [{"role": "user", "content": question}]
    if with_call:
        items += [{"type": "function_call", "call_id": "call_1", "name": tools[0]["name"], "arguments": arguments},
                  {"type": "function_call_output", "call_id": "call_1", "output": result}]
    return "/v1/responses", {"input": items, "max_output_tokens": max_tokens,
                             "tools": [{"type": "function", **tool} for tool in tools]}


@dataclass
class Burst:
    statuses: list[int]
    spent: int  # total tokens of the answered requests, from their usage
    largest: int  # the largest reservation among the answered ones: prompt + max_tokens
    bodies: list[dict[str, Any]]  # the error bodies of the refused ones

    @property
    def served(self) -> int:
        return self.statuses.count(200)


async def _send(base_urls: list[str], key: str, requests: list[tuple[str, dict[str, Any]]]) -> Burst:
    async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {key}"}) as client:
        answers = await asyncio.gather(*(
            client.post(base_urls[i % len(base_urls)] + path, json=body)
            for i, (path, body) in enumerate(requests)))
    burst = Burst([r.status_code for r in answers], 0, 0, [])
    for (path, body), r in zip(requests, answers, strict=True):
        if r.status_code != 200:
            burst.bodies.append(r.json())
            continue
        usage = r.json()["usage"]
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        total = usage["total_tokens"]
        burst.spent += total
        most = body.get("max_tokens", body.get("max_output_tokens"))
        burst.largest = max(burst.largest, prompt + most)
    return burst


def send_at_once(base_urls: list[str], key: str, requests: list[tuple[str, dict[str, Any]]]) -> Burst:
    """Send every request at the same moment (round robin over `base_urls`) and wait for all."""
    return asyncio.run(_send(base_urls, key, requests))
