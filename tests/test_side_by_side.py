"""Two versions of the code measured side by side (``python -m experiments.sweep.side_by_side``): the
rounds alternate ABBA, each side's sweep runs its own commit's code, and the report compares them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from experiments.sweep import side_by_side as sbs

ROOT = sbs.ROOT


def test_rounds_alternate_so_a_drift_falls_on_both_sides():
    assert sbs.order(3) == [
        (0, "baseline"), (0, "this"), (1, "this"), (1, "baseline"), (2, "baseline"), (2, "this"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["variant=sdpa", "round=1"], "round is set by side_by_side for each sweep; leave it out"),
        (["+records_dir=/tmp/x"], "records_dir is set by side_by_side for each sweep; leave it out"),
        (["resume=true"], "resume is set by side_by_side"),
        (["seq_len"], "'seq_len' is not an override (key=value"),
    ],
)
def test_a_setting_the_command_makes_itself_is_refused_in_one_line(overrides, message, capsys):
    assert sbs.main(["HEAD", *overrides]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_baseline_that_is_not_a_commit_is_refused_in_one_line(capsys):
    assert sbs.main(["no-such-branch-xyz", "variant=sdpa"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: 'no-such-branch-xyz' is not a commit of the repository at {ROOT}"
    assert sbs.main(["HEAD", "variant=sdpa", "--rounds", "0"]) == 1
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err


# what a commit from before side_by_side's `round` setting printed, as a baseline (2026-11-29, e32927b^)
OLD_BASELINE = """Could not override 'round'.
To append to your config use +round=0
Key 'round' not in 'BenchConfig'
    full_key: round
    object_type=BenchConfig

Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
"""


def test_a_baseline_older_than_the_settings_it_is_given_is_one_line_and_no_report(
    tmp_path, capsys, monkeypatch
):
    """A baseline from before the `round` setting failed with "exit 1: Set the environment variable
    HYDRA_FULL_ERROR=1 ..." and then a report error over records that were never written. It says why
    in one line, stops at the first round and writes no report."""
    calls = []

    def old_sweep(cmd, cwd, log, env=None):  # the old commit's run.py, as it answered
        calls.append(cmd)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(OLD_BASELINE)
        return 1

    monkeypatch.setattr(sbs, "run_sweep", old_sweep)
    assert sbs.main(["HEAD", "variant=sdpa", "--out", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert len(calls) == 1 and not (tmp_path / "report").exists() and "report:" not in out
    assert err.strip().splitlines() == [
        f"error: baseline {sbs.resolve('HEAD')[:12]}, round 0: exit 1: its config has no setting 'round', "
        "which side_by_side sets for each sweep: the commit predates it and cannot run side by side; pick "
        "a later baseline"
    ]
    assert sbs.failure_reason("x\nerror: seq_len must be > 0\n\n") == "error: seq_len must be > 0"


def test_a_sweep_of_model_jobs_stops_after_its_first_sweep(tmp_path, capsys, monkeypatch):
    """`experiment=llama` (model jobs) ran every round, then the report refused: it compares kernel
    jobs' times. The first sweep's records say their kind, and the command stops there, in one line."""
    calls = []

    model_record = sorted((ROOT / "results/cpu/llama/records").glob("*.json"))[0]

    def model_sweep(cmd, cwd, log, env=None):  # a model job's record: one of the llama store's
        calls.append(cmd)
        records = Path(next(a for a in cmd if a.startswith("records_dir=")).split("=", 1)[1])
        records.mkdir(parents=True)
        shutil.copy(model_record, records)
        return 0

    monkeypatch.setattr(sbs, "run_sweep", model_sweep)
    assert sbs.main(["HEAD", "experiment=llama", "--out", str(tmp_path)]) == 1
    assert len(calls) == 1 and not (tmp_path / "report").exists()
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: the sweep's jobs are model jobs; side_by_side compares kernel jobs' times (the report's "
        "comparison), so it stopped after the first sweep"
    ]
    assert not (tmp_path / "baseline_checkout").exists()


def test_an_out_folder_holding_an_earlier_comparison_is_refused_before_any_sweep(tmp_path, capsys):
    """Records left by an earlier comparison in the same --out were read beside the new ones: the
    report compared both runs' records together (and stale ones failed to pair)."""
    (tmp_path / "this" / "records").mkdir(parents=True)
    (tmp_path / "this" / "records" / "old.json").write_text("{}")
    assert sbs.main(["HEAD", "variant=sdpa", "--out", str(tmp_path)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"error: --out {tmp_path} holds an earlier comparison's records ({tmp_path / 'this' / 'records'}), "
        "which would be compared with this one's: pass another --out or remove it"
    )
    assert not (tmp_path / "baseline_checkout").exists() and not (tmp_path / "baseline").exists()


def _commit_of_head_tree() -> str:
    """A new commit object holding HEAD's tree (no branch, index or working tree touched): a
    baseline whose code is HEAD's but whose hash is its own, so a record's ``git_commit`` says from
    which checkout its code was imported."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    run = subprocess.run(
        ["git", "commit-tree", "HEAD^{tree}", "-p", "HEAD", "-m", "side_by_side test baseline"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return run.stdout.strip()


def _records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def test_each_side_runs_its_own_commit_in_alternating_rounds_and_is_compared(tmp_path, capsys):
    """Two rounds of one small job from a baseline commit and from this checkout: every record says
    which commit's code made it (the baseline's, imported from its worktree, not this checkout's),
    the rounds ran baseline, this, this, baseline, the report compares the two sides, and the
    worktree is gone after."""
    baseline = _commit_of_head_tree()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    overrides = ["variant=sdpa", "seq_len=64", "mode=fwd", "threads=1", "settle_s=0", "retry_unstable=0"]
    code = sbs.main([baseline, *overrides, "roofline=false", "--rounds", "2", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    sides = {side: _records(tmp_path / side / "records") for side in ("baseline", "this")}
    assert {side: sorted(r["config"]["round"] for r in recs) for side, recs in sides.items()} == {
        "baseline": [0, 1],
        "this": [0, 1],
    }
    assert {r["env"]["git_commit"] for r in sides["baseline"]} == {baseline[:12]}
    assert {r["env"]["git_commit"] for r in sides["this"]} == {head.strip()[:12]}
    started = sorted(
        (r["started_at"], side, r["config"]["round"]) for side, recs in sides.items() for r in recs
    )
    assert [(side, r) for _, side, r in started] == [
        ("baseline", 0),
        ("this", 0),
        ("this", 1),
        ("baseline", 1),
    ]
    assert "[1/4] round 0: baseline" in printed and "[4/4] round 1: baseline" in printed
    assert " compared)" in printed  # the summary line (its verdict depends on the machine: not asserted)
    assert "Against the baseline" in (tmp_path / "report" / "tables.md").read_text()
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "baseline_checkout" not in worktrees and not (tmp_path / "baseline_checkout").exists()


def _git_in(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    run = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True)
    return run.stdout.strip()


PLUGIN = (
    "from variants import register\nfrom variants.naive import NaiveAttention\n\n\n"
    "@register('sbsplug_attn')\nclass SbsPlug(NaiveAttention):\n    VERSION = {version!r}\n"
)


def test_two_commits_of_a_plugin_run_side_by_side(tmp_path, monkeypatch, capsys):
    """``--plugin``: the baseline side imports the plugin from a worktree of the given commit of its
    checkout (here a folder inside a larger repository), this side from the checkout; this
    repository's code is the same on both. Each side's
    records carry its own plugin code's hash, and the comparison names the variant whose code changed.
    A plugin not imported from the checkout is refused in one line."""
    top, site = tmp_path / "monorepo", tmp_path / "site"
    repo = top / "plugins" / "sbs"  # the plugin's folder inside a larger repository
    repo.mkdir(parents=True)
    (repo / "sbsplug.py").write_text(PLUGIN.format(version="old"))
    _git_in(top, "init", "-q")
    _git_in(top, "add", ".")
    _git_in(top, "commit", "-qm", "old")
    old = _git_in(top, "rev-parse", "HEAD")
    (repo / "sbsplug.py").write_text(PLUGIN.format(version="new"))  # this side: uncommitted, as it is
    dist = site / "sbsplug-0.1.dist-info"  # what `pip install -e` leaves, less its path hook
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sbsplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[attnbench.variants]\nsbsplug_attn = sbsplug\n")
    assert sbs.main([old, "--plugin", str(repo), "variant=sdpa", "--out", str(tmp_path / "x")]) == 1
    assert capsys.readouterr().err.strip() == (
        f"error: no installed attnbench.variants entry point is imported from {repo}: install the "
        f"plugin from that checkout with `pip install -e {repo}`"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(repo))
    monkeypatch.setenv("PYTHONPATH", str(site))  # the sweeps see the installed metadata, not the module
    overrides = [
        "variant=sbsplug_attn",
        "seq_len=64",
        "mode=fwd",
        "threads=1",
        "settle_s=0",
        "retry_unstable=0",
    ]
    out = tmp_path / "out"
    code = sbs.main(
        [old, "--plugin", str(repo), *overrides, "roofline=false", "--rounds", "1", "--out", str(out)]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:]
    assert f"round 0: baseline {old[:12]} of {top}" in printed
    sides = {side: _records(out / side / "records") for side in ("baseline", "this")}
    codes = {side: {r["env"]["variant_code"] for r in recs} for side, recs in sides.items()}
    assert len(codes["baseline"]) == len(codes["this"]) == 1 and codes["baseline"] != codes["this"]
    this_repo = {side: {r["env"]["git_commit"] for r in recs} for side, recs in sides.items()}
    assert this_repo["baseline"] == this_repo["this"]  # this repository's code on both sides
    assert {r["env"]["variant_package"] for recs in sides.values() for r in recs} == {"sbsplug 0.1"}
    assert "Differences: variant code: sbsplug_attn." in printed
    assert "baseline_checkout" not in _git_in(top, "worktree", "list")
