"""What `tests/` and `benchmarks/` share to run the gateway without a model or beside real side
services: `fakes` (a scripted engine behind the `Engine` Protocol, and scripted tool and reasoning
parsers: no vLLM, answers at once) and `redis_server` (a throwaway `redis-server` on loopback).

Neither tests nor benchmarks import the other's modules; both import this package.
"""
