"""The user-facing scripts' review fixes: --help describes every option; a run that measured nothing or
whose steps failed never exits 0; no argument starts nothing; outputs name the machine; a summary
never pools runs of different machines or load settings."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from experiments.records.environment import cpu_model
from tests.test_scripts_cli import ROOT, run_in_process, run_script

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
    p = run_in_process(f"scripts/{script}", "--help")
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


def test_docs_commands_exits_1_naming_the_commands_that_failed_and_names_the_machine(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "docs").mkdir(parents=True)
    # the README's second command is skipped (CI runs it); docs/x.md's first fails, its second passes
    (root / "README.md").write_text('```bash\npython3 -c "print(1)"\npython3 -c "print(2)"\n```\n')
    fails = 'python3 -c "raise SystemExit(3)"'
    (root / "docs" / "x.md").write_text(f'```bash\n{fails}\npython3 -c "print(4)"\n```\n')
    out = tmp_path / "report" / "R.md"
    p = run_script("scripts/docs_commands.py", "--root", str(root), "--out", str(out), "--cap-s", "60")
    assert p.returncode == 1, p.stderr[-600:]
    last = p.stderr.strip().splitlines()[-1]
    assert last == "docs_commands.py: 1 of 3 commands run failed: #3 docs/x.md:2 FAILED (exit 3)", last
    report = out.read_text()  # written before the exit: the evidence of what failed
    assert "| FAILED (exit 3) |" in report and f"({cpu_model()})" in report
    assert f"on `{socket.gethostname()}` ({cpu_model()})" in report


def test_device_checks_names_its_parts_once_and_runs_every_part_it_accepts(tmp_path: Path) -> None:
    code = "\n".join(
        line.split("#", 1)[0] for line in (ROOT / "scripts" / "device_checks.sh").read_text().splitlines()
    )
    assert len(re.findall(r"h100_2026_11_26", code)) == 1, "a PART name is written in more than one place"
    p = device_checks(tmp_path, stub_bin(tmp_path, 0), "bogus")
    listed = re.fullmatch(r"PART must be (.+) or (\S+), not bogus", p.stderr.strip())
    assert p.returncode == 2 and listed, p.stderr
    parts = [*listed.group(1).split(", "), listed.group(2)]
    assert {"lease", "train", "h100_2026_11_26", "34", "37", "gpu"} <= set(parts)
    for part in parts:  # each name the check accepts is one the dispatch runs: it gets to a step
        (tmp_path / part).mkdir()
        run = device_checks(tmp_path / part, stub_bin(tmp_path / part, 0), part)
        assert run.returncode == 0 and "step " in run.stdout, (part, run.stdout[-400:], run.stderr[-400:])


def comparison_defaults(script: str) -> dict:
    return {a.dest: (a.default, a.help) for a in importlib.import_module(script).parser()._actions}


def test_the_peer_comparisons_share_one_parser_with_their_options_unchanged(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gated_vs_peers
    import linear_vs_peers

    assert gated_vs_peers.comparison_parser is linear_vs_peers.comparison_parser
    rounds_help = "interleaved rounds; a cell is their median"
    gemm = (0.5, "seconds per round timing the fp32 GEMM rate (the machine's ceiling)")
    shared = {"out": (None, "write the Markdown tables here"), "json": (None, "write every cell here")}
    sizes = [2048, 4096, 8192, 16384]
    parts = ["causal", "performer", "lowrank"]
    assert comparison_defaults("linear_vs_peers") == {
        "help": ("==SUPPRESS==", "show this help message and exit"),
        "sizes": (sizes, "causal part's N"),
        "peer_n": (4096, "N of the performer and low-rank parts"),
        "rounds": (7, rounds_help),
        "features": (256, "random features of both performers (performer part)"),
        "draws": (3, "feature draws the performer deviations average"),
        "fla_retention_max": (8192, "largest N for fla's naive_retention (0: never)"),
        "parts": (parts, "which parts to run"),
        "gemm_min_run_time": gemm,
        **shared,
    }
    assert comparison_defaults("gated_vs_peers") == {
        "help": ("==SUPPRESS==", "show this help message and exit"),
        "sizes": (sizes, "sequence lengths N (multiples of 64 up to --fla-max)"),
        "rounds": (5, rounds_help),
        "fla_max": (8192, "largest N for fla's references"),
        "gemm_min_run_time": gemm,
        **shared,
    }
    assert list(comparison_defaults("linear_vs_peers")) == [
        "help", "sizes", "peer_n", "rounds", "features", "draws", "fla_retention_max", "parts",
        "gemm_min_run_time", "out", "json",
    ]  # fmt: skip


def test_gated_vs_peers_times_the_same_work_on_both_sides(monkeypatch) -> None:
    """Each fla reference's timed call computes the gates (and the delta rules' unit keys) as our
    variant's forward does: it had them made beforehand, outside its timed call."""
    pytest.importorskip("fla")
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gated_vs_peers as gvp
    import torch.nn.functional as fn

    import variants

    calls: list[str] = []
    for name in gvp.OURS:
        cls = variants.get(name)
        gates = cls._gates
        monkeypatch.setattr(cls, "_gates", lambda self, k, g=gates, n=name: calls.append(n) or g(self, k))
    normalize = fn.normalize
    monkeypatch.setattr(fn, "normalize", lambda *a, **kw: calls.append("normalize") or normalize(*a, **kw))
    refs, why = gvp.fla_references()
    assert refs is not None, why
    calls.clear()
    cs, peers = gvp.contenders(64, 64, refs)
    assert set(peers) == set(gvp.OURS) and not calls  # building them computes no gates
    by = {c.name: c for c in cs}
    with torch.no_grad():
        for ours, peer in peers.items():
            did = {}
            for who in (ours, peer):
                calls.clear()
                by[who].run()
                did[who] = sorted(calls)
            assert did[ours] == did[peer] and ours in did[ours], did


def test_gated_vs_peers_without_fla_says_so_in_one_line(tmp_path: Path) -> None:
    hidden = tmp_path / "hide" / "fla"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'fla' (hidden by the test)\")\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "hide"), "OMP_NUM_THREADS": "1"}
    args = ["--sizes", "64", "--rounds", "1", "--gemm-min-run-time", "0.01"]
    p = subprocess.run(
        [sys.executable, "scripts/gated_vs_peers.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-1500:]
    said = [line for line in p.stdout.splitlines() if line.startswith("fla ")]  # the report's aside
    assert said == [
        "fla (flash-linear-attention) not importable (ImportError: No module named 'fla' (hidden by the "
        "test)): its references left out"
    ], said
    assert "| 64 | gated_deltanet |" in p.stdout and "fla naive" not in p.stdout


def test_linear_vs_peers_without_fla_says_so_in_one_line_and_exits_nonzero(tmp_path: Path) -> None:
    """Its causal part needs fla's references: without fla it says so in one line (no traceback), and
    a run of that part alone measured nothing, so it exits non-zero saying that."""
    hidden = tmp_path / "hide" / "fla"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'fla' (hidden by the test)\")\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "hide"), "OMP_NUM_THREADS": "1"}
    args = ["--parts", "causal", "--sizes", "64", "--rounds", "1", "--gemm-min-run-time", "0.01"]
    p = subprocess.run(
        [sys.executable, "scripts/linear_vs_peers.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-1500:]
    said = [line for line in p.stdout.splitlines() if line.startswith("fla ")]
    assert said == [
        "fla (flash-linear-attention) not importable (ImportError: No module named 'fla' (hidden by the "
        "test)): causal part skipped"
    ], said
    assert "nothing was measured" in p.stderr
