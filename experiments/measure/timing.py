"""Timing one callable: median and inter-quartile range over many repetitions.

CPU: ``torch.utils.benchmark.Timer.adaptive_autorange`` (warm-up, blocks of runs sized from a
first estimate, thread count pinned to the current one). CUDA: CUDA events around each repetition,
with the L2 cache flushed in between, and optionally a CUDA-graph replay figure.

On the CPU the warm-up repeats while a call still touches new memory (:func:`warm_up`): the C
allocator's heap grows over the first calls, and a call that page-faults is slower than the steady
state the figure is meant to describe. Every figure then repeats until it is stable (at least
:data:`MIN_SAMPLES` samples and an IQR within :data:`STABLE_IQR` of the median) or its budget runs
out: :data:`BUDGET_FACTOR` times ``min_run_time``, stretched so that a slow call still gets
:data:`SLOW_SAMPLES` samples. A figure that is still not stable says so (:attr:`Timing.stable`); the tables
mark it. Each figure also records its process CPU time over its wall time (:attr:`Timing.cpu_per_wall`:
about the thread count on a quiet machine, less when the cores were shared), the page faults of its
calls (:attr:`Timing.page_faults`) and the share of the machine's CPU time its hypervisor took
meanwhile (:attr:`Timing.steal`), so that an unstable figure says which of these it met.

A CPU figure that ends unstable while its calls still page-faulted is timed once more in the same
process (:attr:`Timing.retimed`): the heap was still growing, so those calls were warm-up the single-call
rule of :func:`warm_up` did not see (sparse's forward with autograd at N=4096, one thread, 16 calls:
after six calls that faulted at most one page at 86-108 ms, calls 10 and 12-15 faulted 150-1255
pages each and took 99-196 ms; its 17 calls after those faulted at most one page each).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.benchmark as tbench

from .machine_load import steal_fraction, steal_ticks

STABLE_IQR = 0.10  # a figure is stable when its IQR is within this fraction of its median ...
MIN_SAMPLES = 4  # ... over at least this many samples (blocks on the CPU, calls on CUDA)
BUDGET_FACTOR = 5.0  # a figure may take this many times min_run_time to become stable ...
# ... or this many calls where a call is slow: one call in four that page-faults made the IQR of four
# samples the range (naive fwd+bwd at N=4096, 1 thread: 2.0 s, and 3.9 s once); of eight it is not
SLOW_SAMPLES = 8
WARMUP_MAX_CALLS = 5  # CPU warm-up: at most this many calls ...
WARMUP_FAULT_PAGES = 256  # ... while a call still page-faults more than this many pages (1 MiB; in huge
# pages up to 512 MiB, but a warm heap of huge pages faults none at all)


#: what a record keeps of each timing figure, as ``<fig>_<field>`` (attributes of :class:`Timing`)
TIMING_FIELDS = (
    "median_s",
    "iqr_s",
    "q1_s",
    "q3_s",
    "reps",
    "samples",
    "unstable",
    "cpu_per_wall",
    "page_faults",
    "steal",
    "retimed",
)


@dataclass
class Timing:
    """Seconds per call: median and quartiles over ``samples`` samples of ``reps`` calls in all."""

    median_s: float
    q1_s: float
    q3_s: float
    reps: int
    samples: int = 1
    cpu_per_wall: float | None = None
    page_faults: int | None = None  # minor page faults of this process during the timed calls
    steal: float | None = None  # share of the machine's CPU time its hypervisor took meanwhile
    retimed: int = 0  # 1: a first window ended unstable while its calls page-faulted; timed again

    @property
    def iqr_s(self) -> float:
        return self.q3_s - self.q1_s

    @property
    def unstable(self) -> bool:
        """Too few samples, or an IQR above ``STABLE_IQR`` of the median (``not stable``)."""
        return not self.stable

    @property
    def stable(self) -> bool:
        """Enough samples, and an IQR within ``STABLE_IQR`` of the median."""
        return self.samples >= MIN_SAMPLES and self.iqr_s <= STABLE_IQR * self.median_s


def is_stable(times: list[float]) -> bool:
    """Whether per-call ``times`` already make a stable figure (see :class:`Timing`)."""
    return len(times) >= MIN_SAMPLES and summarize(times).stable


def budget_s(min_run_time: float, one_call_s: float) -> float:
    """Seconds a figure may take to become stable: ``BUDGET_FACTOR * min_run_time``, or enough for
    :data:`SLOW_SAMPLES` samples when a call is slow (the job's ``timeout_s`` bounds the whole job).
    A stable figure stops at :data:`MIN_SAMPLES`."""
    return max(BUDGET_FACTOR * min_run_time, (SLOW_SAMPLES + 0.5) * one_call_s)


def _page_faults() -> int | None:
    """Minor page faults of this process so far (``getrusage``), or None where there is no such count."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _Window:
    """What happened around one timing window: process CPU time, page faults, stolen time."""

    def __init__(self) -> None:
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()
        self.faults0, self.steal0 = _page_faults(), steal_ticks()

    def close(self, t: Timing) -> Timing:
        """Set ``t``'s CPU time over wall time, page faults and steal for the window; returns ``t``."""
        t.cpu_per_wall = (time.process_time() - self.cpu0) / max(time.perf_counter() - self.wall0, 1e-9)
        faults = _page_faults()
        t.page_faults = None if faults is None or self.faults0 is None else faults - self.faults0
        t.steal = steal_fraction(self.steal0, steal_ticks())
        return t


def still_warming(t: Timing) -> bool:
    """Whether an unstable figure's calls faulted more than :data:`WARMUP_FAULT_PAGES` pages in all:
    the heap was still growing while it was timed."""
    return not t.stable and t.page_faults is not None and t.page_faults > WARMUP_FAULT_PAGES


def _timed_when_warm(window: Callable[[], Timing]) -> Timing:
    """``window()``, and once more if :func:`still_warming` (the first window then counts as warm-up,
    like :func:`warm_up`'s calls; ``retimed`` says so)."""
    t = window()
    if still_warming(t):
        t = window()
        t.retimed = 1
    return t


def warm_up(call: Callable[[], object], min_run_time: float) -> float:
    """Call ``call`` until one call faults at most :data:`WARMUP_FAULT_PAGES` pages (at most
    :data:`WARMUP_MAX_CALLS` calls, and no new call once the figure's budget, :func:`budget_s` of
    the fastest call so far, is spent); return the last call's seconds.

    Why: glibc's heap grows over the first calls of a large kernel (naive at N=4096, H=8 faulted
    266941, 131072, 131072, then 0 pages, 650 -> 530 -> 400 ms), and counting those calls made a
    steady figure look unstable.
    """
    spent, cap = 0.0, float("inf")
    for _ in range(WARMUP_MAX_CALLS):
        f0, t0 = _page_faults(), time.perf_counter()
        call()
        last = time.perf_counter() - t0
        f1 = _page_faults()
        spent += last
        cap = min(cap, budget_s(min_run_time, last))
        if f0 is None or f1 is None or f1 - f0 <= WARMUP_FAULT_PAGES or spent >= cap:
            break
    return last


def quartiles(times: list[float]) -> tuple[float, float, float]:
    """First quartile, median and third quartile of ``times``, interpolated linearly between the
    sorted values (numpy's and ``torch.quantile``'s default, so the rule by which ``Timer`` stops
    and the figure's own IQR agree: of five samples, one slow one is outside the IQR by both)."""
    if len(times) == 1:
        return times[0], times[0], times[0]
    q1, med, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return q1, med, q3


def summarize(times: list[float]) -> Timing:
    """Median and quartiles of per-call ``times`` (seconds), one repetition each."""
    q1, med, q3 = quartiles(times)
    return Timing(median_s=med, q1_s=q1, q3_s=q3, reps=len(times), samples=len(times))


def time_cpu(fn: Callable[[], object], min_run_time: float = 1.0, threads: int | None = None) -> Timing:
    """Time ``fn`` on the CPU with ``Timer.adaptive_autorange``: blocks of calls until the figure is
    stable or its budget (:func:`budget_s`) is spent; once more if its calls were still page-faulting
    (:func:`still_warming`)."""
    one = warm_up(fn, min_run_time)  # and a first estimate of one call
    budget = budget_s(min_run_time, one)
    timer = tbench.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads or torch.get_num_threads())

    def window() -> Timing:
        w = _Window()
        m = timer.adaptive_autorange(threshold=STABLE_IQR, min_run_time=min_run_time, max_run_time=budget)
        times = m.times  # per-call seconds, one per block
        q1, _, q3 = quartiles(times)
        t = Timing(
            median_s=m.median, q1_s=q1, q3_s=q3, reps=len(times) * m.number_per_run, samples=len(times)
        )
        return w.close(t)

    return _timed_when_warm(window)


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
    budget = budget_s(min_run_time, one)
    times: list[float] = []
    w = _Window()
    while True:  # batches of reps until the figure is stable or its budget is spent
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends, strict=True):
            flush.zero_()  # evict what the last call left in L2, outside the window
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times += [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]
        if is_stable(times) or sum(times) >= budget or len(times) >= 10_000:
            break
    return w.close(summarize(times))


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
    for ``additive``), which is not what one training step does. On the CPU the window is timed once
    more if its calls were still page-faulting (:func:`still_warming`).
    """
    if device == "cuda":
        return _time_backward_cuda(forward, backward, min_run_time, min_reps)
    one = warm_up(lambda: backward(forward()), min_run_time)
    budget = budget_s(min_run_time, one)

    def window() -> Timing:  # page faults and CPU time count the forward calls too
        times: list[float] = []
        total = 0.0
        w = _Window()
        # enough calls, then on until stable or out of budget
        while len(times) < min_reps or total < min_run_time or (not is_stable(times) and total < budget):
            graph = forward()
            t0 = time.perf_counter()
            backward(graph)
            t = time.perf_counter() - t0
            del graph
            times.append(t)
            total += t
            if len(times) >= 1000:
                break
        return w.close(summarize(times))

    return _timed_when_warm(window)


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
    t0 = time.perf_counter()
    backward(forward())  # warm-up
    torch.cuda.synchronize()
    budget = budget_s(min_run_time, time.perf_counter() - t0)
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
        done = total >= min_run_time and (is_stable(times) or total >= budget)
        if done or len(times) >= 1000:
            return summarize(times)
        # enough repetitions to fill the rest of min_run_time at the rate seen so far
        batch = int(min(1000 - len(times), max(min_reps, (min_run_time - total) / (total / len(times)))))


def time_call(fn: Callable[[], object], device: str, min_run_time: float = 1.0) -> Timing:
    """Median/IQR seconds per call of ``fn`` on ``device``."""
    if device == "cuda":
        return time_cuda(fn, min_run_time=min_run_time)
    return time_cpu(fn, min_run_time=min_run_time)
