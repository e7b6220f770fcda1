"""Code the benchmark drivers share, and the one home of every function the tests check.

Nothing here imports a driver or an experiment, and nothing imports `tests` except the scripted
server (lib/scripted_server.py), which serves `testbed/fakes.py`'s engine.
"""
