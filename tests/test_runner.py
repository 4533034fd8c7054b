"""The runner: config composition and schema, statuses of every failure, records, resume, sweeps."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

import variants
from experiments.measure.common import build_variant
from experiments.measure.kernel import measure, precheck
from experiments.measure.machine_load import settle
from experiments.measure.spec import JobSpec
from experiments.records.environment import variant_code_version
from experiments.records.records import find_existing, read_records, write_record
from experiments.sweep.hydra_nodes import register_hydra_pieces
from experiments.sweep.isolation import context_for, run_isolated
from experiments.sweep.preflight import preflight
from experiments.sweep.schema import BenchConfig

from .helpers import sweep_overrides

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"
register_hydra_pieces()


def job_cfg(**over) -> dict:
    """A plain job config (what run.py hands a job), composed by Hydra with ``over`` applied."""
    overrides = [f"{k}={v}" for k, v in over.items()]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def job_spec(target: str | None = None, **over) -> JobSpec:
    """The spec of ``job_cfg(**over)``, with the variant's ``_target_`` replaced by ``target``."""
    cfg = job_cfg(**over)
    if target is not None:
        cfg["variant"]["_target_"] = target
    return JobSpec.from_config(cfg)


SMALL = dict(seq_len=64, heads=2, head_dim=16, min_run_time=0.02)


@pytest.mark.parametrize("name", variants.available())
def test_every_registered_variant_composes_from_its_constructor(name):
    # no YAML per variant: variant=<name> is the class the registry names, with the constructor's defaults
    from hydra.utils import get_class

    from variants.registry import SHAPE_HINTS, knob_defaults

    cfg = job_cfg(variant=name)
    assert get_class(cfg["variant"]["_target_"]) is variants.get(name)
    want = {k: v for k, v in knob_defaults(variants.get(name)).items() if k not in SHAPE_HINTS}
    assert {k: v for k, v in cfg["variant"].items() if k not in ("_target_", *SHAPE_HINTS)} == want


def test_defaults_are_written_once():
    # the schema's dataclasses and the constructors hold the defaults; the YAML files hold none of them
    import yaml

    top = yaml.safe_load((CONF / "config.yaml").read_text())
    assert set(top) == {"defaults", "hydra"}, (
        f"conf/config.yaml restates settings: {set(top) - {'defaults', 'hydra'}}"
    )
    assert not list((CONF / "variant").glob("*.yaml")), "a variant's config node comes from its constructor"
    # a preset (a variant with chosen knobs, a task, the model, the encoder) starts from a node built
    # from the code's defaults and sets only what differs from it
    from hydra.core.config_store import ConfigStore

    presets = sorted((CONF / "variant").glob("*/*.yaml"))
    presets += [p for group in ("task", "model", "pretrained") for p in sorted((CONF / group).glob("*.yaml"))]
    assert len(presets) >= 9
    for f in presets:
        body = yaml.safe_load(f.read_text())
        base = next(d for d in body["defaults"] if isinstance(d, str) and d.startswith("/"))
        node = ConfigStore.instance().load(base[1:].split("@")[0] + ".yaml").node
        restated = [k for k, v in body.items() if k != "defaults" and k in node and node[k] == v]
        assert not restated, f"{f.relative_to(CONF)} restates defaults: {restated}"
    # a named sweep sets only the top-level settings it changes
    defaults = BenchConfig(variant=None)
    for f in sorted((CONF / "experiment").glob("*.yaml")):
        body = yaml.safe_load(f.read_text()) or {}
        known = {k: getattr(defaults, k) for k in body if k in BenchConfig.__dataclass_fields__}
        restated = [k for k, d in known.items() if getattr(d, "value", d) == body[k]]  # enums by value
        assert not restated, f"{f.relative_to(CONF)} restates defaults: {restated}"
    cfg = job_cfg(variant="naive")
    assert BenchConfig.from_config(cfg) == BenchConfig(variant=cfg["variant"])
    assert JobSpec.from_config(cfg) == JobSpec(variant=cfg["variant"])


