"""Run a job in a child process with a timeout, so a crash, a hang or the OOM killer becomes a
status in the parent instead of ending the sweep.

CPU jobs come from a fork server where the platform has one (Linux, macOS): a server process
imports torch and the suite once, with every GPU hidden from it (:mod:`experiments.sweep.cpu_forkserver`),
and each job is a fresh fork of it, which starts in a fraction of a second instead of the seconds a
spawned interpreter spends importing torch. CUDA jobs are spawned: CUDA cannot be initialised in a
fork of a process that has queried it, and a fresh interpreter per GPU job also gives each job its
own CUDA context. Elsewhere (Windows) every child is spawned.

A child never outlives the sweep: it asks the kernel for SIGKILL when its parent dies (Linux) and a
watchdog thread ends it when the sweep's process is gone (the fork server's children, other OSes).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..measure.kernel import measure
from ..measure.spec import JobSpec
from .allocator import set_job_allocator_env
from .concurrency import pid_alive
from .cpu_server import cpu_context

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(pid: int, poll_s: float = 1.0) -> None:
    """End this process when process ``pid`` (the sweep) is gone: at once through the kernel where
    the sweep is the direct parent (Linux), else within ``poll_s`` through a watchdog thread."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still covers it

    def watch() -> None:
        while True:
            if not pid_alive(pid):
                os._exit(1)
            time.sleep(poll_s)

    if not pid_alive(pid):  # the parent died before the kernel was asked
        os._exit(1)
    threading.Thread(target=watch, name="attnbench-watchdog", daemon=True).start()


def _child(spec: JobSpec, conn: Any, sweep_pid: int, roofline: bool) -> None:
    die_with(sweep_pid)
    # the parent handles Ctrl-C; a child should not print its own traceback for it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(measure(spec, roofline))
    conn.close()


def context_for(device: str) -> Any:
    """The multiprocessing context a job on ``device`` runs in: the GPU-free fork server for CPU
    jobs, spawn for CUDA jobs and where there is no fork server. Processes it starts keep the memory
    torch frees (:mod:`experiments.sweep.allocator`)."""
    if device == "cpu" and (ctx := cpu_context()) is not None:
        return ctx
    set_job_allocator_env()  # before a spawned child exists: read at process start
    return mp.get_context("spawn")


@contextlib.contextmanager
def _standard_start_method(ctx: Any) -> Iterator[None]:
    """Let a child start from inside a process whose global start method is not a standard one.

    A launcher's worker may set its own (joblib's loky workers set ``loky``); a child is told the
    parent's global method and fails to set it ("cannot find context for 'loky'") before the job
    runs. For the start only, the global method is the child's own context.
    """
    default = mp.context._default_context  # private, but the one place the global method lives
    saved = default._actual_context
    if saved is not None and saved.get_start_method() not in mp.get_all_start_methods():
        default._actual_context = ctx
    try:
        yield
    finally:
        default._actual_context = saved


HEARTBEAT_S = 10.0  # a job running longer than this says so, every this many seconds


def run_isolated(
    spec: JobSpec,
    timeout_s: float,
    roofline: bool = False,
    heartbeat: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """``measure(spec, roofline)`` in a fresh child process (``spec`` goes there pickled); adds
    statuses ``timeout`` and ``killed``.

    Also reports ``wall_s``: wall time of the whole child (the caller subtracts the measurement
    time to get the overhead). ``heartbeat(elapsed_s)`` is called every :data:`HEARTBEAT_S` seconds
    while the child runs (a long job shows it is alive).
    """
    ctx = context_for(spec.device.value)
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(spec, send, os.getpid(), roofline), daemon=True)
    t0 = time.perf_counter()
    with _standard_start_method(ctx):
        proc.start()
    send.close()  # so recv sees EOF if the child dies
    result: dict[str, Any] | None = None
    try:
        ready = False
        while not ready:
            left = timeout_s - (time.perf_counter() - t0)
            if left <= 0:
                break
            ready = recv.poll(min(left, HEARTBEAT_S))
            if not ready and heartbeat is not None and time.perf_counter() - t0 < timeout_s:
                heartbeat(time.perf_counter() - t0)
        if ready:
            try:
                result = recv.recv()
            except EOFError:
                result = None  # the child died before sending
        else:
            proc.kill()
            proc.join(5)
            return _blank("timeout", f"no result within {timeout_s:g} s; child killed", t0)
        proc.join(10)
    except BaseException:  # Ctrl-C, SIGTERM (the runner turns it into KeyboardInterrupt), anything
        proc.kill()
        proc.join(5)
        raise
    if result is None:
        proc.join(5)
        code = proc.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            why = " (out of memory? the OOM killer sends SIGKILL)" if -code == signal.SIGKILL else ""
            return _blank("killed", f"child ended by {name}{why}", t0)
        return _blank("error", f"child exited with code {code} before reporting", t0)
    result["wall_s"] = time.perf_counter() - t0
    return result


def _blank(status: str, reason: str, t0: float) -> dict[str, Any]:
    return {
        "status": status,
        "reason": reason,
        "variant": None,
        "figures": {},
        "wall_s": time.perf_counter() - t0,
    }


def run_inline(spec: JobSpec, roofline: bool = False) -> dict[str, Any]:
    """``measure(spec, roofline)`` in this process (isolation off: quicker, but a crash ends the sweep)."""
    t0 = time.perf_counter()
    result = measure(spec, roofline)
    result["wall_s"] = time.perf_counter() - t0
    return result
