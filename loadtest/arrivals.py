"""Request arrival schedules: Poisson (burstiness 1) or gamma inter-arrival times, with a ramp-up.

Gamma inter-arrivals with shape k = burstiness and mean 1/rate have squared coefficient of
variation 1/k: k < 1 is burstier than Poisson, k > 1 smoother. Ramp-up is a linear rise of the
rate from 0 to `rate` over `ramp_up_s`, done by warping the time axis of a unit-rate process
(cumulative intensity), so burstiness is kept during the ramp.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def arrival_offsets(rate: float, *, burstiness: float = 1.0, seed: int = 0,
                    ramp_up_s: float = 0.0) -> Iterator[float]:
    """Infinite increasing send offsets in seconds from the run start."""
    if rate <= 0:
        raise ValueError("rate must be > 0 (use inf for all-at-once)")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = random.Random(seed)
    # Cumulative intensity: expected arrivals by time t. Events are at Lambda = 1/rate-free units.
    level = 0.0
    while True:
        level += rng.gammavariate(burstiness, 1.0 / burstiness)
        yield _time_at_level(level, rate, ramp_up_s)


def _time_at_level(level: float, rate: float, ramp_up_s: float) -> float:
    if ramp_up_s <= 0:
        return level / rate
    ramp_level = rate * ramp_up_s / 2.0  # area under the linear ramp
    if level <= ramp_level:
        return math.sqrt(2.0 * level * ramp_up_s / rate)
    return ramp_up_s + (level - ramp_level) / rate
