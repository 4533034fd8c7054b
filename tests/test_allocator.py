"""Job processes keep the memory torch frees (experiments/sweep/allocator.py): a large buffer
allocated again and again page-faults once, not on every call. The oracle is the kernel's own count
of minor page faults (``ru_minflt``); a process started without the settings is the control that
shows the check can fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.sweep.allocator import JOB_ALLOCATOR_ENV, settings
from experiments.sweep.isolation import context_for

ROOT = Path(__file__).resolve().parents[1]
FRESH = 8 * 1024 * 1024 * 4 // 4096  # pages of one (B=1, H=8, 1024, 1024) fp32 score matrix: 8192


def faults_per_call(calls: int = 6) -> float:
    """Minor page faults per call of naive attention at B=1, H=8, N=1024, D=64 (two 32 MiB score
    buffers a call), after two warm-up calls."""
    import resource

    import torch

    import variants

    q = torch.randn(1, 8, 1024, 64)
    attn = variants.build("naive")
    attn(q, q, q)
    attn(q, q, q)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        attn(q, q, q)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / calls


def _in_child(conn) -> None:
    conn.send((faults_per_call(), {k: os.environ.get(k) for k in JOB_ALLOCATOR_ENV}))
    conn.close()


def test_a_cpu_job_process_reuses_freed_memory():
    ctx = context_for("cpu")  # the sweep's own way of starting a CPU job
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_in_child, args=(send,))
    proc.start()
    faults, env = recv.recv()
    proc.join(30)
    assert env == JOB_ALLOCATOR_ENV or all(v is not None for v in env.values())  # a user's own values stay
    # fresh pages fault every page of both buffers on every call (16386 measured); a kept heap faults
    # none on most runs, and up to ~2700 per call on some (seen under load), never near a buffer's worth
    assert faults < FRESH / 2, faults


def test_without_the_settings_every_call_faults_fresh_pages():
    env = {k: v for k, v in os.environ.items() if k not in JOB_ALLOCATOR_ENV}
    code = "from tests.test_allocator import faults_per_call; print(faults_per_call())"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert float(p.stdout) > FRESH  # glibc's default: mmap and munmap per buffer, every call


def test_settings_name_what_an_inline_job_started_with():
    # this test process was not started with the settings unless the user exported them
    started = {k: v for k, v in settings(isolated=False).items()}
    assert set(started) == set(JOB_ALLOCATOR_ENV)
    assert all(v is None or v.isdigit() for v in started.values())


def _thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (the bracketed word), or None where there is none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def faults_to_fill(mib: int = 64) -> int:
    """Minor page faults of allocating and writing one ``mib`` MiB torch buffer."""
    import resource

    import torch

    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(mib * 2**20, dtype=torch.uint8).fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def _fill_in_child(conn) -> None:
    conn.send(faults_to_fill())
    conn.close()


def test_a_cpu_job_process_places_large_buffers_in_huge_pages():
    if _thp_mode() not in ("madvise", "always"):
        pytest.skip(f"the kernel has no transparent huge pages to give (mode {_thp_mode()})")
    ctx = context_for("cpu")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_fill_in_child, args=(send,))
    proc.start()
    faults = recv.recv()
    proc.join(30)
    # 64 MiB is 16384 pages of 4 KiB but 32 of 2 MiB; a few more for torch's own bookkeeping
    assert faults < 16384 // 8, faults


def test_without_the_switch_a_large_buffer_faults_small_pages():
    if _thp_mode() != "madvise":  # under 'always' every process gets huge pages, switch or not
        pytest.skip(f"the control needs THP mode 'madvise' (mode {_thp_mode()})")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    code = "from tests.test_allocator import faults_to_fill; print(faults_to_fill())"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert int(p.stdout) >= 16384  # one fault per 4 KiB page
