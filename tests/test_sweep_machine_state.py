"""A sweep on a busy or slow machine: what a job records of the machine around it, settling, and the
jobs measured again (unstable, slow canary, a GEMM ceiling below the job's own rate)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments.measure.kernel import measure
from experiments.measure.machine_load import settle
from experiments.records.records import read_records

from .test_runner import SMALL, job_spec, run_sweep


def spinning_stranger() -> int:
    """Start a process that keeps a core busy and is not this one's descendant (the shell that starts
    it exits), and return its pid: a job counts its own process tree as its own work, and a child of
    the measuring process would be that. The caller kills it."""
    spin = f"{shlex.quote(sys.executable)} -c 'while True: pass' >/dev/null 2>&1 & echo $!"
    return int(subprocess.run(["sh", "-c", spin], capture_output=True, text=True, check=True).stdout)


def test_jobs_record_how_busy_the_rest_of_the_machine_was():
    threads = torch.get_num_threads()  # measure() pins the job's thread count in this process
    pid = spinning_stranger()

    def burnt() -> float:  # the spinning process's CPU seconds so far, from the kernel's count
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    try:
        time.sleep(0.5)
        before, start = burnt(), time.monotonic()
        busy = measure(job_spec(variant="naive", **{**SMALL, "min_run_time": 0.5, "threads": 1}))["figures"]
        share = (burnt() - before) / (time.monotonic() - start)
    finally:
        os.kill(pid, signal.SIGKILL)
    torch.set_num_threads(threads)
    # the spinning process alone kept `share` of a core busy during the job (a core of its own on a
    # quiet machine; less where other work, another test's included, shares the cores): the job counts
    # at least most of that as other work, and never more than the machine's cores
    assert share > 0.3, share
    assert 0.7 * share < busy["others_cpu_cores"] <= os.cpu_count(), (share, busy["others_cpu_cores"])
    assert busy["load_avg_1m"] >= 0


class FakeMachine:
    """What :func:`settle` reads, scripted: cores other processes keep busy and the kernel's reclaim
    count, one value per window (the last repeats); each window sleeps ``window_s`` of real time."""

    def __init__(self, busy: list[float], scans: list[int]):
        self.busy, self.scan_counts, self.windows = busy, scans, 0

    def others(self, window_s: float) -> float:
        time.sleep(window_s)
        self.windows += 1
        return self.busy[min(self.windows - 1, len(self.busy) - 1)]

    def scans(self) -> int:  # read before and after each window: the window's count is the later one
        return self.scan_counts[min(self.windows, len(self.scan_counts) - 1)]


def test_settle_gives_up_on_a_machine_that_stays_busy_and_says_why():
    machine = FakeMachine(busy=[1.8], scans=[0])
    waited, busy = settle(0.2, others_limit=0.5, window_s=0.05, others=machine.others, scans=machine.scans)
    assert busy == "1.8 other cores busy"
    # it waited about max_wait_s: at least that less one window (however slowly its sleeps return)
    assert waited >= 0.15 and 1 <= machine.windows <= 4


def test_settle_waits_out_busy_cores_and_memory_reclaim_and_returns_once_quiet():
    # window 1: another process on a core; 2: reclaim scanned 10 pages; 3: quiet
    machine = FakeMachine(busy=[1.0, 0.1, 0.1], scans=[0, 0, 10, 10])
    waited, busy = settle(30.0, window_s=0.05, others=machine.others, scans=machine.scans)
    assert busy is None and machine.windows == 3 and waited >= 0.15
    machine = FakeMachine(busy=[0.0], scans=list(range(0, 100, 5)))
    waited, busy = settle(0.12, window_s=0.05, others=machine.others, scans=machine.scans)
    assert busy is not None and busy.startswith("memory reclaim (5 pages scanned"), busy
    assert settle(0, others=machine.others)[0] == 0.0  # settle_s=0: no wait
    # other jobs of the suite measuring beside it (a parallel launcher): no wait, however busy
    machine = FakeMachine(busy=[2.0], scans=list(range(0, 100, 5)))
    waited, busy = settle(30.0, others=machine.others, scans=machine.scans, side_by_side=lambda: True)
    assert busy is None and machine.windows == 0


def test_settle_reads_the_real_machine():
    # the one reading of the real host: a spinning process keeps a core busy, and whatever else runs
    # on the machine can only add to what settle sees. It was this test's child, which settle counts
    # as the process's own work: the test passed only beside other load (a second pytest worker)
    pid = spinning_stranger()
    try:
        time.sleep(0.5)
        waited, busy = settle(0.3, others_limit=0.5, window_s=0.25, scans=lambda: 0)
    finally:
        os.kill(pid, signal.SIGKILL)
    assert busy is not None and "other cores busy" in busy, busy


@pytest.mark.parametrize("retries", [1, 0])
def test_an_unstable_job_is_measured_again_in_a_fresh_process(tmp_path, monkeypatch, retries):
    monkeypatch.setenv("ATTNBENCH_SHAKY_MARKER", str(tmp_path / "first_pid"))
    small = [f"{k}={v}" for k, v in SMALL.items() if k != "min_run_time"]
    p = run_sweep(
        tmp_path,
        "variant=naive",
        "variant._target_=tests.faulty.ShakyOnceAttention",
        *small,
        "min_run_time=0.2",
        "threads=1",  # a microsecond kernel on two threads switches between speeds (README)
        f"retry_unstable={retries}",
        "settle_s=0",
    )
    assert p.returncode == 0, p.stderr[-2000:]
    (rec,) = read_records(tmp_path / "records")
    f = rec["figures"]
    assert f["attempts"] == retries + 1
    if retries:
        # the first process slept 1 or 8 ms, sixteen calls at a time: its figure, kept beside the
        # stable one, was not stable
        (first,) = f["earlier_attempts"]
        assert first["fwd_unstable"] and first["fwd_median_s"] >= 0.001
        # the kept figure is the second attempt's, measured in a fresh process (its pid is not the
        # first's); its time is not compared with the first's: how far apart they land depends on how
        # busy the machine is. A sleep never returns early, so 1 ms is a floor, not a timing.
        first_pid = (tmp_path / "first_pid").read_text()
        assert (tmp_path / "first_pid.later").read_text() not in ("", first_pid)
        assert f["fwd_median_s"] >= 0.001
        assert "fwd unstable (IQR above 10% of the median); measuring again (attempt 2 of 2" in p.stdout
        # the store takes the list of earlier attempts (as JSON text) into its Parquet file and tables
        from experiments.records import store
        from experiments.report.kernel_tables import speed_table

        df = store.load([tmp_path / "records"], verbose=False)
        assert json.loads(df["earlier_attempts"].iloc[0]) == f["earlier_attempts"]
        assert (tmp_path / "store" / "store.parquet") in store.save(df, tmp_path / "store")
        speed = speed_table(store.select(df))
        assert list(speed.data["attempts"]) == [2] and "measured again" in speed.note
    else:
        assert f["fwd_unstable"] and "earlier_attempts" not in f


def test_a_job_measured_while_the_machine_ran_slow_is_measured_again(tmp_path):
    # the sweep's fastest canary so far is 1 us: every canary of this job is far slower than it, so its
    # first attempt is measured again, and the second, the last allowed, is kept and says so
    (tmp_path / "sweep").mkdir()
    threads = 1
    (tmp_path / "sweep" / f"canary-cpu-{threads}.json").write_text('{"fastest_ms": 0.001}')
    small = [f"{k}={v}" for k, v in SMALL.items()]
    p = run_sweep(tmp_path, "variant=naive", *small, f"threads={threads}", "settle_s=0", "retry_unstable=1")
    assert p.returncode == 0, p.stderr[-2000:]
    (rec,) = read_records(tmp_path / "records")
    f = rec["figures"]
    assert f["attempts"] == 2 and f["canary_ratio"] > 1000
    (first,) = f["earlier_attempts"]
    assert first["canary_ratio"] > 1000 and first["canary_before_ms"] > 0 and "fwd_median_s" in first
    assert "the machine ran slow (canary" in p.stdout and "measuring again (attempt 2 of 2)" in p.stdout


def test_a_gemm_ceiling_below_a_jobs_own_rate_is_measured_again(tmp_path):
    # the sweep's ceiling says 1 GFLOP/s: naive runs faster than that, so its record keeps that ceiling
    # (its share of it is marked in the report) and the next job measures the ceiling again
    (tmp_path / "sweep").mkdir()
    low = {"device": "cpu", "dtype": "float32", "gemm_n": 2048, "gemm_flops_per_s": 1e9, "threads": 1}
    (tmp_path / "sweep" / "roofline-cpu-float32-1t.json").write_text(json.dumps(low))
    small = [f"{k}={v}" for k, v in SMALL.items() if k != "seq_len"]
    p = run_sweep(tmp_path, "variant=naive,sdpa", *small, "threads=1", "seq_len=256", "roofline=true")
    assert p.returncode == 0, p.stderr[-2000:]
    recs = {r["variant_name"]: r for r in read_records(tmp_path / "records")}
    assert (
        recs["naive"]["roofline"]["gemm_flops_per_s"] == 1e9 < recs["naive"]["figures"]["gflops_per_s"] * 1e9
    )
    assert "ran faster than the sweep's GEMM ceiling: the next job measures the ceiling again" in p.stdout
    again = recs["sdpa"]["roofline"]
    assert again["gemm_n"] == 2048 and again["gemm_flops_per_s"] > 1e9


def test_each_thread_count_of_a_sweep_is_compared_with_its_own_gemm_ceiling(tmp_path):
    # a 2-thread job's GEMM ceiling is measured with 2 threads, not taken from the 1-thread job's
    small = [f"{k}={v}" for k, v in SMALL.items() if k != "seq_len"]
    p = run_sweep(tmp_path, "variant=sdpa", *small, "threads=1,2", "seq_len=128", "roofline=true")
    assert p.returncode == 0, p.stderr[-2000:]
    recs = read_records(tmp_path / "records")
    assert sorted((r["config"]["threads"], r["roofline"]["threads"]) for r in recs) == [(1, 1), (2, 2)]


def test_a_slow_canary_beside_another_measuring_job_is_not_measured_again(tmp_path, monkeypatch):
    # as above, but another job of the suite measures all along (this test process's marker in the
    # sweep's marker folder): a slower canary is expected beside it, so the job is kept as it is
    running = tmp_path / "running"
    running.mkdir()
    (running / str(os.getpid())).touch()
    monkeypatch.setenv("ATTNBENCH_RUNNING_DIR", str(running))
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "canary-cpu-1.json").write_text('{"fastest_ms": 0.001}')
    small = [f"{k}={v}" for k, v in SMALL.items()]
    p = run_sweep(tmp_path, "variant=naive", *small, "threads=1", "settle_s=0", "retry_unstable=1")
    assert p.returncode == 0, p.stderr[-2000:]
    (rec,) = read_records(tmp_path / "records")
    f = rec["figures"]
    assert f["concurrent_jobs"] == 1 and f["canary_ratio"] > 1000
    # (a figure left unstable by a busy machine is still measured again, for that reason alone)
    assert "the machine ran slow" not in p.stdout
    if f["attempts"] == 1:
        assert "measuring again" not in p.stdout and "earlier_attempts" not in f
    else:
        assert "unstable (IQR above" in p.stdout


def test_the_last_line_of_a_sweep_counts_what_it_did():
    from experiments.sweep.callbacks import failures, finished_line

    def e(status, invalid=False, record="r.json", reused=None):
        extra = {"invalid": True} if invalid else {}
        return {"status": status, "record": record, **extra, **({"reused": reused} if reused else {})}

    assert finished_line([e("ok"), e("ok")]) == "sweep finished: 2 job(s): 2 measured"
    line = finished_line([e("ok"), e("skipped"), e("unavailable"), e("unsupported"), e("unavailable")])
    assert line.startswith("sweep finished: 5 job(s): 1 measured, 2 unavailable, 1 unsupported (see the")
    assert "1 reused from earlier records in records_dir (same" in line and "resume=false measures" in line
    # a reused record that holds no result says so: it is not one of the results
    line = finished_line([e("skipped", reused="ok"), e("skipped", reused="unsupported"), e("skipped")])
    assert "3 reused from earlier records in records_dir (2 ok, 1 unsupported) (same config" in line
    assert failures([e("ok"), e("unsupported")]) == []  # findings about a variant, not failures
    assert failures([e("skipped", reused="ok"), e("oom")]) == []
    assert failures([e("skipped")]) == []  # a manifest from before the reused status: taken as measured
    # a run that measured nothing must not pass, whether it ran its jobs now or reused their records
    assert failures([e("unsupported"), e("skipped", reused="unavailable"), e("oom")]) == [
        "no job measured anything (1 oom, 1 unavailable, 1 unsupported; the status table says why)"
    ]
    assert failures([e("ok", invalid=True), e("skipped", invalid=True), e("error")]) == [
        "1 job(s) ended 'error' (see the status table)",
        "2 job(s) computed a wrong result: INVALID, their output failed the check against the float64 oracle",
    ]
    assert failures([]) == ["the sweep launched no job: a sweep list matched nothing"]
