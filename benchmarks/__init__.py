"""The gateway's benchmarks, a package run from the repository root as `python -m benchmarks.<tool>`.

The maintained drivers sit here (profiles, http_overhead, http_interleaved, reload_under_load,
tenants_overhead, frontend_capacity, vllm_cli); what they share is in lib/, the synthetic model
files in fixtures/, one-off experiments in experiments/ (not maintained), the H200 scripts in
device/, raw results in results/. Tests import lib/ and fixtures/ only; drivers run as subprocesses.
"""
