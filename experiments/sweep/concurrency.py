"""How many jobs of this suite were measuring on this host at the same time as a job.

Every job that measures leaves a marker file named by its process id in a per-user folder of the
host's temporary directory for as long as it measures. A job counts the other live markers when it
starts and when it ends; the larger count goes in its record (``concurrent_jobs``), so a timing taken
beside another job of any sweep on the host (a parallel launcher, a second sweep elsewhere) says so.

The folder is ``$ATTNBENCH_RUNNING_DIR`` when set: jobs that set the same folder see each other and
no one else. The project's tests give their sweeps a folder of their own, so that what they assert
about concurrency, settling and retries does not depend on other sweeps running on the host.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

#: environment variable naming the folder of markers (default: one per user in the temporary directory)
RUNNING_DIR_ENV = "ATTNBENCH_RUNNING_DIR"


def running_dir() -> Path:
    """The folder of markers of the jobs measuring now: ``$ATTNBENCH_RUNNING_DIR``, else a per-user
    folder of the host's temporary directory."""
    if os.environ.get(RUNNING_DIR_ENV):
        return Path(os.environ[RUNNING_DIR_ENV])
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"attnbench-running-{uid}"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def others_measuring(folder: Path | None = None) -> int:
    """Live markers of other processes (stale ones, of processes that died, are removed)."""
    folder = folder or running_dir()
    n = 0
    for marker in folder.glob("[0-9]*"):
        pid = int(marker.name) if marker.name.isdigit() else -1
        if pid == os.getpid():
            continue
        if pid > 0 and pid_alive(pid):
            n += 1
        else:
            marker.unlink(missing_ok=True)
    return n


@contextlib.contextmanager
def measuring(folder: Path | None = None) -> Iterator[Callable[[], int]]:
    """Mark this process as measuring; yields a function giving the most other jobs seen so far
    (counted at the start and each time it is called)."""
    folder = folder or running_dir()
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / str(os.getpid())
    marker.touch()
    seen = others_measuring(folder)

    def most() -> int:
        nonlocal seen
        seen = max(seen, others_measuring(folder))
        return seen

    try:
        yield most
    finally:
        marker.unlink(missing_ok=True)