@pytest.mark.parametrize("exp", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_composes_into_a_sweep(exp):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={exp}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert params and "variant" in params or "seq_len" in params


def test_required_experiments_exist():
    have = {p.stem for p in (CONF / "experiment").glob("*.yaml")}
    assert {"quick", "quick_reference", "scaling", "dtypes", "causal", "cross", "gpu"} <= have


@pytest.mark.parametrize(
    "override,field",
    [("seq_len=abc", "seq_len"), ("dtype=fp8", "dtype"), ("mode=both", "mode"), ("device=tpu", "device")],
)
def test_schema_rejects_bad_types_naming_the_field(override, field):
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        job_cfg(**dict([override.split("=")]))
    assert field in str(e.value) or field in str(e.value.__cause__)


def test_unknown_variant_lists_known_ones():
    with pytest.raises(Exception) as e:
        job_cfg(variant="nope")
    for name in ("naive", "sdpa", "chunked"):
        assert name in str(e.value)


def test_ok_job_has_every_figure_and_a_correct_flop_count():
    res = measure(job_spec(variant="naive", **SMALL))
    assert res["status"] == "ok", res
    f = res["figures"]
    assert f["valid"] is True and f["out_rel_err"] < 1e-5
    assert f["flops"] == 1 * 2 * 64 * 64 * (2 * 16 + 2 * 16)  # analytic: B*H*Nq*Nk*(2D+2Dv)
    assert f["fwd_median_s"] > 0 and f["fwd_q1_s"] <= f["fwd_median_s"] <= f["fwd_q3_s"]
    # naive holds scores and probabilities: at least two (H, N, N) fp32 matrices
    assert f["peak_bytes"] >= 2 * 2 * 64 * 64 * 4


def test_each_job_starts_from_a_clean_dynamo_cache():
    # with isolate=false one process runs every job: code Dynamo compiled for earlier jobs must not
    # count against its recompile limit (past it compiled flex silently runs eagerly, N x N scores)
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    f = torch.compile(lambda x: x + 1, backend=backend)
    f(torch.ones(2))
    f(torch.ones(2))
    assert len(compiles) == 1  # cached
    assert measure(job_spec(variant="naive", **SMALL))["status"] == "ok"
    f(torch.ones(2))
    assert len(compiles) == 2  # compiled again: the job reset Dynamo


def test_fwd_bwd_job_times_backward_alone_and_checks_gradients():
    res = measure(job_spec(variant="chunked", mode="fwd_bwd", causal="true", **SMALL))
    f = res["figures"]
    assert res["status"] == "ok", res
    for key in ("fwd_median_s", "bwd_median_s", "fwd_bwd_median_s", "grad_rel_err"):
        assert key in f
    assert f["grad_rel_err"] < 1e-4
    assert f["flops"] == int(1 * 2 * (64 * 65 // 2) * 64 * 3.5)  # causal pairs, backward 2.5x


def test_wrong_result_marks_figures_invalid():
    res = measure(job_spec("tests.faulty.WrongAttention", variant="naive", **SMALL))
    assert res["status"] == "ok" and res["figures"]["valid"] is False
    assert "invalid" in res["reason"]


def test_late_causal_rows_lost_are_caught_by_the_worst_rows_error():
    """sdpa's own output rounded to bf16, causal, N=16384, its rows from N/8 on zeroed: the error over
    the whole output's scale is 0.037, within bf16's 0.05 (the first rows are 10-100x the late
    ones), so the job called it valid; the worst row's error over its own scale is 1."""
    from experiments.measure.accuracy import check_rows, output_accuracy, tolerance, within_tolerance
    from experiments.measure.inputs import make_inputs

    n, dtype = 16384, torch.bfloat16
    attn = variants.build("sdpa")
    inp = make_inputs(1, 2, n, n, 64, 64, dtype=dtype, device="cpu", seed=0, causal=True)
    q, k, v = inp.tensors()
    kw = inp.kwargs(True)
    rows = check_rows(n, 256)  # only the checked rows are read: the others can stay empty
    right = torch.zeros(1, 2, n, 64, dtype=dtype)
    right[:, :, rows] = variants.oracle(attn, q.double(), k.double(), v.double(), rows=rows, **kw).to(dtype)
    lost = right.clone()
    lost[:, :, n // 8 :] = 0
    good, bad = output_accuracy(attn, q, k, v, right, kw), output_accuracy(attn, q, k, v, lost, kw)
    assert within_tolerance(good, "out", tolerance(dtype)) and good["out_row_rel_err"] < 1e-2
    assert bad["out_rel_err"] <= tolerance(dtype)  # what the whole-output error let through
    assert bad["out_row_rel_err"] > 0.5 and not within_tolerance(bad, "out", tolerance(dtype))


def test_late_causal_rows_lost_mark_a_jobs_figures_invalid():
    spec = job_spec(
        "tests.faulty.LateRowsLostAttention", variant="naive", dtype="bfloat16", causal=True, **SMALL
    )
    f = measure(spec)["figures"]
    assert f["valid"] is False and f["out_row_rel_err"] > 0.5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_wrong_gradient_marks_figures_invalid(dtype):
    """The gradient gate was 10x the output's tolerance: a bf16 dV 45% off passed as valid."""
    res = measure(
        job_spec("tests.faulty.WrongGradAttention", variant="naive", mode="fwd_bwd", dtype=dtype, **SMALL)
    )
    assert res["status"] == "ok" and res["figures"]["valid"] is False, res["figures"].get("grad_rel_err")
    assert res["figures"]["out_rel_err"] <= 1e-2 and 0.1 < res["figures"]["grad_v_rel_err"] < 0.3
    right = measure(job_spec(variant="naive", mode="fwd_bwd", dtype=dtype, **SMALL))
    assert right["figures"]["valid"] is True


@pytest.mark.parametrize(
    "target,status",
    [("tests.faulty.NaNAttention", "nan"), ("tests.faulty.CrashingAttention", "error")],
)
def test_failures_become_statuses(target, status):
    res = measure(job_spec(target, variant="naive", **SMALL))
    assert res["status"] == status
    if status == "error":
        assert "deliberate failure" in res["reason"]


def test_a_canary_that_cannot_run_leaves_the_job_measured(monkeypatch):
    # the canary is a diagnostic: its failure (say its 12 MiB not allocated) must not cost the record
    def no_memory(threads):
        raise MemoryError("canary buffers")

    monkeypatch.setattr("experiments.measure.kernel.canary_ms", no_memory)
    res = measure(job_spec(variant="naive", **SMALL))
    assert res["status"] == "ok", res
    f = res["figures"]
    assert f["canary_before_ms"] is None and f["canary_after_ms"] is None
    assert f["fwd_median_s"] > 0


def test_out_of_memory_is_a_status():
    # naive at N=2^17 wants 2^34 fp32 scores (64 GiB) per head. On a large machine that would simply
    # be allocated (and the test could bring the machine down), so the job runs in a child whose
    # address space is capped at 6 GiB: the allocator is refused on any machine and the job says 'oom'
    cfg = job_cfg(variant="naive", seq_len=2**17, heads=1, head_dim=8)
    code = (
        "import json, resource, sys\n"
        "cap = 6 * 2**30\n"
        "resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
        "from experiments.measure.kernel import measure\n"
        "from experiments.measure.spec import JobSpec\n"
        "print(json.dumps(measure(JobSpec.from_config(json.loads(sys.argv[1])))))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["status"] == "oom", res


def test_cuda_without_gpu_is_unavailable():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    spec = job_spec(variant="naive", device="cuda", **SMALL)
    res = precheck(spec, variants.build("naive"))
    assert res["status"] == "unavailable" and "cuda" in res["reason"].lower()
    assert measure(spec)["status"] == "unavailable"


def test_more_threads_than_the_job_s_cpus_is_unavailable(monkeypatch):
    """threads above the CPUs the job may run on (its affinity, faked here at 2) would time the
    scheduler: the job is refused before it runs, in one line that names both numbers."""
    import experiments.measure.common as common

    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: {0, 1})
    over = precheck(job_spec(variant="naive", threads=3, **SMALL), variants.build("naive"))
    assert over["status"] == "unavailable" and "threads=3 but this job may run on 2 CPU(s)" in over["reason"]
    assert precheck(job_spec(variant="naive", threads=2, **SMALL), variants.build("naive")) is None
    assert precheck(job_spec(variant="naive", **SMALL), variants.build("naive")) is None  # all CPUs


def test_dtype_a_variant_lacks_is_unsupported():
    cases = [
        (n, d)
        for n in variants.available()
        for d in ("float16", "bfloat16", "float64")
        if getattr(torch, d) not in variants.get(n).dtypes
    ]
    if not cases:
        pytest.skip("every registered variant supports every dtype")
    name, dtype = cases[0]
    spec = job_spec(variant=name, dtype=dtype, **SMALL)
    res = precheck(spec, build_variant(spec.variant))
    assert res["status"] == "unsupported" and dtype in res["reason"]


def test_isolated_job_records_its_process_high_water_mark():
    # naive at N=2048 holds about 260 MiB of scores: the resident high-water mark the OS reports for
    # the job's own process must cover that peak, plus the torch the child imported
    res = run_isolated(job_spec(variant="naive", seq_len=2048, min_run_time=0.05), timeout_s=300)
    assert res["status"] == "ok", res
    f = res["figures"]
    assert f["peak_mib"] > 200
    assert f["peak_mib"] < f["process_max_rss_mib"] < f["peak_mib"] + 4096


_ORACLE_HEAP_SCRIPT = """
import json, torch
import experiments.measure.kernel as kernel
from experiments.measure.memory import _status_kib
from tests.test_runner import job_spec, SMALL
real, seen = kernel.output_accuracy, {}
def heavy_oracle(*args, **kw):  # a float64 check that holds 512 MiB, then frees it
    seen["rss_mib"] = _status_kib("VmRSS") / 1024
    buf = torch.ones(2**26, dtype=torch.float64)
    del buf
    return real(*args, **kw)
kernel.output_accuracy = heavy_oracle
res = kernel.measure(job_spec(variant="sdpa", **SMALL), roofline=True)
print(json.dumps({"before": seen["rss_mib"], "max": res["figures"]["process_max_rss_mib"]}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_the_process_high_water_mark_is_the_timed_calls_not_the_oracle_s_or_the_ceilings():
    """With glibc keeping freed memory (as jobs run), the oracle's freed buffers and the ceilings'
    1.5 GiB made the figure: 1368 MiB for calls whose own peak was under 8 MiB."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="1073741824")
    env["MALLOC_TRIM_THRESHOLD_"] = "1099511627776"
    p = subprocess.run(
        [sys.executable, "-c", _ORACLE_HEAP_SCRIPT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["max"] < got["before"] + 128  # not the oracle's 512 MiB, nor the ceilings' buffers


def test_a_long_job_shows_it_is_alive(monkeypatch):
    import experiments.sweep.isolation as iso

    monkeypatch.setattr(iso, "HEARTBEAT_S", 1.0)
    spec = job_spec("tests.faulty.HangingAttention", variant="naive", **SMALL)
    beats = []
    res = run_isolated(spec, timeout_s=6, heartbeat=beats.append)
    assert res["status"] == "timeout"
    assert len(beats) >= 2 and beats == sorted(beats) and beats[-1] < 6  # (the start takes a while)


def test_hang_becomes_timeout_and_kill_becomes_killed():
    res = run_isolated(job_spec("tests.faulty.HangingAttention", variant="naive", **SMALL), timeout_s=8)
    assert res["status"] == "timeout"
    res = run_isolated(job_spec("tests.faulty.SelfKillingAttention", variant="naive", **SMALL), timeout_s=60)
    assert res["status"] == "killed" and "SIGKILL" in res["reason"]


def test_cpu_jobs_fork_from_a_server_that_sees_no_gpu_and_cuda_jobs_are_spawned():
    # a process that queried CUDA poisons its forks; the CPU server must never see a GPU to query
    spec = job_spec("tests.faulty.NeedsHiddenGpuAttention", variant="naive", **SMALL)
    res = run_isolated(spec, timeout_s=120)
    assert res["status"] == "ok", res
    assert context_for("cuda").get_start_method() == "spawn"


def _tagged_pids(tag: str) -> list[int]:
    """Processes whose environment holds ``ATTNBENCH_TEST_TAG=<tag>`` (the sweep and all it started)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if f"ATTNBENCH_TEST_TAG={tag}".encode() in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def _parent(pid: int) -> int | None:
    try:  # /proc/<pid>/stat: "pid (comm) state ppid ...", comm may hold spaces
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _job_running(tag: str, sweep_pid: int) -> bool:
    """A tagged process started by another tagged one than the sweep: a job, forked by the server
    (the server and multiprocessing's resource tracker are the sweep's own children)."""
    pids = set(_tagged_pids(tag))
    return any(_parent(pid) in pids - {sweep_pid} for pid in pids)


def _wait_gone(tag: str, timeout_s: float) -> list[int]:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        left = _tagged_pids(tag)
        if not left:
            return []
        time.sleep(0.2)
    return _tagged_pids(tag)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killing_the_sweep_ends_its_job_and_fork_server(tmp_path, sig):
    tag = f"{os.getpid()}-{sig.name}"
    cmd = [
        sys.executable,
        "run.py",
        "-m",
        "variant=naive",
        "variant._target_=tests.faulty.HangingAttention",
        *sweep_overrides(*[f"{k}={v}" for k, v in SMALL.items()]),
        f"records_dir={tmp_path / 'records'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), ATTNBENCH_TEST_TAG=tag)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not _job_running(tag, proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert _job_running(tag, proc.pid), "the job never started"
        proc.send_signal(sig)
        proc.wait(30)
        # generous: on a loaded machine (another sweep beside the tests) exiting takes seconds
        assert _wait_gone(tag, 60) == [], "processes outlived the sweep"
        assert not list((tmp_path / "records").glob("*.json")), "an interrupted job left a record"
    finally:
        for pid in _tagged_pids(tag):
            os.kill(pid, signal.SIGKILL)
        proc.kill()


def run_sweep(tmp_path: Path, *args: str, sweep: str = "sweep") -> subprocess.CompletedProcess:
    """``run.py -m <args>`` into ``tmp_path``/records, its sweep folder ``tmp_path``/``sweep``."""
    cmd = [
        sys.executable,
        "run.py",
        "-m",
        *sweep_overrides(*args),
        f"records_dir={tmp_path / 'records'}",
        f"hydra.sweep.dir={tmp_path / sweep}",
        "report=false",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def test_real_sweep_survives_failures_fails_on_error_and_resumes(tmp_path):
    small = [f"{k}={v}" for k, v in SMALL.items()]
    targets = (
        "variant._target_=variants.naive.NaiveAttention,"
        "tests.faulty.CrashingAttention,tests.faulty.NaNAttention"
    )
    p = run_sweep(tmp_path, "variant=naive", targets, *small, "seq_len=32,64")
    # every job ran and was recorded, then the sweep failed because two of them ended 'error'
    assert p.returncode == 1, p.stderr[-2000:]
    assert "sweep finished: 6 job(s)" in p.stdout  # on_multirun_end ran after the failing jobs
    assert "2 job(s) ended 'error'" in p.stderr
    recs = read_records(tmp_path / "records")
    assert sorted(r["status"] for r in recs) == ["error", "error", "nan", "nan", "ok", "ok"]
    assert not list((tmp_path / "records").glob(".tmp-*"))
    # the same sweep again: only the two 'ok' records are reused; error and nan are measured again
    p = run_sweep(tmp_path, "variant=naive", targets, *small, "seq_len=32,64")
    assert p.returncode == 1, p.stderr[-2000:]
    assert p.stdout.count("skipped: already measured") == 2
    assert len(read_records(tmp_path / "records")) == 10
    # the sweep folder is the same: this sweep lists, counts and reports its own 6 jobs, the earlier
    # sweep's list set aside (it counted 6 and ended 1 for its own errors)
    manifest = (tmp_path / "sweep" / "manifest.jsonl").read_text().splitlines()
    assert len(manifest) == 6 and all(json.loads(line)["record"] for line in manifest)
    assert "note: hydra.sweep.dir held an earlier sweep; its manifest and ceilings moved to" in p.stdout
    assert len((tmp_path / "sweep" / "earlier-1" / "manifest.jsonl").read_text().splitlines()) == 6
    assert "sweep finished: 6 job(s): 0 measured" in p.stdout and "2 reused" in p.stdout
    # nan is a finding about the variant, not a failure of the sweep
    nan_only = "variant._target_=variants.naive.NaiveAttention,tests.faulty.NaNAttention"
    p = run_sweep(tmp_path / "b", "variant=naive", nan_only, *small, "seq_len=32")
    assert p.returncode == 0, p.stderr[-2000:]


def _record(tmp_path, status, **env_changes):
    env = {
        "code_version": "c1",
        "variant_code": "v1",
        "torch": "2.13.0",
        "host": "h",
        "cpu_model": "cpu",
        "cpu_capability": "AVX2",
        "gpu_name": None,
    }
    rec = {
        "config_hash": "abc",
        "status": status,
        "started_at": status,
        "config": {},
        "env": {**env, **env_changes},
    }
    return write_record(rec, tmp_path), env


@pytest.mark.parametrize("status", ["ok", "unsupported", "oom"])
def test_resume_reuses_a_deterministic_status_made_the_same_way(tmp_path, status):
    path, env = _record(tmp_path, status)
    assert find_existing(tmp_path, "abc", env) == path
    assert find_existing(tmp_path, "abd", env) is None  # another config


@pytest.mark.parametrize("status", ["error", "timeout", "killed", "nan", "unavailable"])
def test_resume_measures_again_after_a_status_a_rerun_may_change(tmp_path, status):
    _, env = _record(tmp_path, status)
    assert find_existing(tmp_path, "abc", env) is None


@pytest.mark.parametrize(
    "field",
    [
        "code_version", "variant_code", "torch", "cuda", "host", "cpu_model", "cpu_capability", "gpu_name",
        "job_threads", "malloc", "c_compiler", "xformers", "triton", "transformers", "speed_settings",
    ],
)  # fmt: skip
def test_resume_measures_again_when_code_torch_or_machine_changed(tmp_path, field):
    _, env = _record(tmp_path, "ok", **{field: "something else"})
    assert find_existing(tmp_path, "abc", env) is None


def test_a_record_names_the_environment_variables_that_change_speed(tmp_path):
    """OMP_WAIT_POLICY=PASSIVE halved small fwd+bwd jobs' time here and no field said it was set: the
    record names such variables (and only those), a record from before the field resumes where none
    is set, and the comparison of two runs names the difference."""
    from experiments.records import store
    from experiments.records.environment import speed_settings
    from experiments.report.compare import env_diff

    from .test_compare import record

    given = {"OMP_WAIT_POLICY": "PASSIVE", "LD_PRELOAD": "/usr/lib/libjemalloc.so.2", "HOME": "/root"}
    assert speed_settings(given) == "LD_PRELOAD=/usr/lib/libjemalloc.so.2; OMP_WAIT_POLICY=PASSIVE"
    assert speed_settings({"HOME": "/root", "LD_PRELOAD": ""}) is None
    path, env = _record(tmp_path, "ok")  # written without the field, as before it existed
    assert find_existing(tmp_path, "abc", {**env, "speed_settings": None}) == path
    assert find_existing(tmp_path, "abc", {**env, "speed_settings": "OMP_WAIT_POLICY=PASSIVE"}) is None

    def frame(settings: str | None):
        rec = record(256, 10.0, 0.1)
        rec["env"] = {"host": "vm", "speed_settings": settings}
        return store.to_frame([rec])

    text = env_diff(frame("OMP_WAIT_POLICY=PASSIVE"), frame(None))
    assert text == "Differences: speed settings: OMP_WAIT_POLICY=PASSIVE (this) vs none (baseline)."
    assert env_diff(frame(None), frame(None)) == "The two sets report the same environment."


def test_the_code_version_follows_the_c_kernels_and_not_the_report(tmp_path, monkeypatch):
    """A change to a C kernel was hidden behind records of the old one; a report-only change sent
    every record to be measured again."""
    from experiments.records import environment

    for rel in ("variants/a.py", "variants/k.c", "experiments/measure/m.py", "experiments/report/r.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("1")
    monkeypatch.setattr(environment, "ROOT", tmp_path)

    def version_after(rel: str, text: str) -> str:
        (tmp_path / rel).write_text(text)
        environment.code_version.cache_clear()
        return environment.code_version()

    try:
        first = version_after("variants/a.py", "1")
        assert version_after("experiments/report/r.py", "2") == first
        assert version_after("variants/k.c", "2") != first
        assert version_after("experiments/measure/m.py", "2") != version_after(
            "experiments/measure/m.py", "1"
        )
    finally:
        environment.code_version.cache_clear()


def test_the_environment_names_the_c_compiler_or_none(monkeypatch, tmp_path):
    from experiments.records.environment import c_compiler

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert c_compiler() is None
    monkeypatch.setenv("CC", sys.executable)  # anything that answers --version
    assert (
        c_compiler()
        == subprocess.run([sys.executable, "--version"], capture_output=True, text=True).stdout.strip()
    )


@pytest.mark.skipif(
    shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2, reason="needs taskset, 2 CPUs"
)
def test_threads_null_does_not_reuse_a_record_made_on_more_cpus(tmp_path):
    """threads=null takes every CPU the job may use: a job pinned to one CPU reused a 2-thread time."""
    small = [f"{k}={v}" for k, v in SMALL.items()]
    p = run_sweep(tmp_path, "variant=sdpa", "threads=null", *small)
    assert p.returncode == 0, p.stderr[-2000:]
    cmd = [
        "taskset",
        "-c",
        "0",
        sys.executable,
        "run.py",
        "-m",
        *sweep_overrides("variant=sdpa", "threads=null", *small),
    ]
    cmd += [f"records_dir={tmp_path / 'records'}", f"hydra.sweep.dir={tmp_path / 'one'}", "report=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "skipped: already measured" not in p.stdout
    threads = sorted(r["env"]["job_threads"] for r in read_records(tmp_path / "records"))
    assert threads[0] == 1 and threads[1] > 1 and len(threads) == 2


def test_resume_survives_junk_named_like_a_record(tmp_path, capsys):
    (tmp_path / "abc-zz-1.json").write_bytes(bytes(range(256)))  # not UTF-8
    (tmp_path / "abc-zz-2.json").write_text("[1, 2]")  # JSON, not a record
    path, env = _record(tmp_path, "ok")
    assert find_existing(tmp_path, "abc", env) == path
    out = capsys.readouterr().out
    assert "abc-zz-1.json" in out and "abc-zz-2.json" in out
    assert len(read_records(tmp_path)) == 1


@pytest.mark.parametrize("figures", [{}, {"fwd_median_s": "abc"}, {"fwd_median_s": float("nan")}])
def test_resume_measures_again_an_ok_record_without_its_headline_figure(tmp_path, figures, capsys):
    """An ok record cut short or edited (no number where its time should be) is not reused: a report
    would show n/a cells and call every job checked."""
    from experiments.sweep.runner import not_reusable

    path, env = _record(tmp_path, "ok")
    rec = json.loads(path.read_text())
    assert not_reusable({**rec, "config": {"mode": "fwd"}, "figures": {"fwd_median_s": 0.01}}) is None
    path.write_text(json.dumps({**rec, "config": {"mode": "fwd"}, "figures": figures}))
    assert find_existing(tmp_path, "abc", env, not_reusable) is None
    assert "not reusing" in capsys.readouterr().out and "fwd_median_s" in not_reusable(
        json.loads(path.read_text())
    )
    # a task record is about its accuracy, a fwd_bwd kernel record about its fwd_bwd time
    assert "test_accuracy" in not_reusable({"status": "ok", "kind": "task", "config": {}, "figures": {}})
    fb = {"status": "ok", "config": {"mode": "fwd_bwd"}, "figures": {"fwd_median_s": 1.0}}
    assert "fwd_bwd_median_s" in not_reusable(fb)


def test_a_sweep_measures_again_the_record_it_cannot_trust(tmp_path):
    small = [f"{k}={v}" for k, v in SMALL.items()]
    p = run_sweep(tmp_path, "variant=naive", *small)
    assert p.returncode == 0, p.stderr[-2000:]
    (path,) = (tmp_path / "records").glob("*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "figures": {}}))  # cut short
    p = run_sweep(tmp_path, "variant=naive", *small)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "not reusing" in p.stdout and "skipped: already measured" not in p.stdout
    newest = max(read_records(tmp_path / "records"), key=lambda r: r["started_at"])
    assert newest["figures"]["fwd_median_s"] > 0


def test_an_approximate_variant_s_cross_attention_job_measures_its_deviation_from_full_attention():
    # the deviation's reference took no cross (nor documents): every such job ended in a TypeError
    res = measure(job_spec(variant="performer", cross=True, kv_len=48, **SMALL))
    assert res["status"] == "ok", res
    assert math.isfinite(res["figures"]["dev_full_rel_err"]) and res["figures"]["dev_full_rel_err"] > 0


def test_additive_attention_is_another_operator_and_its_deviation_from_full_attention_is_measured():
    """It was marked exact, so its records held only its error against its own oracle (7e-7), and the
    report's deviation tables left it out: it is about 1 away from softmax attention."""
    res = measure(job_spec(variant="additive", **SMALL))
    assert res["status"] == "ok" and res["variant"]["exact"] is False
    assert res["figures"]["out_rel_err"] < 1e-4 and res["figures"]["dev_full_rel_err"] > 0.3


def test_the_terminal_line_says_when_a_time_is_unstable_or_was_measured_beside_other_work():
    from experiments.measure.kernel import kernel_summary

    figs = {"fwd_median_s": 0.002, "fwd_iqr_s": 0.001, "peak_mib": 1.0, "out_rel_err": 1e-7}
    assert "unstable" not in kernel_summary(figs, {"mode": "fwd"}) and "beside" not in kernel_summary(
        figs, {"mode": "fwd"}
    )
    line = kernel_summary({**figs, "fwd_unstable": True, "others_cpu_cores": 1.2}, {"mode": "fwd"})
    assert "fwd 2 ms (IQR 1) unstable beside other work (1.2 other cores busy" in line
    assert "beside other work" in kernel_summary({**figs, "concurrent_jobs": 1}, {"mode": "fwd"})


def test_records_are_readable_by_others(tmp_path):
    path, _ = _record(tmp_path, "ok")
    assert path.stat().st_mode & 0o044 == 0o044


def test_a_changed_plugin_kernel_is_a_new_variant_code_version(tmp_path, monkeypatch):
    import importlib

    mod = tmp_path / "myplugin.py"
    mod.write_text("from variants.naive import NaiveAttention\nclass Mine(NaiveAttention):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = variant_code_version(importlib.import_module("myplugin").Mine)
    mod.write_text("from variants.naive import NaiveAttention\nclass Mine(NaiveAttention):\n    x = 1\n")
    importlib.reload(sys.modules["myplugin"])
    assert variant_code_version(sys.modules["myplugin"].Mine) != first
    assert variant_code_version(variants.get("naive")) != first


def test_bad_value_is_one_line_error_before_work(tmp_path):
    cmd = [sys.executable, "run.py", "seq_len=0", f"records_dir={tmp_path}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.strip() == "error: seq_len must be > 0, got 0"
    assert not list(tmp_path.glob("*.json"))


def _install_plugin(root: Path) -> None:
    """A third-party package on the path with an ``attnbench.variants`` entry point (a dist-info
    folder next to it is what pip would leave) and no YAML in this repo."""
    (root / "myplug").mkdir()
    (root / "myplug" / "__init__.py").write_text(
        "from variants import register\n"
        "from variants.naive import NaiveAttention\n\n"
        "@register('myplug_attn')\n"
        "class MyPlugAttention(NaiveAttention):\n"
        "    def __init__(self, temperature: float = 1.0, tag: str = 'x') -> None:\n"
        "        super().__init__()\n"
        "        self.temperature, self.tag = temperature, tag\n"
    )
    dist = root / "myplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[attnbench.variants]\nmyplug_attn = myplug\n")


def test_entry_point_plugin_is_a_variant_choice_with_knobs(tmp_path):
    _install_plugin(tmp_path)
    small = [f"{k}={v}" for k, v in SMALL.items()]
    cmd = [
        sys.executable,
        "run.py",
        "-m",
        "variant=glob(myplug*)",  # the glob sees the plugin's generated config node
        "variant.temperature=2.0",  # a knob without '+'
        *sweep_overrides(*small),
        f"records_dir={tmp_path / 'records'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "report=false",
    ]
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    (rec,) = read_records(tmp_path / "records")
    assert rec["status"] == "ok" and rec["variant_name"] == "myplug_attn"
    assert rec["config"]["variant"]["temperature"] == 2.0
    # which version of the plugin ran: it shares this repository's commit with the plugin's other versions
    assert rec["env"]["variant_package"] == "myplug 0.1"
    bad = subprocess.run(
        [sys.executable, "run.py", "variant=myplug_attn", "variant.temprature=2", f"records_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert bad.returncode == 1
    assert bad.stderr.strip() == "error: unknown knob 'temprature' for myplug_attn; knobs: temperature, tag"


def test_a_plugin_that_registers_nothing_under_its_name_says_so(tmp_path):
    """An entry point naming a module that forgot @register (or registered another name): without a
    word the variant was just 'unknown', as if the plugin were not installed."""
    (tmp_path / "forgetful.py").write_text(
        "from variants.naive import NaiveAttention\n\nclass Mine(NaiveAttention):\n    pass\n"
    )
    dist = tmp_path / "forgetful-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: forgetful\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[attnbench.variants]\nforgot = forgetful\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    code = "import variants; print('forgot' in variants.available())"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert p.stdout.strip() == "False"
    assert "plugin 'forgot' (forgetful) loaded but registered no variant named 'forgot'" in p.stderr


@pytest.mark.parametrize("name", ["", "a,b", "my attn", "x=1"])
def test_a_variant_name_a_command_line_cannot_say_is_refused(name):
    with pytest.raises(ValueError, match="letters, digits"):
        variants.register(name)


def test_a_variant_returning_the_wrong_shape_is_named_in_one_line():
    """A third party's _attend returning (B, Nq, H, Dv), or None: one line naming the class and the
    shape it owed, not a torch error about tensor sizes further on."""
    from variants.naive import NaiveAttention

    class Transposed(NaiveAttention):
        def _attend(self, q, k, v, **kw):
            return super()._attend(q, k, v, **kw).transpose(1, 2)

    class Forgot(NaiveAttention):
        def _attend(self, q, k, v, **kw):
            return None

    q = torch.randn(1, 8, 16, 4)
    with pytest.raises(TypeError, match=r"Transposed._attend returned \(1, 16, 8, 4\); expected a tensor"):
        Transposed()(q, q, q)
    with pytest.raises(
        TypeError, match=r"Forgot._attend returned NoneType; expected a tensor \(B, H, Nq, Dv\)"
    ):
        Forgot()(q, q, q)


def test_a_subclass_of_a_registered_variant_is_labelled_by_its_own_class():
    from experiments.sweep.checks import variant_label
    from tests.faulty import CrashingAttention

    assert variant_label(CrashingAttention) == "tests.faulty.CrashingAttention"
    assert variant_label(variants.get("naive")) == "naive"


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["variant=nosuch"],
            f"error: unknown variant 'nosuch'; known variants: {', '.join(variants.available())}; "
            "knob presets: frontier/local_window_w16, ",  # the presets in conf/variant/*/, sorted
        ),
        (["dtype=fp8"], "error: dtype=fp8: expected one of float32, float64, bfloat16, float16"),
        (
            ["variant=local_window", "variant.windo=3"],
            "error: unknown knob 'windo' for local_window; knobs: ",
        ),
        (
            ["variant=local_window", "variant.window=16.0"],
            "error: local_window knob window must be int, got 16.0",
        ),
        (["causal=true", "kv_len=512"], "error: causal=true needs kv_len >= seq_len (or null)"),
        (["heads=8", "kv_heads=3"], "error: kv_heads must divide heads, got heads=8, kv_heads=3"),
        # a setting no job reads: refused, whether or not Hydra was told to add it
        (["seqlen=64"], "error: unknown setting 'seqlen' in 'seqlen=64'; did you mean seq_len or seed?"),
        (["+seqlen=64"], "error: unknown setting 'seqlen' in '+seqlen=64'; did you mean seq_len"),
        (["window=16"], "error: unknown setting 'window' in 'window=16'; did you mean variant.window?"),
        # a sweep's jobs are checked before Hydra launches any: no banner, no sweep folder
        (["-m", "seq_len=64,0"], "error: seq_len must be > 0, got 0"),
        (["timeout_s=nan"], "error: timeout_s must be a finite number > 0, got nan"),
        (["settle_s=inf"], "error: settle_s must be a finite number >= 0"),
        (["-m", "variant=local_window", "variant.window=-5"], "error: window must be >= 0"),
        (["-m", "variant=naive,sdpa", "padding=0.5,1.5"], "error: padding must be in [0, 1), got 1.5"),
        # a named sweep or task that does not exist: one line, not Hydra's page of search paths
        (["-m", "experiment=nosuch"], "error: unknown experiment 'nosuch'; known: causal, cross, decode,"),
        # a named sweep is a sweep: as a single run it would measure one job of defaults, exit 0
        (["experiment=quick"], "error: experiment=quick sweeps variant, seq_len, mode: run it with -m"),
        (["-m", "experiment=quick,scaling"], "error: experiment=quick,scaling: one named sweep at a time"),
        # Hydra's own multi-line errors, as one line: a value of the wrong type, a launcher misspelt
        (["seq_len=abc"], "error: seq_len=abc: Value 'abc' of type 'str' could not be converted to Integer"),
        (["-m", "batch=1,x"], "error: batch=x: Value 'x' of type 'str' could not be converted to Integer"),
        (
            ["-m", "hydra/launcher=jobilb"],
            "error: hydra/launcher=jobilb: no such option; available: basic, joblib, slurm,",
        ),
        (["+task=nosuch"], "error: unknown task 'nosuch'; known: copy, recall, reverse (conf/task/)"),
        (["task=copy"], "error: task=...: nothing chose a task to override; add one with +task=<name>"),
        # a key the chosen model, task or encoder does not have: the one it likely meant
        (
            ["-m", "experiment=llama", "model.hiden=64"],
            "error: Could not override 'model.hiden'.: Key 'hiden' is not in struct; did you mean "
            "model.hidden?",
        ),
        # a list value is one value, not sweep syntax: it is checked too (Hydra's five lines before)
        (
            ["-m", "experiment=pretrained", "pretrained.full_layer=[2,4]"],
            "error: Could not override 'pretrained.full_layer'.: Key 'full_layer' is not in struct; did you "
            "mean pretrained.full_layers?",
        ),
        # settings a task or model job would ignore, or that would label its record wrongly
        (["+task=recall", "task.steps=0"], "error: task.steps must be an integer >= 1, got 0"),
        (
            ["+task=recall", "seq_len=128", "heads=3"],
            "error: task jobs build their own attention calls: heads=3",
        ),
        (["-m", "experiment=llama", "model.layers=0"], "error: model.layers must be an integer >= 1, got 0"),
        (["-m", "experiment=llama", "model.kv_heads=3"], "error: model.kv_heads must divide model.heads"),
        (
            ["-m", "experiment=llama", "model.new_tokens=1"],
            "error: model.new_tokens must be an integer >= 2, got 1",
        ),
        (
            ["-m", "experiment=llama", "seq_len=128"],
            "error: seq_len=128 but a model job prefills model.prefill_len",
        ),
    ],
)
def test_input_that_can_never_run_is_one_line_before_work(tmp_path, args, message, capsys):
    # the checks run.py passes its command line through before Hydra launches anything, called here
    # (a run.py process per case took 13 s each in the suite); test_run_py_checks_its_command_line_first
    # runs some of them through run.py itself
    with pytest.raises(SystemExit) as exit_:
        preflight(["run.py", *args, f"records_dir={tmp_path}", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 1
    assert len(err.strip().splitlines()) == 1 and err.startswith(message), err
    assert out == ""
    assert not list(tmp_path.glob("*.json")) and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["variant=local_window", "variant.windo=3"], "error: unknown knob 'windo' for local_window"),
        (["-m", "seq_len=64,0"], "error: seq_len must be > 0, got 0"),
        (["-m", "hydra/launcher=jobilb"], "error: hydra/launcher=jobilb: no such option; available: basic,"),
    ],
    ids=["knob", "sweep", "hydra"],
)
def test_run_py_checks_its_command_line_first(tmp_path, args, message):
    # the wiring: one line, exit 1, no banner, no sweep folder, no record
    p = subprocess.run(
        [sys.executable, "run.py", *args, f"records_dir={tmp_path}", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith(message), p.stderr
    assert p.stdout == ""  # no "Launching" banner, no "sweep finished"
    assert not list(tmp_path.glob("*.json")) and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "variant=naive,sdpa"],
        ["-m", "hydra/sweeper=optuna", "hydra.sweeper.params.seq_len=choice(32,64)"],
        ["hydra/job_logging=disabled", "hydra.job.chdir=true", "seq_len=32"],
        ["hydra.searchpath=[file:///nonexistent]", "hydra/launcher=elsewhere"],  # Hydra's to find
    ],
    ids=["joblib", "optuna", "logging", "searchpath"],
)
def test_hydra_s_own_options_pass_the_preflight(args):
    """The one-line refusals must not refuse what Hydra takes: its launchers, sweepers and settings
    (a group option from another config folder is Hydra's to find)."""
    from experiments.sweep.hydra_nodes import register_hydra_pieces

    register_hydra_pieces()
    assert preflight(["run.py", *args])[1:] == args


def test_a_sweep_that_matches_no_job_fails_in_one_line(tmp_path):
    p = run_sweep(tmp_path, "variant=glob(zzz*)")  # checked before Hydra launches anything
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.startswith("error: 'variant=glob(zzz*)' matches no variant; known variants: additive")
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "sweep").exists()
    # a glob with an exclude list is Hydra's to expand: the sweep's end says it launched nothing
    p = run_sweep(tmp_path, "variant=glob(*,exclude=*)")
    assert p.returncode == 1
    assert p.stderr.strip() == (
        "the sweep launched no job: 'variant=glob(*,exclude=*)' matched nothing: exit code 1"
    )
    assert "records listed" not in p.stdout and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    "glob,says",
    [
        # Hydra reads a second argument as an exclude: this ran local_window alone, without a word
        ("glob(local*,sparse)", "glob's second argument excludes, and sparse takes away nothing local* "
         "matched; for several patterns give one "
         "list: 'variant=glob([local*,sparse])'"),
        ("glob(*,exclude=[spars])", "exclude spars takes away nothing * matched"),
        ("glob([zzz*,yyy])", "matches no variant"),
        ("glob([local*,sparse])", None),
        ("glob(*,exclude=[spars*])", None),
    ],
)  # fmt: skip
def test_a_variant_glob_that_cannot_mean_what_it_says_is_refused_before_launch(glob, says, capsys):

    argv = ["run.py", "-m", f"variant={glob}", "seq_len=64"]
    if says is None:
        assert preflight(argv) == argv
        return
    with pytest.raises(SystemExit):
        preflight(argv)
    assert capsys.readouterr().err.strip() == f"error: 'variant={glob}'" + (
        f": {says}" if "matches" not in says else f" {says}; known variants: " + ", ".join(variants.builtin())
    )


def test_a_sweep_over_records_dir_is_refused_before_launch(capsys):
    """The sweep locked and checked ./outputs/records while its jobs wrote unlocked into a and b."""

    with pytest.raises(SystemExit):
        preflight(["run.py", "-m", "records_dir=/tmp/a,/tmp/b", "seq_len=64"])
    assert capsys.readouterr().err.strip() == (
        "error: records_dir=/tmp/a,/tmp/b: a sweep writes one records_dir, which it locks; run one sweep "
        "per folder"
    )
    argv = ["run.py", "-m", "records_dir=/tmp/a", "variant=sdpa", "seq_len=64"]
    assert preflight(argv) == argv


@pytest.mark.parametrize(
    "argv,says",
    [
        (["causal=yes"], "causal=yes: expected true or false"),
        (["-m", "causal=false,2"], "causal=2: expected true or false"),
        (["extra.tag=a"],
         "extra.tag=a: extra holds tags of your own; add one with a +: +extra.<tag>=<value>"),
        (["variant=sdpa,naive"],
         "variant=sdpa,naive: a comma list is a sweep; run it with -m "
         "(python run.py -m ... variant=sdpa,naive)"),
        (["-m", "+experiment=quick"],
         "+experiment=quick: experiment is a setting already; write experiment=quick"),
        (["-m", "variant=sdpa", "--cfg", "job"],
         "--cfg prints a config and runs nothing: drop -m (python run.py --cfg job ...)"),
    ],
)  # fmt: skip
def test_command_lines_hydra_answers_with_a_page_get_one_line(argv, says, capsys):

    with pytest.raises(SystemExit):
        preflight(["run.py", *argv])
    assert capsys.readouterr().err.strip() == f"error: {says}"


def test_booleans_and_tags_as_meant_pass_the_preflight():

    for argv in (
        ["run.py", "causal=True", "+extra.tag=a"],
        ["run.py", "-m", "causal=true,false", "seq_len=64"],
    ):
        assert preflight(argv) == argv


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


def test_a_second_sweep_into_a_busy_records_dir_is_refused_before_work(tmp_path):
    from experiments.records import records_lock

    records = tmp_path / "records"
    records.mkdir()
    # another sweep holds the folder: a real process, holding the real lock
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path\n"
            "from experiments.records.records_lock import acquire\n"
            f"acquire(Path({str(records)!r}), Path('elsewhere')); print('held', flush=True); time.sleep(120)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        p = run_sweep(tmp_path, "variant=naive", *[f"{k}={v}" for k, v in SMALL.items()])
        assert p.returncode == 1
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith(f"error: records_dir {records} is in use by another sweep (pid {holder.pid}")
        assert not list(records.glob("*.json"))
    finally:
        holder.kill()
        holder.wait()
    # once the holder is gone (however it ended) the folder is free: no stale lock
    p = run_sweep(tmp_path, "variant=naive", *[f"{k}={v}" for k, v in SMALL.items()])
    assert p.returncode == 0, p.stderr[-2000:]
    assert len(read_records(records)) == 1
    assert records_lock.LOCK_NAME not in [p.name for p in records.glob("*.json")]


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_an_unusable_records_dir_is_one_line_before_any_measurement(tmp_path, kind):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    target = blocker if kind == "a file" else blocker / "records"
    for args in (["-m", "variant=naive,sdpa"], ["variant=naive"]):  # a sweep and a single run
        cmd = [sys.executable, "run.py", *args, *[f"{k}={v}" for k, v in SMALL.items()]]
        cmd += [
            f"records_dir={target}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            f"hydra.run.dir={tmp_path}/run",
        ]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 1
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith(f"error: records_dir {target} ")
        assert "[naive" not in p.stdout  # nothing was measured


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
    from omegaconf import OmegaConf

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


def test_the_gpu_in_the_environment_is_the_one_torch_calls_device_0(monkeypatch):
    """nvidia-smi's GPU 0 was recorded (and compared on resume) whatever CUDA_VISIBLE_DEVICES chose."""
    from experiments.records import environment

    asked = []

    def fake_run(cmd, **kw):
        asked.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="NVIDIA H200, 143771, 570.1, 9.0\n", stderr="")

    monkeypatch.setattr(environment.subprocess, "run", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert environment.gpu_info()["gpu_name"] == "NVIDIA H200" and asked[-1][1:3] == ["-i", "3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert environment.gpu_info()["gpu_memory_gib"] == 140.4 and "-i" not in asked[-1]
    for hidden in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        calls = len(asked)
        assert environment.gpu_info() == {} and len(asked) == calls


def test_the_defaults_docs_list_are_the_composed_config_s():
    """docs/running.md lists every setting's default; the schema writes them once, and this keeps the
    list true."""
    cfg = job_cfg()
    text = (ROOT / "docs" / "running.md").read_text()
    listed = text.split("<!-- defaults -->\n", 1)[1].split("\n<!-- /defaults -->", 1)[0]
    pairs = dict(item.strip("` ").split("=", 1) for item in listed.replace("\n", " ").split(", "))

    def shown(v: object) -> str:
        return "null" if v is None else v if isinstance(v, str) else json.dumps(v)

    assert pairs == {k: shown(v) for k, v in cfg.items() if k != "variant"}


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


def _local_window_note(monkeypatch, cache: Path, dtype: torch.dtype) -> dict:
    """The description of ``local_window`` (impl=auto) after one CPU call in ``dtype``, its C kernel
    built afresh with ``cache`` as the kernel cache."""
    from variants import sparse_kernel
    from variants.ckernel import CKernel
    from variants.local_window import LocalWindowAttention

    monkeypatch.setenv("ATTNBENCH_CACHE", str(cache))
    fresh = CKernel("sparse_kernel.c", "the block-sparse kernel", sparse_kernel._declare)
    monkeypatch.setattr(sparse_kernel, "_KERNEL", fresh)  # not the one this process may have built
    attn = LocalWindowAttention(window=4)
    q = torch.randn(1, 2, 16, 8, dtype=dtype)
    attn(q, q, q)
    return attn.describe()


def test_resume_measures_again_a_record_whose_c_kernel_could_not_be_built(tmp_path, monkeypatch, capsys):
    """A record measured on the PyTorch fallback because the C kernel could not be built (here: the
    kernel cache is a file, as an unwritable or full cache would fail) was reused by a later sweep
    where the kernel builds, and its figures shown as the kernel's."""
    from experiments.sweep.runner import not_reusable

    (tmp_path / "blocked").write_text("a file, not a folder")
    broken = _local_window_note(monkeypatch, tmp_path / "blocked" / "cache", torch.float32)
    assert broken["impl_ran"] == "sdpa" and "could not be built or loaded" in broken["impl_note"]
    # a call shape the kernel refuses is no build failure: it would fall back the same way again
    refused = _local_window_note(monkeypatch, tmp_path / "blocked" / "cache", torch.float64)
    assert refused["impl_ran"] == "sdpa" and "float64" in refused["impl_note"]
    path, env = _record(tmp_path / "records", "ok")
    rec = {**json.loads(path.read_text()), "config": {"mode": "fwd"}, "figures": {"fwd_median_s": 0.01}}
    path.write_text(json.dumps({**rec, "variant": refused}))
    assert find_existing(tmp_path / "records", "abc", env, not_reusable) == path
    path.write_text(json.dumps({**rec, "variant": broken}))
    assert find_existing(tmp_path / "records", "abc", env, not_reusable) is None
    out = capsys.readouterr().out
    assert f"warning: not reusing {path}: it ran a fallback because a C kernel could not be built" in out
    # a compiler that fails says so in other words; the record is not reused either
    monkeypatch.setenv("CC", "false")
    failed = _local_window_note(monkeypatch, tmp_path / "cache", torch.float32)
    assert "false could not build sparse_kernel.c" in failed["impl_note"]
    path.write_text(json.dumps({**rec, "status": "ok", "variant": failed}))
    assert find_existing(tmp_path / "records", "abc", env, not_reusable) is None


def test_a_hydra_output_folder_that_cannot_be_made_is_one_line_before_work(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    small = [f"{k}={v}" for k, v in SMALL.items()]
    cases = [
        (["-m", "variant=naive"], "hydra.sweep.dir", blocker / "sweep", "Not a directory"),
        (["variant=naive"], "hydra.run.dir", blocker / "run", "Not a directory"),
        (["-m", "variant=naive"], "hydra.sweep.dir", blocker, "it is a file, not a folder"),
    ]
    for args, setting, target, why in cases:
        cmd = [
            sys.executable,
            "run.py",
            *args,
            *small,
            f"records_dir={tmp_path / 'records'}",
            f"{setting}={target}",
        ]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 1, p.stderr[-2000:]
        assert p.stderr.strip() == f"error: {setting} {target} cannot be created: {why}"
        assert "[naive" not in p.stdout  # nothing was measured
    # a folder that can be made is left for Hydra to make, as it was
    from experiments.sweep.preflight import check_output_dir

    check_output_dir([f"hydra.sweep.dir={tmp_path / 'a' / 'b'}"], multirun=True)
    assert not (tmp_path / "a").exists()
