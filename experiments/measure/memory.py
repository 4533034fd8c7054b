"""Peak memory of one call, above what was allocated before it.

CPU: every byte the allocator hands out during the call, kernel-internal buffers included, from the
PyTorch profiler's memory events (running sum of allocations and frees, in time order).
CUDA: the caching allocator's peak statistic, reset just before the call.
Cross-check on CPU: the process high-water mark (VmHWM, reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ side prints start/stop lines there)."""
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (embedded interpreters): nothing to silence
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes the CPU allocator holds during ``fn()`` beyond what it held before.

    Runs ``fn`` once under ``torch.profiler`` with ``profile_memory=True``; O(number of allocations).
    """
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort()
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def cuda_peak_bytes(fn: Callable[[], object], device: torch.device | None = None) -> int:
    """Peak bytes the CUDA caching allocator holds during ``fn()`` above the bytes held before it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak memory of ``fn()`` on ``device`` ('cpu' or 'cuda'), in bytes above the starting point."""
    return cuda_peak_bytes(fn) if device == "cuda" else cpu_peak_bytes(fn)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def release_free_heap() -> None:
    """Hand the C heap's free memory back to the OS (glibc's ``malloc_trim(0)``; nothing elsewhere):
    jobs run with glibc keeping what torch frees, so without this the float64 oracle's freed buffers
    stayed resident and counted as the timed calls' (980 MiB where the calls' own was 340)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_high_water_mark() -> bool:
    """Reset the process's resident high-water mark (VmHWM) to its current resident size (Linux);
    False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def high_water_mark_mib() -> float | None:
    """The process's resident high-water mark (VmHWM) in MiB, since the last reset; None without /proc."""
    try:
        return _status_kib("VmHWM") / 1024
    except (OSError, RuntimeError):
        return None


def hwm_peak_bytes(fn: Callable[[], object]) -> int | None:
    """Whole-process cross-check: rise of the resident high-water mark during ``fn()`` (Linux only).

    Coarser than :func:`cpu_peak_bytes` (pages, not allocations; the allocator may reuse freed
    memory), so it is a lower bound up to page rounding. None where /proc is not available.
    """
    if not reset_high_water_mark():
        return None
    start = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - start) * 1024
