"""The canary: the machine's speed around each CPU job, the sweep's fastest, and the store's slowdown."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from experiments.measure import canary
from experiments.measure.canary import CANARY_CALLS, SLOW_RATIO, canary_ms, job_canary_ms, slowdown
from experiments.sweep.retry import canary_ratio


def test_canary_is_the_median_of_its_timed_calls_on_the_given_threads(monkeypatch):
    # a fake clock that each fake matrix multiply advances by the next of these seconds: the first
    # call is untimed, the median of the other five (10, 50, 20, 40, 30 ms) is 30 ms
    durations = iter([0.500, 0.010, 0.050, 0.020, 0.040, 0.030])
    now, threads_seen = [100.0], []

    def fake_mm(a, b, out):
        assert a.shape == b.shape == out.shape == (canary.CANARY_N, canary.CANARY_N)
        threads_seen.append(torch.get_num_threads())
        now[0] += next(durations)

    monkeypatch.setattr(canary.torch, "mm", fake_mm)
    monkeypatch.setattr(canary.time, "perf_counter", lambda: now[0])
    before = torch.get_num_threads()
    assert CANARY_CALLS == 5
    assert canary_ms(threads=1) == pytest.approx(30.0)
    assert threads_seen == [1] * 6 and torch.get_num_threads() == before


def test_a_real_canary_takes_about_what_its_flops_need():
    # 2 * 1024^3 FLOPs: between 0.02 ms (100 TFLOP/s, more than any CPU core) and 10 s (0.2 GFLOP/s)
    t = canary_ms(threads=1)
    assert 2e-2 < t < 1e4


def test_the_jobs_canary_is_the_slower_of_the_two():
    assert job_canary_ms(20.0, 26.0) == 26.0 and job_canary_ms(30.0, 21.0) == 30.0
    assert job_canary_ms(None, 21.0) == 21.0 and job_canary_ms(None, None) is None


def test_slowdown_compares_jobs_of_the_same_host_and_thread_count():
    df = pd.DataFrame(
        {
            "env_host": ["a", "a", "a", "a", "b", "a"],
            "threads": [1, 1, 1, 2, 1, 1],
            # a record's own thread count wins over the configured one (null: every core)
            "fig_threads": [None, None, None, None, None, 2],
            "canary_before_ms": [20.0, 22.0, 30.0, 12.0, 40.0, 18.0],
            "canary_after_ms": [21.0, 25.0, 24.0, 12.0, None, 11.0],
        }
    )
    # host a, 1 thread: jobs 21, 25, 30 ms -> fastest 21; host a, 2 threads: 12 and 18; host b: 40
    expected = [1.0, 25 / 21, 30 / 21, 1.0, 1.0, 18 / 12]
    assert slowdown(df).tolist() == pytest.approx(expected)
    assert slowdown(pd.DataFrame({"env_host": ["a"]})).isna().all()  # records from before the canary


def test_the_sweep_keeps_its_fastest_canary(tmp_path):
    path = tmp_path / "canary-cpu-1.json"
    seq = [(20.0, 22.0), (18.0, 19.0), (25.0, 30.0), (None, None)]
    ratios = [canary_ratio({"canary_before_ms": b, "canary_after_ms": a}, path) for b, a in seq]
    assert ratios[:3] == pytest.approx([1.0, 1.0, 30 / 19]) and ratios[3] is None
    assert ratios[2] > SLOW_RATIO
    assert canary_ratio({}, path) is None
    assert path.read_text().count("19.0") == 1
