"""The max_tokens rule: how many tokens a request reserves from its tenant's limits when it starts.

A request's real cost is known only when it ends, so admission charges its worst case:

    reserved = sum over its prompts of (prompt tokens + n x completion allowance)
    completion allowance = min(max_tokens, context - prompt tokens), or context - prompt tokens
                           when the request sets no max_tokens (vLLM may then fill the context)

Prompt tokens are counted exactly for token-id prompts and estimated as characters / 4 (OpenAI's
rule of thumb, rounded up) for text, plus a few tokens per chat message for the template. When
the request ends the reservation is replaced by the tokens it really used (prompt + completion),
so an estimate only decides admission, never what is charged. A body that cannot be read
reserves nothing: the request is refused by validation before it reaches the engine.
"""

from __future__ import annotations

from typing import Any, Literal

CHARS_PER_TOKEN = 4
# OpenAI's cookbook count of a chat template's cost: 3 tokens around each message, 3 to prime the reply.
TOKENS_PER_MESSAGE = 3
TOKENS_PER_REPLY = 3


def _text_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def _count(value: Any) -> int | None:
    """A positive integer field's value, or None when absent or unusable (validation refuses it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def completion_prompts(body: dict[str, Any]) -> list[int]:
    """Estimated token counts of each prompt of a /v1/completions body."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [_text_tokens(prompt)]
    if not isinstance(prompt, list) or not prompt:
        return []
    if all(isinstance(p, int) for p in prompt):
        return [len(prompt)]
    sizes = []
    for item in prompt:
        if isinstance(item, str):
            sizes.append(_text_tokens(item))
        elif isinstance(item, list):
            sizes.append(len(item))
    return sizes


def chat_prompt(body: dict[str, Any]) -> list[int]:
    """The estimated token count of a /v1/chat/completions body's messages, as one prompt."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return []
    total = TOKENS_PER_REPLY
    for message in messages:
        total += TOKENS_PER_MESSAGE
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += _text_tokens(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += _text_tokens(part["text"])
    return [total]


def responses_prompt(body: dict[str, Any]) -> list[int]:
    """The estimated token count of a /v1/responses body's instructions and input, as one prompt."""
    raw = body.get("input")
    messages: list[Any] = [{"content": raw}] if isinstance(raw, str) else raw if isinstance(raw, list) else []
    if not messages:
        return []
    if isinstance(body.get("instructions"), str):
        messages = [{"content": body["instructions"]}, *messages]
    return chat_prompt({"messages": messages})


def _block_text(block: Any) -> str:
    """The text of an Anthropic content block (a tool_result's own blocks joined, a tool_use's input)."""
    if not isinstance(block, dict):
        return ""
    for key in ("text", "content", "thinking"):
        if isinstance(block.get(key), str):
            return block[key]
    if isinstance(block.get("content"), list):
        return " ".join(_block_text(b) for b in block["content"])
    return str(block["input"]) if "input" in block else ""


def messages_prompt(body: dict[str, Any]) -> list[int]:
    """The estimated token count of a /v1/messages body's system prompt and messages, as one prompt."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        return []
    system = body.get("system")
    messages: list[Any] = [] if system is None else [{"content": system}]
    for message in raw:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = [{"text": _block_text(block)} for block in content]
        messages.append({"content": content})
    return chat_prompt({"messages": messages})


RouteKind = Literal["completions", "chat", "responses", "messages"]


def reserved_tokens(body: Any, kind: RouteKind, context_length: int | None) -> int:
    """Tokens a request of route `kind` reserves (the rule in the module docstring);
    `context_length` is the engine's max_model_len, None while no engine serves (the request then
    fails with 503). /v1/responses and /v1/messages count like chat (/v1/responses with
max_output_tokens as its max_tokens)."""
    if not isinstance(body, dict):
        return 0
    if kind == "responses":
        prompts, raw = responses_prompt(body), body.get("max_output_tokens")
    elif kind == "messages":
        prompts, raw = messages_prompt(body), body.get("max_tokens")
    else:
        prompts = chat_prompt(body) if kind == "chat" else completion_prompts(body)
        raw = body.get("max_completion_tokens") if kind == "chat" else None  # chat's own name wins, as in serving
        if raw is None:
            raw = body.get("max_tokens")
    # An unusable value (negative, a string) is refused by validation: it reserves no completion.
    requested = None if raw is None else (_count(raw) or 0)
    n = _count(body.get("n")) or 1
    total = 0
    for prompt_tokens in prompts:
        if context_length is None:
            allowance = requested or 0
        else:
            room = max(context_length - prompt_tokens, 0)
            allowance = min(requested, room) if requested is not None else room
        total += prompt_tokens + n * allowance
    return total
