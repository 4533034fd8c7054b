"""The user-facing scripts' review fixes: --help describes every option; a run that measured nothing or
whose steps failed never exits 0; no argument starts nothing; outputs name the machine; a summary
never pools runs of different machines or load settings."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.records.environment import cpu_model
from tests.test_scripts_cli import ROOT, run_script

SCRIPTS = sorted(
    p.name for p in (ROOT / "scripts").glob("*.py") if 'if __name__ == "__main__"' in p.read_text()
)


def options_without_help(text: str) -> list[str]:
    """The option lines of an argparse ``--help`` whose entry has no help text."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith(":") and "options" in line)
    bare = []
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if not re.match(r"^  -", line):
            continue
        if re.search(r"\S\s{2,}\S", line.strip()):  # invocation, two spaces, its help
            continue
        after = lines[i + 1] if i + 1 < len(lines) else ""
        if not (re.match(r"^\s{6,}\S", after) and not re.match(r"^\s*-", after)):  # help on the next line
            bare.append(line.strip())
    return bare


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_describes_every_option_and_a_whole_sentence(script: str) -> None:
    p = run_script(f"scripts/{script}", "--help")
    assert p.returncode == 0, p.stderr[-600:]
    assert not options_without_help(p.stdout), f"{script}: no help for {options_without_help(p.stdout)}"
    # the description: what comes between the usage lines and the options, whole sentences
    body = p.stdout.split("\n\n", 1)[1]
    description = " ".join(body.split("options:")[0].split())
    assert description.endswith((".", ")", "?", ":")), f"{script}: description cut: {description[-80:]!r}"


def test_the_options_parser_finds_a_bare_option() -> None:
    text = "usage: x\n\noptions:\n  -h, --help  show help\n  --runs RUNS\n  --out OUT   where\n"
    assert options_without_help(text) == ["--runs RUNS"]


