"""Whether one machine was in the same state in two runs: the ceilings each record carries (its
sweep's GEMM rate, copy and read bandwidth, measured in the sweep's first job) and its job's canary
(:mod:`experiments.measure.canary`), each run's median per host and thread count.

Why: a comparison of two runs on one host reads every difference as the code's. This project's
2-core VM halved its memory bandwidth between two days (copy 37.6 -> 18.6 GB/s) while its GEMM rate
fell 16% and its canary (a GEMM) 1.1-1.2x: the scaling store measured again with unchanged kernels
read "0 faster, 87 slower", the memory-bound pattern kernels 2.4x slower. The canary flags a slow
phase within a run; between runs the ceilings say what moved.
"""

from __future__ import annotations

import pandas as pd

from ..measure.canary import SLOW_RATIO, job_canaries, machine_keys
from ..records.rounds import numeric
from .format import rate_prefix

#: the figures of a machine's state: record column -> (name, unit: a rate's per second, in G or T as
#: its size asks, the canary's in ms; the columns that say how it was measured: a GEMM of 1024 and one
#: of 2048 run at different rates on one machine)
FIGURES = {
    "roofline_gemm_flops_per_s": ("GEMM", "FLOP/s", ("roofline_gemm_n", "roofline_gemm_dtype")),
    "roofline_copy_bytes_per_s": ("copy", "B/s", ("roofline_copy_mib",)),
    "roofline_read_bytes_per_s": ("read", "B/s", ("roofline_read_op", "roofline_copy_mib")),
    "job_canary_ms": ("canary", "ms", ()),
}


def _machine(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per host and thread count (:func:`~..measure.canary.machine_keys`: the job's measured thread
    count, as the canary groups them; a sweep's ``threads`` is null by default): the median of each of
    :data:`FIGURES` over ``df``'s rows (NaN where no row has it), and how each was measured (its
    method columns' distinct values as one text). O(rows)."""
    figs = pd.DataFrame({c: numeric(df, c) for c in FIGURES if c != "job_canary_ms"}, index=df.index)
    figs["job_canary_ms"] = job_canaries(df)
    if "roofline_dtype" in df:  # records before the GEMM's own dtype was written ran it in the job's dtype
        df = df.assign(roofline_gemm_dtype=df.get("roofline_gemm_dtype", df["roofline_dtype"]))
        df["roofline_gemm_dtype"] = df["roofline_gemm_dtype"].fillna(df["roofline_dtype"])
    how = pd.DataFrame(
        {
            c: df[[m for m in methods if m in df]].astype(str).agg("|".join, axis=1)
            if any(m in df for m in methods)
            else ""
            for c, (_, _, methods) in FIGURES.items()
        },
        index=df.index,
    )
    host, threads = machine_keys(df)
    keys = [host.rename("host"), threads.rename("threads")]
    return figs.groupby(keys).median(), how.groupby(keys).agg(lambda v: ",".join(sorted(set(v))))


def machine_changes(cur: pd.DataFrame, base: pd.DataFrame) -> dict[tuple[str, str], str]:
    """The hosts (and thread counts) whose state differs between two sets of records: any figure of
    :data:`FIGURES` measured the same way on both sides whose medians (:func:`_machine`) differ by
    more than ``SLOW_RATIO`` either way. Maps ``(host, threads)`` (as text) to a text naming each such
    figure of both sides, e.g. ``copy 18.6 GB/s (this) vs 37.6 (baseline), ...``; hosts on one side
    only are not in it."""
    (a, how_a), (b, how_b) = _machine(cur), _machine(base)
    out = {}
    for key in a.index.intersection(b.index):
        ratios = {c: a.loc[key, c] / b.loc[key, c] for c in FIGURES if how_a.loc[key, c] == how_b.loc[key, c]}
        ratios = {c: r for c, r in ratios.items() if pd.notna(r)}
        if not any(max(r, 1 / r) > SLOW_RATIO for r in ratios.values()):
            continue
        out[key] = ", ".join(f"{FIGURES[c][0]} {_both(a.loc[key, c], b.loc[key, c], c)}" for c in ratios)
    return out


def _both(this: float, baseline: float, column: str) -> str:
    """``18.6 GB/s (this) vs 37.6 (baseline)``: a rate in this side's G or T (a GPU's GEMM reads
    ``682 TFLOP/s``, not ``6.82e+05 GFLOP/s``), the canary in ms."""
    unit = FIGURES[column][1]
    if unit == "ms":
        return f"{this:.3g} ms (this) vs {baseline:.3g} (baseline)"
    prefix, scale = rate_prefix(this)
    return f"{this / scale:.3g} {prefix}{unit} (this) vs {baseline / scale:.3g} (baseline)"
