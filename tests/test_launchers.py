"""Sweeps through Hydra's launchers, isolated (the default), run from a terminal as a person would.

Each sweep runs under ``script`` (util-linux), which gives it a pseudo-terminal: the progress bar is
live there, and whatever a launcher pickles into its workers must survive that. The submitting
process shows every job's summary line, whichever process ran it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.records import read_records

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
    cmd = "stty cols 120 rows 40; " + shlex.join([sys.executable, "run.py", *args])
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
    # each job's line reaches the terminal of the submitting process, and the bar counted both
    assert "[naive N=64 fwd float32 cpu] ok" in out and "[sdpa(backend=auto) N=64 fwd float32 cpu] ok" in out
    assert "2/2" in out
    assert "sweep finished: 2 job(s)" in out
    assert {r["env"]["launcher"] for r in recs} == {
        {"basic": "BasicLauncher", "joblib": "JoblibLauncher", "submitit_local": "LocalLauncher"}[launcher]
    }
    # the thread count is the job's own choice, not a launcher worker's limit
    assert {r["figures"]["threads"] for r in recs} == {len(os.sched_getaffinity(0))}
    if launcher == "basic":
        assert all(r["figures"]["concurrent_jobs"] == 0 for r in recs)
    else:  # parallel: the sweep warns, and the records say the jobs measured side by side
        assert "warning:" in out and "slow each other down" in out
        assert max(r["figures"]["concurrent_jobs"] for r in recs) >= 1
