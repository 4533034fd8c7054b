"""A canary for the machine's speed: a short fixed matrix multiply, timed just before and just after
each CPU job in the job's own process, so that a job measured while the machine ran slow can be told
from one measured while it ran as usual.

Why: this project's 2-core VM has phases of minutes in which memory-heavy kernels run 1.3-2x slower
while the load average, steal time, page faults and the sweep's GEMM ceiling (measured once, in its
first job) all look normal; retries and rounds cannot remove a phase that covers a sweep, and a
record that does not say it was measured in one cannot be told from a regression. Over 8 minutes of
one-thread samples (~2.3 s apart) of naive attention (N=1024) beside five candidate canaries, the
1024x1024 fp32 GEMM tracked naive's slow samples best (correlation 0.76; a copy 0.20): more than 15%
above its fastest in 11 of the 14 samples in which naive was more than 10% above its median, and in
6 of the other 199.

The parent compares each job's canary with the fastest one of the sweep (``canary_ratio``); the
report compares it with the fastest of the store for the same host and thread count
(``machine_slowdown``, :func:`slowdown`).
"""

from __future__ import annotations

import statistics
import time

import pandas as pd
import torch

from .roofline import gemm_operands

#: the GEMM: (N, N) @ (N, N) in float32, 2 N^3 = 2.1 GFLOP per call (20-25 ms on one thread of the
#: project's VM; a few ms on a laptop's cores), inputs and output 12 MiB: bound by the cores and caches
CANARY_N = 1024
#: timed calls per canary (after one untimed call); the canary's time is their median
CANARY_CALLS = 5
#: a canary slower than the fastest of its sweep (or store) by more than this factor flags the job
SLOW_RATIO = 1.15


def canary_ms(threads: int) -> float:
    """Median wall time in ms of :data:`CANARY_CALLS` calls of a ``CANARY_N``-square float32 matrix
    multiply on the CPU with ``threads`` torch threads (the caller's thread count is restored).

    Costs about 6 calls' time (0.15 s on one thread of the project's VM)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b, out = gemm_operands(CANARY_N)
        torch.mm(a, b, out=out)  # first call: pages and library setup, not counted
        times = []
        for _ in range(CANARY_CALLS):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)
    finally:
        torch.set_num_threads(before)


def job_canary_ms(before_ms: float | None, after_ms: float | None) -> float | None:
    """The job's canary: the slower of the two taken around it (a slow phase that began or ended
    during the job shows in one of them), None when neither was taken."""
    taken = [t for t in (before_ms, after_ms) if t is not None]
    return max(taken) if taken else None


def job_canaries(df: pd.DataFrame) -> pd.Series:
    """Each row's job canary in ms (:func:`job_canary_ms` of its ``canary_before_ms`` and
    ``canary_after_ms`` columns), NaN where there is none."""
    cols = [c for c in ("canary_before_ms", "canary_after_ms") if c in df]
    if not cols:
        return pd.Series(float("nan"), index=df.index)
    return df[cols].apply(pd.to_numeric, errors="coerce").max(axis=1)


def machine_keys(df: pd.DataFrame) -> list[pd.Series]:
    """What canaries are compared within: the host and the job's thread count (``fig_threads``, else
    the configured ``threads``), as text."""
    blank = pd.Series(None, index=df.index, dtype=object)
    threads = pd.to_numeric(
        df.get("fig_threads", blank).combine_first(df.get("threads", blank)), errors="coerce"
    )
    return [df.get("env_host", blank).astype(str), threads_text(threads)]


def threads_text(threads: pd.Series) -> pd.Series:
    """Thread counts as text to group and match on: ``"2"``, ``"?"`` where unknown (NaN)."""
    return pd.to_numeric(threads, errors="coerce").map(lambda n: "?" if pd.isna(n) else str(int(n)))


def slowdown(df: pd.DataFrame) -> pd.Series:
    """Each row's job canary over the fastest job canary of its host and thread count in ``df``
    (:func:`machine_keys`); NaN without a canary. Above :data:`SLOW_RATIO`: measured while the
    machine ran slow."""
    job = job_canaries(df)
    return job / job.groupby(machine_keys(df)).transform("min")
