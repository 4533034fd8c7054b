"""Run a job in a child process with a timeout, so a crash, a hang or the OOM killer becomes a
status in the parent instead of ending the sweep.

Children come from a fork server where the platform has one (Linux, macOS): a server process
imports torch and the suite once, and each job is a fresh fork of it, which starts in a fraction of
a second instead of the seconds a spawned interpreter spends importing torch. The server has never
run a torch op or touched CUDA, so every job still starts from a clean state. Elsewhere (Windows)
children are spawned."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from typing import Any

from .job import measure


def _child(cfg: dict[str, Any], conn: Any) -> None:
    # the parent handles Ctrl-C; a child should not print its own traceback for it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send(measure(cfg))
    conn.close()


def _context() -> Any:
    """The fork-server context with the job module preloaded, or spawn where there is none."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["experiments.job"])  # torch and the variants, imported once
        return ctx
    return mp.get_context("spawn")


def run_isolated(cfg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``measure(cfg)`` in a fresh child process; adds statuses ``timeout`` and ``killed``.

    Also reports ``wall_s``: wall time of the whole child (the caller subtracts the measurement
    time to get the overhead).
    """
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(cfg, send), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    send.close()  # so recv sees EOF if the child dies
    result: dict[str, Any] | None = None
    try:
        if recv.poll(timeout_s):
            try:
                result = recv.recv()
            except EOFError:
                result = None  # the child died before sending
        else:
            proc.kill()
            proc.join(5)
            return _blank("timeout", f"no result within {timeout_s:g} s; child killed", t0)
        proc.join(10)
    except KeyboardInterrupt:
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


def run_inline(cfg: dict[str, Any]) -> dict[str, Any]:
    """``measure(cfg)`` in this process (isolation off: quicker, but a crash ends the sweep)."""
    t0 = time.perf_counter()
    result = measure(cfg)
    result["wall_s"] = time.perf_counter() - t0
    return result
