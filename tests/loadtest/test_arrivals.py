"""Arrival schedules have the requested mean rate and dispersion."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from loadtest.arrivals import arrival_offsets


def _gaps(rate: float, burstiness: float, n: int, seed: int = 1) -> list[float]:
    times = list(itertools.islice(arrival_offsets(rate, burstiness=burstiness, seed=seed), n))
    return [b - a for a, b in zip([0.0] + times, times)]


def test_poisson_has_the_mean_rate_and_unit_dispersion() -> None:
    gaps = _gaps(rate=20.0, burstiness=1.0, n=40_000)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.02)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1.0, abs=0.03)  # exponential inter-arrivals
    # Counts per 1 s window: Poisson, variance/mean (index of dispersion) ~ 1.
    times = list(itertools.accumulate(gaps))
    counts = [0] * int(times[-1])
    for t in times:
        if int(t) < len(counts):
            counts[int(t)] += 1
    assert statistics.fmean(counts) == pytest.approx(20.0, rel=0.03)
    assert statistics.pvariance(counts) / statistics.fmean(counts) == pytest.approx(1.0, abs=0.12)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_coefficient_of_variation(burstiness: float) -> None:
    gaps = _gaps(rate=5.0, burstiness=burstiness, n=40_000)
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    cv2 = (statistics.pstdev(gaps) / statistics.fmean(gaps)) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)


def test_ramp_up_rises_linearly_then_holds_the_rate() -> None:
    times = list(itertools.takewhile(lambda t: t < 200.0,
                                     arrival_offsets(100.0, seed=3, ramp_up_s=100.0)))
    first_half = sum(1 for t in times if t < 50.0)
    second_half = sum(1 for t in times if 50.0 <= t < 100.0)
    after = sum(1 for t in times if t >= 100.0)
    # Linear ramp: 1/4 of the ramp's arrivals in its first half, 3/4 in the second.
    assert first_half == pytest.approx(100 * 50 / 4, rel=0.05)
    assert second_half == pytest.approx(3 * 100 * 50 / 4, rel=0.05)
    assert after == pytest.approx(100 * 100, rel=0.03)


def test_seeded_schedules_repeat_and_inf_rate_sends_at_once() -> None:
    a = list(itertools.islice(arrival_offsets(3.0, seed=7), 50))
    b = list(itertools.islice(arrival_offsets(3.0, seed=7), 50))
    assert a == b and a == sorted(a)
    assert list(itertools.islice(arrival_offsets(math.inf), 5)) == [0.0] * 5
    with pytest.raises(ValueError):
        next(arrival_offsets(0.0))
