"""What one request asks for (RequestSpec) and what the client measured (RequestRecord)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

Prompt = str | list[int]


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. `messages` is used by the chat endpoint, `prompt` by completions."""

    prompt: Prompt
    max_tokens: int
    input_tokens: int | None = None
    messages: list[dict[str, str]] | None = None


@dataclass
class RequestRecord:
    """Client-side measurements of one request; times in seconds, relative to the run start."""

    index: int
    scheduled_s: float
    sent_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    chunks: int = 0
    output_chars: int = 0  # text received (content, reasoning, tool-call pieces): proves the stream carried text
    status: int | None = None
    error: str | None = None
    input_tokens_requested: int | None = None
    max_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def send_lag_s(self) -> float:
        """How late the client sent this request against its schedule (the client's own lag)."""
        return self.sent_s - self.scheduled_s

    @property
    def output_tokens(self) -> int:
        """Server usage when reported; else one token per chunk (vLLM sends one token per chunk)."""
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def tpot_s(self) -> float | None:
        # Same definition as `vllm bench serve`: decode time spread over the tokens after the first.
        n = self.output_tokens
        if not self.ok or self.ttft_s is None or self.latency_s is None or n < 2:
            return None
        return (self.latency_s - self.ttft_s) / (n - 1)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(ok=self.ok, tpot_s=self.tpot_s, send_lag_s=self.send_lag_s)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})
