"""Each replica's share of the GPU's memory (server/replicas/supervisor.memory_share), which
deploy/install.sh --replicas-per-gpu computes alike (tests/e2e/test_systemd.py)."""

from __future__ import annotations

import pytest

from server.replicas.supervisor import REPLICA_RESERVE, memory_share
from server.settings import EngineProfile, Settings


def settings(device: str, util: float = 0.90) -> Settings:
    return Settings(engine=EngineProfile(device=device, gpu_memory_utilization=util, served_model_name="m",
                                         **({"kv_cache_memory_bytes": 1} if device == "cpu" else {})))


H100_GIB = 79.18  # what vLLM sees of an H100 80GB
BEYOND_SHARE_GIB = 5.7  # what the first replica held past its share there (41.32 GiB at 0.45)


@pytest.mark.parametrize("n,share", [(1, "0.90"), (2, "0.38"), (3, "0.23"), (4, "0.15")])
def test_replicas_leave_a_reserve_each(n: int, share: str) -> None:
    """On the H100 two replicas at 0.45 did not fit: the first held 41.32 of 79.18 GiB, and the
    second ran out of memory at its start. With the reserve, N engines each holding that much past
    their share fit the card."""
    assert memory_share(settings("gpu"), n) == share
    if n > 1:
        assert n * (float(share) * H100_GIB + BEYOND_SHARE_GIB) <= H100_GIB
        assert float(share) == pytest.approx(0.90 / n - REPLICA_RESERVE, abs=0.01)


def test_cpu_replicas_keep_their_own_kv_cache() -> None:
    assert memory_share(settings("cpu"), 2) is None
