"""Where one call's time goes: the kernels it ran, by time, from PyTorch's profiler.

On CUDA the rows are the GPU kernels (their device time, so launch gaps do not count; a tail kernel
that one long program keeps busy shows up as the largest row), and the call's wall time beside their
sum says how much of it the GPU was idle; on the CPU the operators' own time (``self``: a parent's
time excludes its children's) and one more row for the wall time outside every operator (a C kernel
called through ``ctypes``, Python), so the rows add up to the call. Used by
``scripts/pattern_vs_flex.py --profile`` to show which kernel of a variant's forward and backward
sets its time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelTime:
    """One kernel (CUDA) or operator (CPU) of a profiled call: its ``calls`` and total ``ms``, and its
    ``share`` of the call's total."""

    name: str
    calls: int
    ms: float
    share: float


OUTSIDE = "(outside PyTorch's operators: a C kernel through ctypes, Python)"


def kernel_table(fn: Callable[[], object], device: str) -> tuple[list[KernelTime], float, float]:
    """Profile one call of ``fn`` (after one unprofiled call, which compiles and fills caches) on
    ``device`` (``cpu`` or ``cuda``): its kernels, longest first, their total in ms, and the call's
    wall time in ms (profiler overhead included). ``O(events)`` beyond the call itself."""
    import time

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    rows = []
    for e in prof.key_averages():
        if cuda and e.device_type != DeviceType.CUDA:
            continue  # the host's operators: their device time is their kernels', counted below
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, e.count, us / 1e3))
    if not cuda:
        rows.append((OUTSIDE, 1, max(0.0, wall - sum(ms for _, _, ms in rows))))
    total = sum(ms for _, _, ms in rows)
    table = [KernelTime(name, calls, ms, ms / total if total else 0.0) for name, calls, ms in rows]
    return sorted(table, key=lambda r: -r.ms), total, wall


def format_table(table: list[KernelTime], total: float, top: int = 8, indent: str = "    ") -> str:
    """The ``top`` longest rows of :func:`kernel_table`, one per line (ms, share, calls, a name cut
    to 90 characters), and a line for the rest."""
    lines = [f"{indent}{r.ms:9.3f} ms {r.share:6.1%} {r.calls:5d}x  {r.name[:90]}" for r in table[:top]]
    rest = table[top:]
    if rest:
        ms = sum(r.ms for r in rest)
        lines.append(f"{indent}{ms:9.3f} ms {ms / total:6.1%}        ({len(rest)} more)")
    return "\n".join(lines)
