"""Where CPU jobs start from: the fork server's context, and starting the server early.

The fork server imports torch and the suite before it forks its first job (:mod:`.cpu_forkserver`):
about 4 s on this project's 2-core VM, which a sweep used to wait for at its first job. Started at
the top of ``run.py`` instead, the server imports while the sweep's own process imports and composes
its config, on the other core: a one-job run (``seq_len=64``, no roofline) took 10.0-10.4 s, and
5.3-5.5 s with the server started early. This module imports neither torch nor Hydra, so that the
start comes first.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Sequence
from typing import Any

from .allocator import set_job_allocator_env

#: the module the server imports before its first fork
PRELOAD = "experiments.sweep.cpu_forkserver"

#: Hydra's flags that print something and run no job
_NO_JOB_FLAGS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc"}


def cpu_context() -> Any | None:
    """The fork-server context CPU jobs start from, None where the platform has no fork server
    (Windows). Processes it starts keep the memory torch frees (:mod:`.allocator`)."""
    set_job_allocator_env()  # before the server exists: read at process start
    if "forkserver" not in mp.get_all_start_methods():
        return None
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    return ctx


def forks_cpu_jobs_here(argv: Sequence[str]) -> bool:
    """Whether a ``run.py`` command line (``argv`` without the program) will fork CPU jobs from this
    process: not with Hydra's flags that run nothing (``--help``, ``--cfg``), another launcher
    (``hydra/launcher=joblib``: its workers start servers of their own; Slurm: on the nodes), jobs run
    inline (``isolate=false``) or a CUDA device named (``device=cuda``). A sweep a named one
    (``experiment=gpu``) sends to the GPU is not seen here: its server idles, costing nothing but its
    import."""
    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        if arg in _NO_JOB_FLAGS or arg.startswith(("--cfg=", "--info=")):
            return False
        if key == "hydra/launcher" and value != "basic":
            return False
        if key == "isolate" and value.lower() in {"false", "0", "no", "off"}:
            return False
        if key == "device" and value.startswith("cuda") and "," not in value:
            return False
    return True


def start_early(argv: Sequence[str]) -> bool:
    """Start the CPU jobs' fork server now, without waiting for it (it imports in the background),
    where ``argv`` will fork CPU jobs here (:func:`forks_cpu_jobs_here`). True if started."""
    if not forks_cpu_jobs_here(argv) or cpu_context() is None:
        return False
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return True


def stop_early() -> bool:
    """Kill the fork server :func:`start_early` started, where the command ends before any job (a
    refused command line): left alone, it would finish importing torch and the suite after this
    process exited (a refused command line saved about 2 s of the 11 s of CPU it took on this
    project's 2-core VM). True if one was killed.
    Reads ``multiprocessing.forkserver``'s private ``_forkserver_pid`` (there is no public handle);
    without it, nothing is killed."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if not pid:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    server._forkserver_pid = None  # so nothing here forks from it again
    return True
