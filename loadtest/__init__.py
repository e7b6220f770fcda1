"""Load-test tool for OpenAI-compatible servers: TTFT, TPOT, ITL, latency, throughput, goodput.

`python -m loadtest run ...` (or `llm-gateway bench run ...`); see loadtest/README.md.
"""
