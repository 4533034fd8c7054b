"""A sweep's records and resume: what a sweep survives, which records it reuses and which it measures
again, and what a record says about the code and the machine that made it."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import variants
from experiments.measure.kernel import measure
from experiments.records.environment import variant_code_files, variant_code_version
from experiments.records.records import find_existing, read_records, write_record

from .helpers import sweep_overrides
from .test_runner import ROOT, SMALL, job_spec, run_sweep


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


def test_a_variant_s_code_version_covers_the_modules_and_c_sources_it_uses(tmp_path, monkeypatch):
    """The hash read the files of the class and its bases only: a change in variants/flex_kernel.py
    (flex, local_window and sparse run it) left their versions as they were, so a comparison did not
    name them. The modules a variant's modules use, and C sources beside them, are hashed too."""
    import importlib

    names = {
        n: {p.name for p in variant_code_files(variants.get(n))} for n in ("flex", "local_window", "naive")
    }
    assert {"flex.py", "flex_kernel.py", "base.py"} <= names["flex"]
    assert {"flex_kernel.py", "sparse_kernel.py", "sparse_kernel.c"} <= names["local_window"]
    assert "flex_kernel.py" not in names["naive"] and "naive.py" in names["naive"]
    # a plugin package: its variant's module uses a helper module, which has a C source beside it
    pkg = tmp_path / "myplug"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helper.py").write_text("def scale(x):\n    return x\n")
    (pkg / "helper.c").write_text("int f(void) { return 0; }\n")
    (pkg / "attn.py").write_text(
        "from variants.naive import NaiveAttention\nfrom .helper import scale\n"
        "class Mine(NaiveAttention):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = importlib.import_module("myplug.attn").Mine
    first = variant_code_version(mine)
    (pkg / "helper.c").write_text("int f(void) { return 1; }\n")
    second = variant_code_version(mine)
    (pkg / "helper.py").write_text("def scale(x):\n    return 2 * x\n")
    assert len({first, second, variant_code_version(mine)}) == 3


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
