"""Sweeps through Hydra's launchers, isolated (the default), run from a terminal as a person would.

Each sweep runs under ``script`` (util-linux), which gives it a pseudo-terminal: the progress bar is
live there, and whatever a launcher pickles into its workers must survive that. The submitting
process shows every job's summary line, whichever process ran it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.records.records import read_records

from .helpers import sweep_overrides
from .test_runner import _tagged_pids, _wait_gone

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["seq_len=64", "heads=2", "head_dim=16", "min_run_time=0.5", "report=false"]
LAUNCHERS = {
    "basic": [],
    "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
    "submitit_local": ["hydra/launcher=submitit_local"],
}
PLUGIN = {
    "joblib": "hydra_plugins.hydra_joblib_launcher",
    "submitit_local": "hydra_plugins.hydra_submitit_launcher",
}


def run_in_terminal(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """``python run.py <args>`` under a pseudo-terminal; its output (stdout and stderr) as stdout."""
    if shutil.which("script") is None:
        pytest.skip("needs util-linux `script` to give the sweep a terminal")
    # a pseudo-terminal starts 0 columns wide (no one sized it): give it a real width for the bar
    cmd = "stty cols 120 rows 40; " + shlex.join([sys.executable, "run.py", *sweep_overrides(*args)])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    script = ["script", "-qec", cmd, "/dev/null"]
    p = subprocess.run(
        script, cwd=ROOT, env=env, capture_output=True, stdin=subprocess.DEVNULL, timeout=timeout
    )
    # bytes, then decoded: universal newlines would turn the bar's carriage returns into lines
    return subprocess.CompletedProcess(p.args, p.returncode, p.stdout.decode(errors="replace"), "")


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_every_launcher_runs_isolated_jobs_from_a_terminal(tmp_path, launcher):
    if launcher in PLUGIN:
        pytest.importorskip(PLUGIN[launcher])
    args = ["-m", *LAUNCHERS[launcher], "variant=naive,sdpa", *SMALL]
    args += [f"records_dir={tmp_path / 'records'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    p = run_in_terminal(args)
    out = p.stdout
    assert p.returncode == 0, out[-3000:]
    recs = read_records(tmp_path / "records")
    assert sorted(r["variant_name"] for r in recs) == ["naive", "sdpa"]
    assert all(r["status"] == "ok" for r in recs), [r["reason"] for r in recs]
    # each job's line reaches the terminal of the submitting process once, and the bar counted both
    assert out.count("[naive N=64 fwd float32 cpu] ok") == 1, out[-3000:]
    assert out.count("[sdpa(backend=auto) N=64 fwd float32 cpu] ok") == 1, out[-3000:]
    assert "2/2" in out
    assert "sweep finished: 2 job(s)" in out
    assert {r["env"]["launcher"] for r in recs} == {
        {"basic": "BasicLauncher", "joblib": "JoblibLauncher", "submitit_local": "LocalLauncher"}[launcher]
    }
    # the thread count is the job's own choice, not a launcher worker's limit
    assert {r["figures"]["threads"] for r in recs} == {len(os.sched_getaffinity(0))}
    if launcher == "basic":  # one job at a time (and no other sweep shares the tests' marker folder)
        assert all(r["figures"]["concurrent_jobs"] == 0 for r in recs)
    else:  # parallel: the sweep warns. Whether its two jobs overlapped depends on how fast the
        # machine started the workers: tests/test_concurrency.py shows that overlapping jobs count each other
        assert "warning:" in out and "slow each other down" in out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupting_a_submitit_sweep_stops_every_job_and_reports_what_finished(tmp_path, sig):
    pytest.importorskip(PLUGIN["submitit_local"])
    tag = f"{os.getpid()}-launch-{sig.name}"
    cmd = [
        sys.executable,
        "run.py",
        "-m",
        "hydra/launcher=submitit_local",
        "variant=naive",
        "variant._target_=variants.naive.NaiveAttention,tests.faulty.HangingAttention",
        "seq_len=64",
        "heads=2",
        "head_dim=16",
        "min_run_time=0.05",
        f"records_dir={tmp_path / 'records'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    cmd = sweep_overrides(*cmd)
    env = dict(os.environ, PYTHONPATH=str(ROOT), ATTNBENCH_TEST_TAG=tag)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.time() + 180
        while not read_records(tmp_path / "records") and time.time() < deadline:  # naive is done
            time.sleep(0.5)
        assert read_records(tmp_path / "records"), "the quick job never finished"
        time.sleep(1)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 128 + sig, out[-2000:]
        assert f"interrupted by {sig.name}" in out
        assert _wait_gone(tag, 15) == [], "job processes outlived the interrupted sweep"
        # what finished is kept and reported
        (rec,) = read_records(tmp_path / "records")
        assert rec["status"] == "ok"
        assert (tmp_path / "sweep" / "report" / "tables.md").exists()
    finally:
        for pid in _tagged_pids(tag):
            os.kill(pid, signal.SIGKILL)
        proc.kill()


def _slurm_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return p.returncode == 0 and any(s in p.stdout for s in ("idle", "mixed", "allocated"))


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real single-node Slurm with accounting, started by the project's own script if needed."""
    if _slurm_up():
        yield
        return
    if os.geteuid() != 0:
        pytest.skip("starting a Slurm cluster needs root (scripts/slurm_cluster.sh start)")
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), "start"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if p.returncode in (2, 3):
        pytest.skip(f"Slurm could not be installed here: {p.stdout.strip().splitlines()[-1:]}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    yield
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), "stop"], capture_output=True, timeout=120
    )


