"""Where a sweep stands, shown by the process that submitted it, whatever runs its jobs.

Hydra calls ``on_job_end`` inside the launcher's workers (joblib, submitit, Ray), so a progress bar
driven by it never moves, and the workers' summary lines go to their own logs. Every job appends one
line to the sweep's manifest (``manifest.jsonl``) as its record lands; :class:`ManifestFollower`
reads that file from the submitting process, advances the bar and prints every job's summary line
above it (a job run in this process leaves its line to the follower: see :func:`following`).

Interrupting the submitting process (Ctrl-C, SIGTERM) stops the sweep's jobs: :func:`stop_jobs` kills
every process this one started (each job's isolated child dies with its parent) and cancels the
sweep's Slurm jobs by name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from ..records.records import MANIFEST

_active = threading.Event()  # set while a follower runs in this process
#: set by the submitting process while its follower runs: the device and inode of its standard output.
#: A launcher worker (joblib) that writes to the same terminal or file leaves its job lines to the
#: follower, which shows them once; one writing elsewhere (a Slurm job's log) prints them there.
FOLLOWER_STDOUT_ENV = "ATTNBENCH_FOLLOWER_STDOUT"


def _stdout_id() -> str | None:
    """``device:inode`` of this process's standard output (None when it has no file)."""
    try:
        st = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return None
    return f"{st.st_dev}:{st.st_ino}"


def following() -> bool:
    """True when a follower shows the sweep's job lines where this process would print them: this
    process's own, or the submitting process's when this one (a launcher worker) writes to the same
    output. A job should not print its own line then."""
    if _active.is_set():
        return True
    mine = _stdout_id()
    return mine is not None and os.environ.get(FOLLOWER_STDOUT_ENV) == mine


def say(line: str) -> None:
    """Print a line for the person watching: above the progress bar when this process draws one."""
    if following():
        from tqdm import tqdm

        tqdm.write(line)
    else:
        print(line, flush=True)


class ManifestFollower:
    """Polls ``<sweep_dir>/manifest.jsonl`` in a thread; ``bar`` (tqdm or None) counts the jobs."""

    def __init__(self, sweep_dir: Path, bar: Any = None, poll_s: float = 0.5) -> None:
        self.path = sweep_dir / MANIFEST
        self.bar = bar
        self.poll_s = poll_s
        self._offset = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="attnbench-progress", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> ManifestFollower:
        _active.set()
        if (mine := _stdout_id()) is not None:  # launcher workers started from now on inherit it
            os.environ[FOLLOWER_STDOUT_ENV] = mine
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following, after reading what the manifest holds now."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.poll()
        _active.clear()
        os.environ.pop(FOLLOWER_STDOUT_ENV, None)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Read the manifest's complete new lines: advance the bar, print each job's summary line."""
        with self._lock:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    chunk = f.read()
            except OSError:
                return
            end = chunk.rfind(b"\n") + 1  # a line still being appended waits for the next poll
            self._offset += end
            for raw in chunk[:end].splitlines():
                try:
                    entry = json.loads(raw)
                except ValueError:
                    continue
                if self.bar is not None:
                    self.bar.update(1)
                if entry.get("line"):
                    say(entry["line"])


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, their children, ...), from ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def stop_jobs(slurm_job_name: str | None = None) -> int:
    """Kill every process this one started and, given a Slurm job name, ``scancel`` those jobs.

    Returns the number of local processes killed.
    """
    pids = descendants(os.getpid())
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if slurm_job_name and shutil.which("scancel"):
        subprocess.run(["scancel", f"--name={slurm_job_name}"], capture_output=True, timeout=30, check=False)
    return len(pids)
