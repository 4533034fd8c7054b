"""Job processes keep the memory torch frees (experiments/sweep/allocator.py): a large buffer
allocated again and again page-faults once, not on every call. The oracle is the kernel's own count
of minor page faults (``ru_minflt``); a process started without the settings is the control that
shows the check can fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from experiments.sweep.allocator import KEEP_FREED, settings
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
    conn.send((faults_per_call(), {k: os.environ.get(k) for k in KEEP_FREED}))
    conn.close()


def test_a_cpu_job_process_reuses_freed_memory():
    ctx = context_for("cpu")  # the sweep's own way of starting a CPU job
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_in_child, args=(send,))
    proc.start()
    faults, env = recv.recv()
    proc.join(30)
    assert env == KEEP_FREED or all(v is not None for v in env.values())  # a user's own values stay
    # fresh pages fault every page of both buffers on every call (16386 measured); a kept heap faults
    # none on most runs, and up to ~2700 per call on some (seen under load), never near a buffer's worth
    assert faults < FRESH / 2, faults


def test_without_the_settings_every_call_faults_fresh_pages():
    env = {k: v for k, v in os.environ.items() if k not in KEEP_FREED}
    code = "from tests.test_allocator import faults_per_call; print(faults_per_call())"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert float(p.stdout) > FRESH  # glibc's default: mmap and munmap per buffer, every call


def test_settings_name_what_an_inline_job_started_with():
    # this test process was not started with the settings unless the user exported them
    started = {k: v for k, v in settings(isolated=False).items()}
    assert set(started) == set(KEEP_FREED)
    assert all(v is None or v.isdigit() for v in started.values())
