"""How the C allocator of a job's process treats the memory torch frees: kept for reuse, in huge pages.

glibc's malloc serves a request above its mmap threshold (128 KiB, raised dynamically up to 32 MiB)
with a fresh ``mmap`` and returns it with ``munmap`` when torch frees it, so every call that
allocates a large buffer touches fresh, zeroed pages again: tens of thousands of page faults per
call. On this project's 2-core VM that was a large part of the time of the allocating variants and
most of the noise between repetitions (naive fwd at B=1, H=8, N=1024, D=64, 2 threads: 16386 faults
on every call and 36-47 ms with an IQR up to 18% of the median; with the heap kept, no faults from
the second call on and 22.4 ms, IQR 2-5%; naive at N=4096 722 -> 377 ms, sparse 71-77 -> 51-53 ms).
A long-running process with a caching allocator (jemalloc, tcmalloc, which PyTorch's CPU tuning
guide recommends) pays those faults once, not per call: that is the cost the suite reports.

Buffers of 2 MiB and more are also placed in transparent huge pages (torch's
``THP_MEM_ALLOC_ENABLE=1``: 2 MiB alignment and ``madvise(MADV_HUGEPAGE)``, where the kernel's THP
mode is ``madvise`` or ``always``). A kept heap still faulted now and then: after calls with no
fault at all, glibc placed a 512 MiB buffer at a fresh end of the heap (naive at N=4096, H=8, one
thread: 131072 or 262144 faults in 4 of 32 forward-and-backward calls of two processes, each
0.9-3.4 s slower than the steady 2.0 s). In huge pages the heap stopped growing after two calls (no
fault in the 28 calls after them in two processes), and a fault is one per 2 MiB.

The settings (glibc's documented tunables and torch's switch) go into the environment of every job
process the sweep starts, CPU fork server and spawned CUDA jobs alike; each must be in place when
the process starts, so a job run inline (``isolate=false``) keeps what the sweep's own process started with.
A value the user set is kept (``MALLOC_MMAP_THRESHOLD_=131072 python run.py ...`` measures with
glibc's default threshold again, though fixed rather than dynamic).
Other C libraries ignore the malloc ones. Records say what the job had (``env.malloc``).
"""

from __future__ import annotations

import os
import sys

#: buffers below 1 GiB come from the heap, whose top is never given back (below 1 TiB); larger ones are
#: still mapped per call and returned when freed: kept, they fragment the heap (naive fwd+bwd at
#: N=8192, 2 GiB score buffers, held 20 GB resident for a 6.2 GB peak, against 6.5 GB with this limit)
JOB_ALLOCATOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(2**30),
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
    "THP_MEM_ALLOC_ENABLE": "1",
}


def set_job_allocator_env() -> None:
    """Put :data:`JOB_ALLOCATOR_ENV` into ``os.environ`` (for processes started from now on) where
    the user has not set those variables."""
    for key, value in JOB_ALLOCATOR_ENV.items():
        os.environ.setdefault(key, value)


def settings(isolated: bool) -> dict[str, str | None]:
    """The allocator variables a job has: what its child is started with (``isolated``), else what this
    process itself was started with (Linux: ``/proc/self/environ``; elsewhere the current
    environment), None where unset (glibc's defaults)."""
    env: dict[str, str] = dict(os.environ)
    if not isolated and sys.platform.startswith("linux"):
        try:
            raw = open("/proc/self/environ", "rb").read().split(b"\0")
            env = dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)
        except OSError:
            pass
    return {key: env.get(key) for key in JOB_ALLOCATOR_ENV}
