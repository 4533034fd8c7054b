"""One sweep at a time per records folder, and a folder known to be writable before any work.

Two sweeps timing jobs into one ``records_dir`` at once measure every configuration twice, each under
the other's load. The first sweep holds an exclusive ``flock`` on ``<records_dir>/.attnbench.lock``
for as long as its process lives (the kernel drops it when the process ends, however it ends, so
there is no stale lock to clean up); a second sweep is refused with one line that names the first.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

LOCK_NAME = ".attnbench.lock"
MIN_FREE_BYTES = 64 * 2**20  # below this, records (a few kB each) and reports may not fit

_held: dict[str, int] = {}  # lock path -> open fd holding the flock, for this process's lifetime


class RecordsDirError(Exception):
    """The records folder cannot be used; the message is one line saying why."""


def check_writable(records_dir: Path) -> None:
    """Raise :class:`RecordsDirError` unless a record can be written to ``records_dir`` now."""
    if records_dir.exists() and not records_dir.is_dir():
        raise RecordsDirError(f"records_dir {records_dir} is a file, not a folder")
    try:
        records_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=records_dir, prefix=".tmp-probe-")
        try:
            os.write(fd, b"{}")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(tmp)
    except OSError as exc:
        raise RecordsDirError(f"records_dir {records_dir} is not writable: {exc.strerror or exc}") from None
    free = shutil.disk_usage(records_dir).free
    if free < MIN_FREE_BYTES:
        raise RecordsDirError(f"records_dir {records_dir} has only {free / 2**20:.1f} MiB free")


def acquire(records_dir: Path, sweep_dir: Path) -> None:
    """Hold the records folder's lock for this process (no-op if it already does).

    Raises :class:`RecordsDirError` naming the holder when another process has it. Where ``flock`` is
    missing (Windows) the lock is skipped.
    """
    try:
        import fcntl
    except ImportError:
        return
    path = records_dir / LOCK_NAME
    if str(path) in _held:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        who = ", ".join(f"{k} {holder[k]}" for k in ("pid", "host", "started", "sweep_dir") if k in holder)
        raise RecordsDirError(
            f"records_dir {records_dir} is in use by another sweep ({who or 'holder unknown'}): two sweeps "
            "timing at once slow each other down; wait for it to finish or use another records_dir"
        ) from None
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sweep_dir": str(sweep_dir),
        "argv": " ".join(sys.argv),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _held[str(path)] = fd


def prepare(records_dir: Path, sweep_dir: Path) -> None:
    """Before the first job: the folder is writable and this sweep holds its lock (one-line errors)."""
    check_writable(records_dir)
    acquire(records_dir, sweep_dir)
