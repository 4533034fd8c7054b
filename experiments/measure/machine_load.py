"""How busy the rest of the machine was while a job measured: CPU time used by other processes.

A timing taken while another sweep, a build or a browser ran on the same cores is slower for reasons
that have nothing to do with the variant. Linux counts every core's busy time (``/proc/stat``) and
this process's own and its descendants' (``/proc/<pid>/stat``: a compile's worker processes are the
job's work); the difference over the job's wall time is the number of cores the rest of the machine
kept busy. Elsewhere the figures are None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: above this many cores' worth of other processes' work (``others_cpu_cores``) a job's times are
#: flagged as measured beside other work, and :func:`settle` waits for less
LOADED_CORES = 0.5


@dataclass
class Snapshot:
    wall: float
    busy: int | None  # jiffies every core spent busy (not idle or waiting for I/O), machine-wide
    own: int | None  # jiffies this process (all its threads) and its descendants spent on a core


def _cpu_fields() -> list[int] | None:
    """The machine-wide ``cpu`` line of ``/proc/stat`` in jiffies: user nice system idle iowait irq
    softirq steal ... (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def _machine_busy() -> int | None:
    fields = _cpu_fields()
    if fields is None:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal: guests are in user


def _stat(pid: str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, ppid, ...), None when it is
    gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name may hold spaces: fields are counted after its closing parenthesis
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _own() -> int | None:
    """Jiffies this process and its descendants spent on a core: each live one's own time and that of
    the children it reaped (utime stime cutime cstime), so each process's time counts once. Why the
    descendants: torch.compile's worker processes compile beside a job (flex recompiles per cache
    length while its decoding step is timed), and as "other processes" they marked that job's time
    as measured beside other work, though the work is the variant's own. O(processes on the machine)."""
    me = str(os.getpid())
    parents: dict[str, list[str]] = {}
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if pid.isdigit() and pid != me and (fields := _stat(pid)) is not None:
            parents.setdefault(fields[1], []).append(pid)
    total, todo = 0, [me]
    while todo:
        pid = todo.pop()
        fields = _stat(pid)
        if fields is None:
            if pid == me:
                return None
            continue  # ended between the two reads: its time is in its parent's once reaped
        try:
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
        except ValueError:
            return None
        todo += parents.get(pid, [])
    return total


def snapshot() -> Snapshot:
    return Snapshot(time.perf_counter(), _machine_busy(), _own())


def others_cores(start: Snapshot, end: Snapshot) -> float | None:
    """Average number of cores other processes kept busy between two snapshots (None off Linux)."""
    if None in (start.busy, start.own, end.busy, end.own) or end.wall <= start.wall:
        return None
    others = (end.busy - start.busy) - (end.own - start.own)  # type: ignore[operator]
    return max(0.0, others / _HZ / (end.wall - start.wall))


def steal_ticks() -> tuple[int, int] | None:
    """``(stolen, all)`` jiffies of every core since boot: the time the hypervisor ran something else
    on this virtual machine's cores, and all time (None off Linux or without a steal count)."""
    fields = _cpu_fields()
    if fields is None or len(fields) < 8:
        return None
    return fields[7], sum(fields[:8])


def steal_fraction(start: tuple[int, int] | None, end: tuple[int, int] | None) -> float | None:
    """The fraction of the machine's CPU time stolen by its hypervisor between two :func:`steal_ticks`
    (None where either is None or no tick passed)."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def reclaim_scans() -> int | None:
    """Pages the kernel has scanned to reclaim memory since boot (``pgscan_*`` in ``/proc/vmstat``),
    or None where there is no such count."""
    try:
        with open("/proc/vmstat") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith("pgscan_"))
    except (OSError, ValueError, IndexError):
        return None


def others_over(window_s: float) -> float | None:
    """Cores other processes kept busy, on average, over the next ``window_s`` seconds (sleeps that
    long; None off Linux)."""
    start = snapshot()
    time.sleep(window_s)
    return others_cores(start, snapshot())


def settle(
    max_wait_s: float,
    others_limit: float = LOADED_CORES,
    window_s: float = 0.25,
    scans: Callable[[], int | None] = reclaim_scans,
    side_by_side: Callable[[], bool] = lambda: False,
    others: Callable[[float], float | None] = others_over,
) -> tuple[float, str | None]:
    """Wait until the machine is quiet: over one ``window_s``, other processes kept at most
    ``others_limit`` cores busy and the kernel scanned no page for reclaim. Gives up after
    ``max_wait_s``. Returns the seconds waited and, if it gave up, what was still busy (None when
    quiet). Off Linux it returns at once, and so it does as soon as ``side_by_side()`` says other jobs
    of the suite are measuring: a parallel launcher runs jobs together on purpose (their records
    count them, ``concurrent_jobs``), and waiting for them would only serialise the sweep.

    The machine is read through ``others`` (:func:`others_over`: cores busy over a window) and
    ``scans`` (:func:`reclaim_scans`), so a test can hand it any machine state.

    Why: after a job that ran the machine out of memory (naive at N=16384), the kernel's reclaim ran on
    into the next jobs, whose threads then had 1.32-1.82 of their 2 cores (sdpa fwd+bwd at N=1024:
    IQR 28% of the median). A job should start on a machine that is not still cleaning up.
    """
    t0 = time.perf_counter()
    if max_wait_s <= 0 or _machine_busy() is None:
        return 0.0, None
    while not side_by_side():
        scanned0 = scans()
        busy_cores, scanned = others(window_s), scans()
        busy = []
        if busy_cores is not None and busy_cores > others_limit:
            busy.append(f"{busy_cores:.1f} other cores busy")
        if scanned0 is not None and scanned is not None and scanned > scanned0:
            busy.append(f"memory reclaim ({scanned - scanned0} pages scanned in {window_s:g} s)")
        waited = time.perf_counter() - t0
        if not busy:
            return waited, None
        if waited + window_s > max_wait_s:
            return waited, ", ".join(busy)
    return time.perf_counter() - t0, None
