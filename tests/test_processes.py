"""A kernel job measured in several processes: the record is the median process's, with the range."""

from __future__ import annotations

import subprocess
import sys

import pytest

from experiments.measure.spec import JobSpec
from experiments.records.records import config_hash
from experiments.sweep.isolation import run_isolated
from experiments.sweep.processes import median_process, run_in_processes
from tests.test_runner import ROOT, SMALL, job_cfg


def _result(fwd_bwd: float, fwd: float, wall: float = 1.0, roof: dict | None = None) -> dict:
    figures = {"fwd_median_s": fwd, "fwd_bwd_median_s": fwd_bwd, "gflops_per_s": 1 / fwd_bwd}
    return {
        "status": "ok",
        "reason": None,
        "figures": figures,
        "wall_s": wall,
        "measure_s": wall / 2,
        "roofline": roof,
    }


def test_the_median_process_is_chosen_by_the_jobs_mode_and_keeps_its_own_figures():
    roof = {"gemm_flops_per_s": 1e11}
    runs = [_result(3.0, 1.0, roof=roof), _result(1.0, 3.0), _result(2.0, 9.0)]
    failed = [{"status": "killed", "reason": "child ended by SIGKILL", "figures": {}, "wall_s": 4.0}]
    rec = median_process(runs, failed)
    f = rec["figures"]
    # fwd+bwd medians 3, 1, 2: the third process is the median one; its fwd (9) comes with it
    assert (f["fwd_bwd_median_s"], f["fwd_median_s"], f["gflops_per_s"]) == (2.0, 9.0, 0.5)
    assert (f["fwd_bwd_proc_min_s"], f["fwd_bwd_proc_max_s"]) == (1.0, 3.0)
    assert (f["fwd_proc_min_s"], f["fwd_proc_max_s"]) == (1.0, 9.0)
    assert f["processes"] == 3 and f["processes_failed"] == "killed: child ended by SIGKILL"
    assert rec["roofline"] is roof  # only the first process measures it
    assert rec["wall_s"] == 7.0 and rec["measure_s"] == 1.5


def test_an_even_count_takes_the_lower_middle():
    f = median_process([_result(4.0, 1.0), _result(1.0, 1.0), _result(3.0, 1.0), _result(2.0, 1.0)], [])[
        "figures"
    ]
    assert f["fwd_bwd_median_s"] == 2.0 and f["processes"] == 4


def test_a_job_that_fails_in_its_first_process_is_not_repeated():
    calls = []

    def one(first: bool) -> dict:
        calls.append(first)
        return {"status": "unsupported", "reason": "no", "figures": {}}

    assert run_in_processes(one, 3)["status"] == "unsupported"
    assert calls == [True]


def test_each_measurement_runs_in_its_own_process(tmp_path):
    log = tmp_path / "pids.txt"
    cfg = job_cfg(variant="naive", processes=3, **SMALL)
    cfg["variant"] = {"_target_": "tests.faulty.PidLoggingAttention", "log": str(log)}
    spec = JobSpec.from_config(cfg)
    firsts = []

    def one(first: bool) -> dict:
        firsts.append(first)
        return run_isolated(spec, timeout_s=120)

    rec = run_in_processes(one, 3)
    assert rec["status"] == "ok", rec
    assert firsts == [True, False, False]
    pids = log.read_text().split()
    assert len(pids) == 3 and len(set(pids)) == 3 and str(__import__("os").getpid()) not in pids
    f = rec["figures"]
    assert f["processes"] == 3
    assert f["fwd_proc_min_s"] <= f["fwd_median_s"] <= f["fwd_proc_max_s"]


def test_processes_enter_the_hash_only_when_not_one():
    cfg = job_cfg(variant="naive")
    without = {k: v for k, v in cfg.items() if k != "processes"}
    assert config_hash(cfg) == config_hash(without)  # records from before the knob resume
    assert config_hash({**cfg, "processes": 3}) != config_hash(cfg)


@pytest.mark.parametrize(
    "args, message",
    [
        (["processes=0"], "error: processes must be > 0, got 0"),
        (["processes=3", "isolate=false"], "error: processes > 1 needs isolate=true"),
        (["processes=3", "+task=copy"], "error: processes > 1 applies to kernel jobs"),
    ],
)
def test_bad_processes_is_one_line_before_work(tmp_path, args, message):
    p = subprocess.run(
        [sys.executable, "run.py", "variant=naive", *args, f"records_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith(message), p.stderr
    assert not list(tmp_path.glob("*.json"))
