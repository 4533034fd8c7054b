"""The timer's stability rule: repeat until the IQR is within 10% of the median, else say so."""

from __future__ import annotations

import random
import time

from experiments.measure.timing import MIN_SAMPLES, budget_s, is_stable, time_cpu


def test_stability_needs_samples_and_a_narrow_spread():
    assert is_stable([1.0] * MIN_SAMPLES)
    assert not is_stable([1.0] * (MIN_SAMPLES - 1))  # too few to know the spread
    assert not is_stable([1.0, 1.5, 2.0, 2.5, 3.0])  # IQR of 1.0 around a median of 2.0
    assert is_stable([1.0, 1.01, 1.02, 1.03, 1.04])


def test_budget_stretches_for_slow_calls_and_is_capped():
    assert budget_s(0.2, 0.001) == 1.0  # five times min_run_time
    assert budget_s(0.2, 2.0) == (MIN_SAMPLES + 0.5) * 2.0  # room for the samples of a slow call
    assert budget_s(0.2, 100.0) == 60.0


def test_a_noisy_call_is_marked_unstable_and_cpu_per_wall_is_recorded():
    rng = random.Random(0)

    def noisy() -> None:  # 1 ms or 8 ms at random: no amount of repeating narrows it to 10%
        time.sleep(0.001 if rng.random() < 0.5 else 0.008)

    t = time_cpu(noisy, min_run_time=0.2)
    assert not t.stable
    assert t.samples >= 1 and t.median_s > 0
    assert t.cpu_per_wall is not None and t.cpu_per_wall < 0.5  # asleep, not on a core