@pytest.mark.slow
def test_a_sweep_through_a_real_slurm_cluster(tmp_path, slurm_cluster):
    pytest.importorskip(PLUGIN["submitit_local"])
    targets = "variants.naive.NaiveAttention,tests.faulty.CrashingAttention,tests.faulty.SelfKillingAttention"
    args = ["-m", "hydra/launcher=slurm", "variant=naive", f"variant._target_={targets}", *SMALL]
    args += [
        "min_run_time=0.05",
        f"records_dir={tmp_path / 'records'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "hydra.launcher.timeout_min=10",  # a job left behind by a killed test frees the node soon
    ]
    args[args.index("report=false")] = "report=true"
    try:
        p = subprocess.run(
            [sys.executable, "run.py", *sweep_overrides(*args)],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        queue = subprocess.run(["squeue", "-o", "%i %j %T %R %M"], capture_output=True, text=True).stdout
        pytest.fail(f"the sweep did not end in 600 s; the cluster's queue:\n{queue}")
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]  # the crashing job is an error
    statuses = {
        r["config"]["variant"]["_target_"].rsplit(".", 1)[-1]: r for r in read_records(tmp_path / "records")
    }
    assert {k: r["status"] for k, r in statuses.items()} == {
        "NaiveAttention": "ok",
        "CrashingAttention": "error",
        "SelfKillingAttention": "killed",
    }
    assert all(r["env"]["launcher"] == "SlurmLauncher" for r in statuses.values())
    # every job's line reached the submitting process; the report of the whole sweep was written
    assert "[naive N=64 fwd float32 cpu] ok" in p.stdout
    assert (tmp_path / "sweep" / "report" / "tables.md").exists()
    assert list((tmp_path / "sweep" / ".submitit").glob("*/*_log.out")), "submitit keeps each job's log"


def test_slurm_without_a_controller_is_one_line_before_launch():
    # stand-ins for `scontrol ping`: the answers of a cluster that is up, down, absent, or failing
    from experiments.sweep.preflight import slurm_problem

    assert slurm_problem(["echo", "Slurmctld(primary) at vm is UP"]) is None
    assert "(Slurmctld(primary) at vm is DOWN)" in slurm_problem(["echo", "Slurmctld(primary) at vm is DOWN"])
    assert slurm_problem(["no-such-scontrol-here"]) == "Slurm is not installed here (no scontrol)"
    assert slurm_problem(["false"]) == "no Slurm controller answers `scontrol ping` (exit 1)"
