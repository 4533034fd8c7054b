"""How a sweep ends: its exit code and last line for refused, wrong or unmeasured jobs, objectives for
optimising sweepers, other launchers, and what it keeps when its folders fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from experiments.records.records import read_records

from .helpers import sweep_overrides
from .test_runner import ROOT, SMALL, run_sweep


def test_a_job_refused_inside_a_sweep_says_so_once_and_leaves_no_empty_folder(tmp_path):
    # glob(...) is expanded by Hydra, so this job is checked in the job, not before launch
    p = run_sweep(tmp_path, "variant=glob(local*)", "variant.window=-5")
    assert p.returncode == 1
    error = "error: window must be >= 0 (a radius in tokens), got -5"
    assert (p.stdout + p.stderr).count(error) == 1, p.stdout + p.stderr
    assert "nothing measured, sweep folder removed" in p.stdout and not (tmp_path / "sweep").exists()
    # a sweep folder the user named, with a file of their own in it, stays
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    p = run_sweep(tmp_path, "variant=glob(local*)", "variant.window=-5", sweep="mine")
    assert p.returncode == 1 and (tmp_path / "mine" / "notes.txt").exists()


def test_a_wrong_result_fails_the_sweep_whether_measured_or_reused(tmp_path):
    args = [
        "variant=naive",
        "variant._target_=tests.faulty.WrongAttention",
        *[f"{k}={v}" for k, v in SMALL.items()],
    ]
    p = run_sweep(tmp_path, *args)
    assert p.returncode == 1, p.stderr[-2000:]
    (rec,) = read_records(tmp_path / "records")
    assert rec["status"] == "ok" and rec["figures"]["valid"] is False  # recorded, as data, and then failed
    wrong = (
        "1 job(s) computed a wrong result: INVALID, their output failed the check against the float64 oracle"
    )
    assert p.stderr.strip().splitlines()[-1] == f"{wrong}: exit code 1"
    assert "sweep finished: 1 job(s): 1 measured;" in p.stdout
    # the same sweep again reuses the record (resume) and still fails, saying what it reused
    p = run_sweep(tmp_path, *args, sweep="again")
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == f"{wrong}: exit code 1"
    assert "sweep finished: 1 job(s): 0 measured, 1 reused from earlier records in records_dir" in p.stdout
    assert "resume=false measures them again" in p.stdout


def test_a_run_that_measured_nothing_exits_1(tmp_path):
    """Every job unsupported (retention is causal only): the records are kept as data, but neither the
    sweep nor a single run passes, and a sweep that reuses those records fails the same way."""
    args = ["variant=retention", *[f"{k}={v}" for k, v in SMALL.items()]]
    p = run_sweep(tmp_path, *args)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "sweep finished: 1 job(s): 0 measured, 1 unsupported (see the status table)" in p.stdout
    last = "no job measured anything (1 unsupported; the status table says why): exit code 1"
    assert p.stderr.strip().splitlines()[-1] == last
    assert [r["status"] for r in read_records(tmp_path / "records")] == ["unsupported"]
    p = run_sweep(tmp_path, *args, sweep="again")  # reused, and still nothing measured
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == last
    single = [sys.executable, "run.py", *sweep_overrides(*args), f"records_dir={tmp_path / 'single'}"]
    single.append(f"hydra.run.dir={tmp_path / 'run'}")
    p = subprocess.run(single, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stderr[-2000:]
    assert (
        p.stderr.strip().splitlines()[-1]
        == "the job ended 'unsupported', so it measured nothing: exit code 1"
    )
    assert [r["status"] for r in read_records(tmp_path / "single")] == ["unsupported"]


def test_joblib_launcher_runs_a_sweep(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    p = run_sweep(
        tmp_path,
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "variant=naive,chunked",
        *[f"{k}={v}" for k, v in SMALL.items()],  # isolated (the default): children of loky workers
    )
    assert p.returncode == 0, p.stderr[-2000:]
    recs = read_records(tmp_path / "records")
    assert sorted(r["variant_name"] for r in recs) == ["chunked", "naive"]
    assert all(r["status"] == "ok" for r in recs)


def test_a_sweep_whose_objective_no_record_has_fails(tmp_path):
    """A misspelt objective made every trial of an optimising sweep NaN, and the sweep passed."""
    from experiments.sweep.callbacks import objective_missing

    rec = tmp_path / "r.json"
    rec.write_text(json.dumps({"status": "ok", "figures": {"fwd_median_s": 0.1, "peak_mib": 3.0}}))
    ok = [{"status": "ok", "record": str(rec)}]
    assert objective_missing(ok, None) == [] and objective_missing(ok, "peak_mib") == []
    assert objective_missing(ok, "fwd_medain_s") == [
        "objective=fwd_medain_s is a figure of none of the 1 measured record(s), so every job returned "
        "NaN; did you mean fwd_median_s?"
    ]
    reused = [{"status": "skipped", "reused": "ok", "record": str(rec)}]
    assert objective_missing(reused, "nope")[0].endswith("their figures: fwd_median_s, peak_mib")
    # nothing measured: nothing to tell a misspelling by (failures() says the sweep measured nothing)
    assert objective_missing([{"status": "unsupported", "record": str(rec)}], "nope") == []


def test_a_single_run_with_a_misspelt_objective_fails_in_one_line(tmp_path):
    """A single run has no optimiser to hand a NaN to: a misspelt objective is exit 1, one line."""
    small = [f"{k}={v}" for k, v in SMALL.items()]
    cmd = [sys.executable, "run.py", "variant=naive", *sweep_overrides(*small), "objective=fwd_medain_s",
           f"records_dir={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == (
        "error: objective=fwd_medain_s is not a figure of this record; did you mean fwd_median_s?"
    )
    assert len(list(tmp_path.glob("*.json"))) == 1  # the measurement itself is kept


def test_a_job_returns_its_objective_figure():
    from experiments.sweep.runner import objective

    rec = {"status": "ok", "config": {"mode": "fwd_bwd"}, "figures": {"fwd_bwd_median_s": 0.5, "peak_mib": 3}}
    assert objective(rec) == 0.5 and objective(rec, "peak_mib") == 3.0
    task = {**rec, "kind": "task", "figures": {"test_accuracy": 0.9, "fwd_median_s": 1}}
    assert objective(task) == 0.9  # a task's default figure, by its stored kind
    older = {**task, "kind": None, "config": {"mode": "fwd", "task": {"name": "copy"}}}
    assert objective(older) == 0.9  # a record written before kinds were stored
    nan = [objective(None), objective({**rec, "status": "oom"}), objective(rec, "no_such_figure")]
    nan.append(objective({**rec, "figures": {**rec["figures"], "valid": False}}))  # a wrong result
    assert all(v != v for v in nan)


def test_optunas_sweeper_searches_a_knob_for_the_fastest_job(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    p = run_sweep(
        tmp_path,
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.direction=minimize",
        "variant=local_window",
        "variant.window=range(2,32)",
        "resume=false",  # two trials may draw the same window: each is measured, none reused
        *[f"{k}={v}" for k, v in SMALL.items()],
    )
    assert p.returncode == 0, p.stderr[-3000:]
    recs = read_records(tmp_path / "records")
    assert len(recs) == 2 and all(r["status"] == "ok" for r in recs)
    best = min(recs, key=lambda r: r["figures"]["fwd_median_s"])
    # the sweeper's best trial is the record with the smallest forward time, and it says so
    assert f"Best value: {best['figures']['fwd_median_s']}" in p.stdout + p.stderr
    assert f"'++variant.window': {best['config']['variant']['window']}" in p.stdout + p.stderr


def test_the_end_of_a_sweep_names_unreadable_files_in_its_records_folder(tmp_path):
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "cut.json").write_text('{"status": "ok", "fig')  # a record cut short
    p = run_sweep(tmp_path, "variant=naive", *[f"{k}={v}" for k, v in SMALL.items()])
    assert p.returncode == 0, p.stderr[-2000:]
    cut = tmp_path / "records" / "cut.json"
    assert f"warning: records_dir holds 1 unreadable file(s), left out of every report: {cut}" in p.stderr


def test_a_sweep_interrupted_before_any_job_finished_is_not_called_empty(tmp_path, capsys):

    from experiments.sweep.callbacks import SweepCallback

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("{}")
    config = OmegaConf.create(
        {
            "records_dir": str(tmp_path / "records"),
            "report": True,
            "hydra": {"sweep": {"dir": str(sweep)}, "overrides": {"task": ["variant=glob(*)"]}},
        }
    )
    SweepCallback()._finish(config, interrupted=True)  # no SystemExit: the signal sets the status
    out = capsys.readouterr()
    assert "matched nothing" not in out.err and "sweep interrupted: 0 job(s)" in out.out
    assert not sweep.exists()  # nothing measured: no empty folder left
    sweep.mkdir()
    with pytest.raises(SystemExit):  # the same state at the end of a sweep that ran: it matched nothing
        SweepCallback()._finish(config)
    assert "the sweep launched no job: 'variant=glob(*)' matched nothing" in capsys.readouterr().err


#: run.py with every write of a diagnostic file in the sweep folder (``argv[1]``) failing as on a full
#: disk; the records folder and the manifest (appended, not written whole) are left working
_FULL_SWEEP_FOLDER = """
import errno, runpy, sys
from pathlib import Path
import experiments.records.records as records
import experiments.sweep.retry as retry
import experiments.sweep.runner as runner
sweep, real = Path(sys.argv[1]), records.write_json_atomic
def full(final, obj):
    if Path(final).parent == sweep:
        raise OSError(errno.ENOSPC, "No space left on device", str(final))
    return real(final, obj)
