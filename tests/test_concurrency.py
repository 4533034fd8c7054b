"""The markers of measuring jobs: who counts as measuring beside a job, in a folder the test owns."""

from __future__ import annotations

import os
import subprocess
import sys

from experiments.sweep.concurrency import RUNNING_DIR_ENV, measuring, others_measuring, running_dir


def test_the_marker_folder_is_the_environments_when_set(tmp_path, monkeypatch):
    monkeypatch.setenv(RUNNING_DIR_ENV, str(tmp_path / "mine"))
    assert running_dir() == tmp_path / "mine"
    monkeypatch.delenv(RUNNING_DIR_ENV)
    assert running_dir().name.startswith("attnbench-running-")


def test_a_job_counts_other_live_measuring_processes_and_drops_dead_ones(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        (tmp_path / str(other.pid)).touch()  # another job measuring now
        (tmp_path / str(dead.pid)).touch()  # a job that died without removing its marker
        (tmp_path / "notes.txt").touch()  # not a marker
        with measuring(tmp_path) as most:
            assert (tmp_path / str(os.getpid())).exists()  # this process's own marker, not counted
            assert most() == 1
            assert not (tmp_path / str(dead.pid)).exists()  # the stale marker is cleaned up
            other.kill()
            other.wait()
            assert most() == 1  # the most seen so far: the other job overlapped this one
            assert others_measuring(tmp_path) == 0
        assert not (tmp_path / str(os.getpid())).exists()
    finally:
        other.kill()
        other.wait()


def test_two_jobs_measuring_at_once_see_each_other(tmp_path):
    code = (
        "import sys, time; from pathlib import Path; from experiments.sweep.concurrency import measuring\n"
        "with measuring(Path(sys.argv[1])) as most:\n"
        "    print('measuring', flush=True); sys.stdin.readline(); print(most(), flush=True)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "measuring"  # its marker is down before it says so
        with measuring(tmp_path) as most:
            assert most() == 1
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "1"  # and it saw this one
            assert child.wait(60) == 0
    finally:
        child.kill()
        child.wait()
    assert not list(tmp_path.glob("[0-9]*"))  # both markers are gone
