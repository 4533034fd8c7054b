"""Ending ``run.py`` and the CPU jobs' fork server without tearing their modules down.

Python's own exit, after the ``atexit`` handlers, frees every module it imported; with torch loaded
that took 1.8 s of every ``run.py`` command on this project's 2-core VM, and about as long again in
the fork server, which exits when ``run.py`` does and holds the stdout and stderr it inherited, so a
caller that reads them (a pipe, ``subprocess.run``) waited for both: a one-job sweep ended 3 s after
its last line. The handlers still run (logging's flush, multiprocessing's child cleanup); only the
teardown that follows them is skipped. This module imports neither torch nor Hydra.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Run the ``atexit`` handlers, flush stdout and stderr, and end the process with ``code``
    without the module teardown. Where a thread that Python's exit would wait for is still running,
    exits the usual way (``sys.exit``), which waits for it."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()  # what Python's exit runs first
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


def exit_last() -> None:
    """Make this process's exit skip the module teardown once its other ``atexit`` handlers have run:
    called before any other module registers one (handlers run last-in, first-out), as the fork server's
    preload does. Its exit status is 0: the server ends only when the process it serves has."""
    atexit.register(os._exit, 0)


def exit_status(exc: SystemExit) -> int | None:
    """The status a :class:`SystemExit` ends the process with, or None where Python's exit prints its
    message (a string code): that path is left to Python."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else None
