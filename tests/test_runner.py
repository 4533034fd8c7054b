"""The runner: config composition and schema, one job's figures and the status of every failure,
isolated jobs (memory, hangs, kills, the fork server); and the helpers the sweep tests share. A
sweep's resume, command line, ending and machine state: ``test_sweep_*.py``."""

from __future__ import annotations

import json
import os
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
from experiments.measure.spec import JobSpec
from experiments.sweep.hydra_nodes import register_hydra_pieces
from experiments.sweep.isolation import context_for, run_isolated
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