def stub_bin(tmp_path: Path, python_rc: int) -> Path:
    """A PATH folder whose python3 logs its arguments and exits ``python_rc`` (pip: 0), and whose
    nvidia-smi fails."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "calls.log"
    (bin_ / "python3").write_text(
        f'#!/bin/bash\necho "$*" >> {log}\nif [[ "$1 $2" == "-m pip" ]]; then exit 0; fi\nexit {python_rc}\n'
    )
    (bin_ / "nvidia-smi").write_text("#!/bin/bash\necho 'no GPU (stub)'; exit 9\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    return bin_


def device_checks(tmp_path: Path, bin_: Path, part: str) -> subprocess.CompletedProcess:
    env = {
        "PATH": f"{bin_}:/usr/bin:/bin",
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "PART": part,
    }
    return subprocess.run(
        ["bash", "scripts/device_checks.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_device_checks_refuses_an_unknown_part_before_any_work(tmp_path: Path) -> None:
    bin_ = stub_bin(tmp_path, 0)
    p = device_checks(tmp_path, bin_, "bogus")
    assert p.returncode == 2 and "PART must be" in p.stderr, p.stderr
    assert not (tmp_path / "calls.log").exists() and not (tmp_path / "out").exists()  # no pip, nothing made


def test_device_checks_exits_1_when_a_step_failed_and_each_call_starts_fresh(tmp_path: Path) -> None:
    bin_ = stub_bin(tmp_path, 1)
    first = device_checks(tmp_path, bin_, "37")
    second = device_checks(tmp_path, bin_, "37")
    for p in (first, second):
        assert p.returncode == 1, p.stderr[-600:]
        assert "4 step(s) failed" in p.stderr
    folders = sorted((tmp_path / "work").iterdir())
    assert len(folders) == 2  # one work folder a call: its own summary and records
    for w in folders:
        assert len((w / "summary.txt").read_text().splitlines()) == 4
    dirs = re.findall(r"records_dir=(\S+)", (tmp_path / "calls.log").read_text())
    assert len(dirs) == 8 and all(str(folders[0]) in d for d in dirs[:4])
    assert all(str(folders[1]) in d for d in dirs[4:])


def test_device_checks_exits_0_when_every_step_passed(tmp_path: Path) -> None:
    p = device_checks(tmp_path, stub_bin(tmp_path, 0), "train")
    assert p.returncode == 0, p.stderr[-600:]
    assert "step gpu_train: rc=0" in p.stdout


def test_slurm_cluster_without_an_argument_starts_nothing(tmp_path: Path) -> None:
    # only sed on PATH: were the script to go on, it would find none of its tools
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "sed").symlink_to(shutil.which("sed"))
    env = {"PATH": str(bin_)}
    bash = shutil.which("bash")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [bash, "scripts/slurm_cluster.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True
        )

    for args in ([], ["bogus"], ["start", "extra"]):
        p = run(*args)
        assert p.returncode == 2 and p.stderr.startswith("usage: "), (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and not p.stdout
    for flag in ("--help", "-h"):
        p = run(flag)
        assert p.returncode == 0 and "slurm_cluster.sh start" in p.stdout and "Needs root" in p.stdout


def test_benchmark_skip_is_refused() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "benchmarks/test_regression.py", "--benchmark-skip"]
        + ["-p", "no:cacheprovider", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 4, p.stdout[-600:] + p.stderr[-600:]
    assert "--benchmark-skip would skip" in p.stdout + p.stderr


def test_hf_overhead_exits_1_when_all_of_ours_were_left_out() -> None:
    tiny = ["--lengths", "16", "--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "1"]
    tiny += ["--rounds", "2", "--warmup", "1", "--threads", "1"]
    p = run_script("scripts/hf_overhead.py", *tiny, "--impls", "attnbench_linformer", "eager")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-1500:]
    assert p.stderr.strip().splitlines()[-1].startswith("every attnbench implementation asked for")
    assert p.stdout.startswith(f"# {cpu_model()}, torch ")  # the machine, not 'x86_64'


def test_docs_commands_exits_1_when_every_command_was_skipped(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(ROOT / "README.md", root / "README.md")
    out = tmp_path / "report" / "R.md"
    p = run_script(
        "scripts/docs_commands.py", "--root", str(root), "--out", str(out), "--only", "pytest -q -n"
    )
    assert p.returncode == 1, p.stderr[-600:]
    assert p.stderr.strip().splitlines()[-1].startswith("docs_commands.py: no command ran")
    assert not out.exists()


def run(cpu: str, loaded: bool, host: str | None = "h1") -> dict:
    r = {"started": "2026-11-25T10:00:00+00:00", "loaded": loaded, "load_avg": 0.1, "cpu": cpu}
    r.update(torch="2.13.0+cpu", figures={"pattern/sparse_vs_dense_sdpa": 0.2})
    return {**r, "host": host} if host else r


def test_gate_noise_refuses_to_pool_machines_or_load_settings(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from gate_noise import summarize

    with pytest.raises(ValueError, match=r"CPUs AMD EPYC, Xeon; 'loaded' settings False, True"):
        summarize([run("Xeon", False), run("AMD EPYC", True)], "t")
    with pytest.raises(ValueError, match="hosts h1, h2"):
        summarize([run("Xeon", False), run("Xeon", False, "h2")], "t")
    # runs recorded before the host was kept pool with one host's runs
    text = summarize([run("Xeon", False, None), {**run("Xeon", False), "commit": "abc+dirty"}], "t")
    assert "host h1 (Xeon)" in text and "commit abc+dirty" in text


def test_gate_noise_refuses_a_folder_of_another_machine_before_measuring(tmp_path: Path) -> None:
    (tmp_path / "runs.jsonl").write_text(json.dumps(run("Some Other CPU", False, "elsewhere")) + "\n")
    p = run_script("scripts/gate_noise.py", "--runs", "1", "--out", str(tmp_path))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-1500:]
    assert "holds runs of another machine" in p.stderr and "hosts " in p.stderr
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 1 and not p.stdout


def test_ci_stress_marks_a_dirty_working_tree(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from ci_stress import git_commit

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run([*git, "init", "-q"], check=True, env=env)
    (tmp_path / "f").write_text("a")
    subprocess.run([*git, "add", "f"], check=True, env=env)
    subprocess.run([*git, "commit", "-qm", "x"], check=True, env=env)
    sha = git_commit(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{7,}", sha)
    (tmp_path / "f").write_text("b")
    assert git_commit(tmp_path) == sha + "+dirty"


def test_pattern_vs_flex_names_the_cpu(monkeypatch, capsys, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import pattern_vs_flex as pvf

    out = tmp_path / "cells.json"
    argv = ["pattern_vs_flex.py", "--lengths", "128", "--rounds", "1", "--contenders", "local_window"]
    monkeypatch.setattr(sys, "argv", [*argv, "--threads", "1", "--json", str(out)])
    pvf.main()
    cells = json.loads(out.read_text())
    assert cells["device_name"] == cpu_model() and cells["threads"] == 1 and cells["torch"]
    assert capsys.readouterr().out.startswith(f"cpu ({cpu_model()}, 1 threads), torch ")
