"""The timer's stability rule: repeat until the IQR is within 10% of the median, else say so."""

from __future__ import annotations

import mmap
import random
import sys
import time

import pytest
import torch.utils.benchmark as tbench

from experiments.measure.timing import (
    MIN_SAMPLES,
    SLOW_SAMPLES,
    WARMUP_FAULT_PAGES,
    WARMUP_MAX_CALLS,
    budget_s,
    is_stable,
    quartiles,
    time_cpu,
    warm_up,
)


def test_stability_needs_samples_and_a_narrow_spread():
    assert is_stable([1.0] * MIN_SAMPLES)
    assert not is_stable([1.0] * (MIN_SAMPLES - 1))  # too few to know the spread
    assert not is_stable([1.0, 1.5, 2.0, 2.5, 3.0])  # IQR of 1.0 around a median of 2.0
    assert is_stable([1.0, 1.01, 1.02, 1.03, 1.04])


def test_quartiles_are_linear_like_numpy_and_torch_timer():
    import numpy as np

    rng = random.Random(0)
    for n in (2, 4, 5, 8, 31):
        xs = [rng.uniform(1, 2) for _ in range(n)]
        assert quartiles(xs) == pytest.approx(tuple(np.quantile(xs, [0.25, 0.5, 0.75])))
    # torch's Timer stops once its IQR (torch.quantile, linear) is small: the figure agrees with it
    five = [0.70, 0.70, 0.71, 0.72, 1.50]
    assert is_stable(five)
    m = tbench.Measurement(number_per_run=1, raw_times=five, task_spec=tbench.Timer("pass")._task_spec)
    assert m.meets_confidence(threshold=0.10)


def test_budget_stretches_for_slow_calls():
    assert budget_s(0.2, 0.001) == 1.0  # five times min_run_time
    assert budget_s(0.2, 2.0) == (SLOW_SAMPLES + 0.5) * 2.0  # room for the samples of a slow call
    assert budget_s(0.2, 100.0) == (SLOW_SAMPLES + 0.5) * 100.0  # never too short for them
    # why a slow figure may take that many: one slow call in four samples is in the IQR, in eight not
    assert not is_stable([1.0] * (MIN_SAMPLES - 1) + [2.0])
    assert is_stable([1.0] * (SLOW_SAMPLES - 1) + [2.0])


def _faulting_call(faulting_calls: int):
    """A call that touches fresh pages (4 times the warm-up's threshold) on its first
    ``faulting_calls`` calls and nothing new afterwards; ``calls`` counts its calls."""
    calls = []

    def call() -> None:
        calls.append(1)
        if len(calls) <= faulting_calls:
            pages = 4 * WARMUP_FAULT_PAGES
            with mmap.mmap(-1, pages * mmap.PAGESIZE) as m:  # anonymous: every page faults when written
                for i in range(pages):
                    m[i * mmap.PAGESIZE] = 1

    return call, calls


@pytest.mark.skipif(sys.platform == "win32", reason="no page-fault count on Windows")
@pytest.mark.parametrize("faulting", [0, 2, 100])
def test_warm_up_repeats_while_a_call_touches_new_memory(faulting):
    call, calls = _faulting_call(faulting)
    warm_up(call, min_run_time=10.0)
    assert len(calls) == min(faulting + 1, WARMUP_MAX_CALLS)


def test_a_noisy_call_is_marked_unstable_and_cpu_per_wall_is_recorded():
    rng = random.Random(0)

    def noisy() -> None:  # 1 ms or 8 ms at random: no amount of repeating narrows it to 10%
        time.sleep(0.001 if rng.random() < 0.5 else 0.008)

    t = time_cpu(noisy, min_run_time=0.2)
    assert not t.stable
    assert t.samples >= 1 and t.median_s > 0
    assert t.cpu_per_wall is not None and t.cpu_per_wall < 0.5  # asleep, not on a core
