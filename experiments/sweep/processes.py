"""One kernel job measured in several fresh processes (``processes=k``); its record is the median one.

Why: on a CPU a whole process can run 5-20% faster or slower than the next one for the same job
(where its memory lands, how its threads are scheduled), while the figure's own IQR stays narrow.
Measured on this project's 2-core VM: axial's fwd+bwd at N=256 took 2.78-3.42 ms in five processes
with IQRs of 2-14%, and two sweeps minutes apart disagreed by more than 15% on 3-7 of 58 figures.
A figure from one process cannot show that; the median of k processes is steadier, and the record
keeps the range (as pyperf runs every benchmark in many processes for the same reason).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: timing figures that get a range across processes (the kernel job's prefixes)
TIMED = ("fwd", "bwd", "fwd_bwd", "fwd_graph")


def main_figure(figures: dict[str, Any]) -> str:
    """The figure the median process is chosen by: the job's mode (fwd+bwd, else fwd)."""
    return "fwd_bwd" if "fwd_bwd_median_s" in figures else "fwd"


def run_in_processes(run_one: Callable[[bool], dict[str, Any]], processes: int) -> dict[str, Any]:
    """Run ``run_one(first)`` up to ``processes`` times (each a fresh process; ``first`` is True once,
    for what a sweep measures once, such as the roofline) and return :func:`median_process` of them.

    A job that is not ``ok`` in its first process is not repeated: its status is the answer.
    """
    first = run_one(True)
    if processes <= 1 or first["status"] != "ok" or "fwd_median_s" not in first.get("figures", {}):
        return first
    results, failed = [first], []
    for _ in range(processes - 1):
        r = run_one(False)
        (results if r["status"] == "ok" else failed).append(r)
    return median_process(results, failed)


def median_process(results: list[dict[str, Any]], failed: list[dict[str, Any]]) -> dict[str, Any]:
    """The result of the process whose main figure is the median (the lower middle for an even
    count), with every timing figure's range across ``results`` (``<fig>_proc_min_s``,
    ``<fig>_proc_max_s``), ``processes`` (how many measured) and ``processes_failed`` (why others
    did not). Every figure of the record comes from that one process, so its derived figures
    (FLOP/s, tokens/s) agree with its times."""
    key = f"{main_figure(results[0]['figures'])}_median_s"
    ordered = sorted(results, key=lambda r: r["figures"][key])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    fig = dict(chosen["figures"])
    for p in TIMED:
        times = [
            r["figures"][f"{p}_median_s"] for r in results if r["figures"].get(f"{p}_median_s") is not None
        ]
        if times:
            fig[f"{p}_proc_min_s"], fig[f"{p}_proc_max_s"] = min(times), max(times)
    fig["processes"] = len(results)
    if failed:
        fig["processes_failed"] = "; ".join(f"{r['status']}: {r['reason']}" for r in failed)
    chosen["figures"] = fig
    chosen["roofline"] = results[0].get("roofline")  # measured by the first process only
    # the job's cost is every process's
    for k in ("wall_s", "measure_s"):
        chosen[k] = sum(r.get(k) or 0.0 for r in results + failed)
    return chosen
