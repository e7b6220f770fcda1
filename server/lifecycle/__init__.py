"""The engine's lifecycle: who owns the running engine and how it changes.

- `holder`: `EngineHolder`, the engine's state, the leases requests take, drain and reload;
- `slot`: one engine and its leases, the states, a reload's result;
- `in_place`: the in-place weight swap (pause, load, resume, roll back);
- `weights`: what an in-place reload may swap (model files compared before anything pauses);
- `stall`: `StallWatch`, the rule that tells a stalled engine from a slow one.
"""
