"""The process: what runs the gateway as a service.

- `gateway`: `Gateway`, uvicorn plus the engine start, signals, reloads and the ordered shutdown;
- `processes`: the engine's child processes (subreaper, waiting for them, ending them);
- `notify`: systemd's notify protocol (READY, RELOADING, STOPPING, WATCHDOG);
- `process_group`: keeps vLLM's engine processes out of a terminal's Ctrl-C (a vLLM plugin);
- `gc_heap`: the startup heap frozen out of Python's garbage collector, and full collections timed;
- `http_options`: uvicorn's HTTP protocol options (header size limit).

Kept import-free: vLLM imports `server.runner.process_group` in every engine process.
"""
