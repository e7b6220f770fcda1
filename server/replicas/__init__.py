"""Several gateway processes behind one address, for `llm-gateway serve --replicas N` (`make serve
REPLICAS=N`): each replica is a whole gateway (its own engine and event loop) on a loopback port, and
the shipped nginx site is the front door on the profile's host and port.

- `front`: the shipped nginx site rendered for given ports and paths, and the nginx.conf around it;
- `supervisor`: starts the replicas one after another, then nginx; restarts a replica that dies;
  drains them all on SIGTERM or Ctrl-C;
- `mps`: the CUDA MPS daemon that lets the replicas' kernels share the GPU (`server.cuda_mps`);
- `shared_limits`, `metrics_view`: the tenants' limits and the /metrics view across the replicas.

Under systemd the same layout comes from `deploy/install.sh --gpus N --replicas-per-gpu R` (one unit
per replica, systemd restarts them); this package is the foreground way, for a checkout.
"""
