"""llm-gateway: an OpenAI-compatible gateway around vLLM's in-process async engine."""

__version__ = "0.1.0"
