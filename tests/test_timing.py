"""The timer's stability rule: repeat until the IQR is within 10% of the median, else say so."""

from __future__ import annotations

import mmap
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch.utils.benchmark as tbench

from experiments.measure.machine_load import steal_fraction
from experiments.measure.timing import (
    MIN_SAMPLES,
    SLOW_SAMPLES,
    WARMUP_FAULT_PAGES,
    WARMUP_MAX_CALLS,
    Timing,
    budget_s,
    is_stable,
    quartiles,
    still_warming,
    time_backward,
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


def _touch(pages: int) -> None:
    """Write one byte to each of ``pages`` fresh anonymous pages: ``pages`` minor faults."""
    with mmap.mmap(-1, pages * mmap.PAGESIZE) as m:
        for i in range(pages):
            m[i * mmap.PAGESIZE] = 1


@pytest.mark.skipif(sys.platform == "win32", reason="no page-fault count on Windows")
def test_a_figure_counts_the_page_faults_of_its_calls():
    def call() -> None:  # 64 fresh pages on every call, from the first to the last
        _touch(64)

    t = time_cpu(call, min_run_time=0.05)
    assert t.page_faults is not None
    assert t.page_faults >= 64 * t.reps  # every timed call faulted its 64 pages, at least


def test_steal_is_the_stolen_share_of_all_cpu_time():
    assert steal_fraction((10, 1000), (15, 1100)) == pytest.approx(0.05)
    assert steal_fraction((10, 1000), (10, 1000)) is None  # no tick passed
    assert steal_fraction(None, (10, 1000)) is None  # no steal count (not Linux)


def test_still_warming_needs_an_unstable_figure_whose_calls_faulted():
    steady = dict(median_s=1.0, q1_s=0.99, q3_s=1.01, reps=8, samples=8)
    spread = dict(median_s=1.0, q1_s=0.8, q3_s=1.2, reps=8, samples=8)
    assert still_warming(Timing(**spread, page_faults=WARMUP_FAULT_PAGES + 1))
    assert not still_warming(Timing(**spread, page_faults=WARMUP_FAULT_PAGES))  # a few faults: noise
    assert not still_warming(Timing(**spread, page_faults=None))  # no count: nothing known
    assert not still_warming(Timing(**steady, page_faults=10 * WARMUP_FAULT_PAGES))  # stable: keep it


class FakeClock:
    """A stand-in for the ``time`` module inside :mod:`experiments.measure.timing`: ``perf_counter``
    moves only when a fake call says it took time (``advance``), so a figure's spread is the one the
    test scripts, however busy the machine is; ``process_time`` stays real."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    process_time = staticmethod(time.process_time)


def _backward_that_settles(clock: FakeClock, shaky_s: float, faults: bool):
    """A fake backward: its first call takes 3 ms; then, until ``shaky_s`` seconds of calls, 1 ms or
    20 ms by turns (touching 4x the warm-up threshold of fresh pages each when ``faults``); then 3 ms.
    Its time passes on ``clock``."""
    state = {"calls": 0, "spent": 0.0}

    def backward(_graph: object) -> None:
        state["calls"] += 1
        shaky = state["calls"] > 1 and state["spent"] < shaky_s
        if shaky and faults:
            _touch(4 * WARMUP_FAULT_PAGES)
        took = (0.001 if state["calls"] % 2 else 0.02) if shaky else 0.003
        clock.advance(took)
        state["spent"] += took  # as the timer counts it

    return backward


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    from experiments.measure import timing

    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


@pytest.mark.skipif(sys.platform == "win32", reason="no page-fault count on Windows")
def test_a_figure_that_ends_unstable_while_its_calls_fault_is_timed_again(clock):
    # the shaky calls last as long as the first window's budget (5 x 0.05 s): that window cannot end
    # stable; they fault, so it was warm-up, and the second window sees the steady 3 ms
    backward = _backward_that_settles(clock, shaky_s=0.25, faults=True)
    t = time_backward(lambda: None, backward, "cpu", min_run_time=0.05)
    assert t.retimed == 1
    assert t.stable
    assert t.median_s == pytest.approx(0.003)
    assert t.page_faults is not None and t.page_faults <= 2 * 4 * WARMUP_FAULT_PAGES  # at most a straggler


def test_an_unstable_figure_without_page_faults_is_not_timed_again(clock):
    backward = _backward_that_settles(clock, shaky_s=10.0, faults=False)  # shaky all along, no fresh memory
    t = time_backward(lambda: None, backward, "cpu", min_run_time=0.05)
    assert t.retimed == 0
    assert not t.stable


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_jobs_own_child_processes_are_its_own_work_not_others():
    """torch.compile's worker processes compiled beside flex's timed decoding step, and counted as other
    processes' work, they marked its time `*` (beside other work): a child's CPU time is the job's own.
    The child burns a fixed amount of CPU time, so the count does not depend on how busy the machine is."""
    import subprocess

    from experiments.measure.machine_load import _HZ, snapshot

    burn = "import time\nwhile time.process_time() < 0.4: pass\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", burn])  # alive (asleep) at the second snapshot
    try:
        start = snapshot()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until /proc says the child has burnt 0.3 s
            stat = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            if (int(stat[11]) + int(stat[12])) / _HZ >= 0.3:
                break
            time.sleep(0.05)
        end = snapshot()
        alive = child.poll() is None  # its time is still its own, not yet its parent's
    finally:
        child.kill()
        child.wait()
    assert alive
    assert (end.own - start.own) / _HZ >= 0.25  # its time since the first snapshot, at a jiffy's rounding