retry.write_json_atomic = runner.write_json_atomic = full
sys.argv = ["run.py", *sys.argv[2:]]
runpy.run_path("run.py", run_name="__main__")
"""


def test_a_sweep_folder_that_cannot_be_written_loses_no_measured_record(tmp_path):
    """The canary and GEMM-ceiling files are written into the sweep folder after the job measured and
    before its record: a failure there (a full disk) once raised out of the job and lost the result."""
    sweep, records = tmp_path / "sweep", tmp_path / "records"
    small = [f"{k}={v}" for k, v in SMALL.items()]
    args = ["-m", "variant=naive", *small, "threads=1", "roofline=true", "settle_s=0", "retry_unstable=0"]
    args += [f"records_dir={records}", f"hydra.sweep.dir={sweep}", "report=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", _FULL_SWEEP_FOLDER, str(sweep), *args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    (rec,) = read_records(records)
    assert rec["status"] == "ok" and rec["figures"]["fwd_median_s"] > 0
    # the job's own ceiling is kept in its record, though no file could hold it for the sweep
    assert rec["roofline"]["gemm_flops_per_s"] > 0
    assert rec["figures"]["canary_ratio"] == 1.0  # compared with itself: no earlier canary survived
    out = p.stdout + p.stderr
    assert "warning: could not write the canary file" in out and "No space left on device" in out
    assert "warning: could not write the GEMM ceiling file in the sweep folder" in out
    assert "Traceback" not in out and not list(sweep.glob("*.json"))
