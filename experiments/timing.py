"""Timing one callable: median and inter-quartile range over many repetitions.

CPU: ``torch.utils.benchmark.Timer.blocked_autorange`` (warm-up, blocks of runs sized from a
first estimate, thread count pinned to the current one). CUDA: CUDA events around each repetition,
with the L2 cache flushed in between, and optionally a CUDA-graph replay figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.benchmark as tbench


@dataclass
class Timing:
    """Seconds per call: median and quartiles over ``reps`` repetitions (blocks on CPU)."""

    median_s: float
    q1_s: float
    q3_s: float
    reps: int

    @property
    def iqr_s(self) -> float:
        return self.q3_s - self.q1_s


def _summary(times: list[float]) -> Timing:
    """Median and quartiles of per-call ``times`` (seconds), one repetition each."""
    times = sorted(times)
    q1, med, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return Timing(median_s=med, q1_s=q1, q3_s=q3, reps=len(times))


def time_cpu(fn: Callable[[], object], min_run_time: float = 1.0, threads: int | None = None) -> Timing:
    """Time ``fn`` on the CPU with ``Timer.blocked_autorange`` (it warms up first)."""
    timer = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads or torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=min_run_time)
    times = sorted(m.times)  # per-call seconds, one per block
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return Timing(median_s=m.median, q1_s=q1, q3_s=q3, reps=len(times) * m.number_per_run)


def time_cuda(
    fn: Callable[[], object], min_run_time: float = 1.0, warmup: int = 5, flush_mib: int = 256
) -> Timing:
    """Time ``fn`` on CUDA with events, flushing L2 by writing ``flush_mib`` MiB before each run.

    ``fn`` must not synchronise: the host enqueues every repetition (flush, start event, ``fn``, end
    event) without waiting, so the GPU runs them back to back and each window holds only ``fn``'s
    kernels; one synchronisation after the last repetition. As ``triton.testing.do_bench`` does.
    """
    flush = torch.empty(flush_mib * 2**20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    # estimate one call (median of 5) to decide how many repetitions fill min_run_time
    est = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)]
    for s, e in est:
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    one = max(statistics.median(s.elapsed_time(e) for s, e in est) / 1e3, 1e-6)
    reps = int(min(1000, max(10, min_run_time / one)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends, strict=True):
        flush.zero_()  # evict what the last call left in L2, outside the window
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return _summary([s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)])


def time_cuda_graph(fn: Callable[[], object], min_run_time: float = 1.0) -> tuple[Timing | None, str | None]:
    """Time replays of ``fn`` captured in a CUDA graph (no launch overhead).

    Returns ``(timing, None)``, or ``(None, reason)`` when ``fn`` cannot be captured (a host
    synchronisation inside it, a CPU-side decision on a GPU value, an op without capture support).
    """
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        try:
            torch.cuda.synchronize()  # let the failed capture's stream settle before the next figure
        except RuntimeError:
            pass
        return None, f"capture failed: {type(exc).__name__}: {text}"[:300]
    return time_cuda(graph.replay, min_run_time=min_run_time), None


def time_backward(
    forward: Callable[[], object],
    backward: Callable[[object], object],
    device: str,
    min_run_time: float = 1.0,
    min_reps: int = 5,
) -> Timing:
    """Time ``backward(forward())`` counting only the backward, each on a fresh graph.

    A hand-written loop on purpose: ``Timer`` repeats one statement, and repeating a backward over a
    retained graph keeps every recomputed activation of checkpointed variants alive (O(N^2) memory
    for ``additive``), which is not what one training step does.
    """
    if device == "cuda":
        return _time_backward_cuda(forward, backward, min_run_time, min_reps)
    times: list[float] = []
    backward(forward())  # warm-up
    total = 0.0
    while len(times) < min_reps or total < min_run_time:
        graph = forward()
        t0 = time.perf_counter()
        backward(graph)
        t = time.perf_counter() - t0
        del graph
        times.append(t)
        total += t
        if len(times) >= 1000:
            break
    return _summary(times)


def _time_backward_cuda(
    forward: Callable[[], object],
    backward: Callable[[object], object],
    min_run_time: float,
    min_reps: int,
    flush_mib: int = 256,
) -> Timing:
    """CUDA events around each backward; its forward and the L2 flush are enqueued before the start
    event, and the host never waits inside the loop (one synchronisation per batch of repetitions)."""
    flush = torch.empty(flush_mib * 2**20, dtype=torch.uint8, device="cuda")
    backward(forward())  # warm-up
    torch.cuda.synchronize()
    times: list[float] = []
    batch = min_reps
    while True:
        events = []
        for _ in range(batch):
            graph = forward()
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            backward(graph)
            e.record()
            del graph
            events.append((s, e))
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) / 1e3 for s, e in events]
        total = sum(times)
        if total >= min_run_time or len(times) >= 1000:
            return _summary(times)
        # enough repetitions to fill the rest of min_run_time at the rate seen so far
        batch = int(min(1000 - len(times), max(min_reps, (min_run_time - total) / (total / len(times)))))


def time_call(fn: Callable[[], object], device: str, min_run_time: float = 1.0) -> Timing:
    """Median/IQR seconds per call of ``fn`` on ``device``."""
    if device == "cuda":
        return time_cuda(fn, min_run_time=min_run_time)
    return time_cpu(fn, min_run_time=min_run_time)
