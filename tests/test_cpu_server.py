"""Starting the CPU jobs' fork server at the top of run.py (experiments/sweep/cpu_server.py)."""

import os
import subprocess
import sys

import pytest

from experiments.sweep.cpu_server import forks_cpu_jobs_here

from .test_runner import ROOT


@pytest.mark.parametrize(
    "argv, forks",
    [
        ([], True),
        (["-m", "variant=naive,sdpa", "seq_len=256"], True),
        (["-m", "hydra/launcher=basic"], True),
        (["-m", "device=cpu,cuda"], True),  # its CPU jobs fork here
        (["--help"], False),
        (["--cfg", "job"], False),
        (["-m", "hydra/launcher=joblib"], False),  # each worker starts its own
        (["-m", "hydra/launcher=slurm"], False),
        (["isolate=false"], False),
        (["device=cuda"], False),
        (["+device=cuda:1"], False),
    ],
)
def test_the_server_starts_early_only_where_this_process_forks_cpu_jobs(argv, forks):
    assert forks_cpu_jobs_here(argv) is forks


def test_an_early_server_imports_nothing_here_and_is_the_one_jobs_fork_from(tmp_path):
    # in a fresh interpreter: the early start imports neither torch nor Hydra in the sweep's process,
    # and the job that follows forks from that server rather than from a second one
    code = """
import os
import sys
from multiprocessing import forkserver
from experiments.sweep.cpu_server import start_early
assert start_early([]) and "torch" not in sys.modules and "hydra" not in sys.modules
server = forkserver._forkserver._forkserver_pid
from experiments.sweep.isolation import run_isolated
from tests.test_runner import job_spec
res = run_isolated(job_spec("tests.faulty.WritesParentAttention", variant="naive", seq_len=8), 120)
assert res["status"] == "ok", res
parent = int(open(os.environ["ATTNBENCH_TEST_PARENT_FILE"]).read())
assert parent == server == forkserver._forkserver._forkserver_pid, (parent, server)
"""
    # set before the server starts: a job has the server's environment, not the sweep's of the moment
    env = dict(os.environ, ATTNBENCH_TEST_PARENT_FILE=str(tmp_path / "parent"))
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]


def test_stop_early_kills_the_server_it_started():
    code = """
import os
from multiprocessing import forkserver
from experiments.sweep.cpu_server import start_early, stop_early
assert start_early([])
pid = forkserver._forkserver._forkserver_pid
assert stop_early() and not stop_early()  # killed and reaped; nothing left to kill
try:
    os.kill(pid, 0)
except ProcessLookupError:
    print("gone")
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "gone", p.stderr[-2000:]
