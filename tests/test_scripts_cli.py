"""The evidence scripts (scripts/*.py) refuse bad input in their parser: a one-line error naming the
option, exit code 2, before any work; never a traceback from deep inside torch, and never exit 0 for a
run that measured nothing. A refusal runs the script as ``python scripts/X.py`` would, in this process
(:func:`run_in_process`: starting Python and torch again for each took 3-4 s of CI's time); a run that
does work runs in a subprocess, as a user would."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def run_in_process(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python script *args`` run in this process, for a script's refusals and ``--help``, which end in
    its parser: its ``sys.argv``, its folder first on ``sys.path``, the repository as the working
    directory, stdout and stderr captured; the exit code of ``SystemExit``, or 1 and the traceback
    on stderr for any other exception, as Python would. The process's argv, path, directory and torch
    thread count are restored after it."""
    path = ROOT / script
    out, err = io.StringIO(), io.StringIO()
    argv, syspath, cwd, threads = sys.argv, list(sys.path), os.getcwd(), torch.get_num_threads()
    sys.argv, code = [str(path), *args], 0
    sys.path.insert(0, str(path.parent))
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as e:
                if isinstance(e.code, str):  # sys.exit("message"): Python prints it and exits 1
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except Exception:  # noqa: BLE001  (what Python itself would print: the test reads it)
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, sys.path[:] = argv, syspath
        os.chdir(cwd)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess([sys.executable, script, *args], code, out.getvalue(), err.getvalue())


# (arguments, what stderr's last line must name); each has exactly one bad option, the other options
# keep the unfixed scripts' runs short (they ran on and crashed, or measured nothing)
CASES = [
    pytest.param(["scripts/xformers_gate_check.py"], "no CUDA GPU", marks=NO_CUDA, id="xformers-no-cuda"),
    pytest.param(
        ["scripts/pattern_vs_flex.py", "--device", "cuda", "--lengths", "64", "--rounds", "1"],
        "--device cuda",
        marks=NO_CUDA,
        id="pattern-device-cuda",
    ),
    pytest.param(
        ["scripts/pattern_vs_flex.py", "--lengths", "0", "--rounds", "1"], "--lengths", id="pattern-lengths"
    ),
    pytest.param(
        ["scripts/hf_overhead.py", "--lengths", "-1", "--layers", "1", "--hidden", "64", "--heads", "2"],
        "--lengths",
        id="hf-overhead",
    ),
    pytest.param(["scripts/hf_overhead.py", "--impls", "bogus"], "--impls bogus", id="hf-overhead-impl"),
    pytest.param(
        ["scripts/hf_overhead.py", "--impls", "attnbench_nosuch"],
        "no variant 'nosuch'",
        id="hf-overhead-ours",
    ),
    pytest.param(
        ["scripts/hf_overhead.py", "--impls", "attnbench_sdpa"],
        "spell it attnbench_SDPA",
        id="hf-overhead-spelt",
    ),
    pytest.param(["scripts/sinks_cost.py", "--lengths", "0", "--rounds", "1"], "--lengths", id="sinks-cost"),
    pytest.param(["scripts/gate_noise.py", "--runs", "0", "--out", "{tmp}/gn"], "--runs", id="gate-noise"),
    pytest.param(["scripts/ci_stress.py", "--runs", "0", "--out", "{tmp}/cs"], "--runs", id="ci-stress"),
    pytest.param(
        ["scripts/timer_agreement.py", "--n", "0", "--rounds", "1", "--min-run-time", "0.01"],
        "--n",
        id="timer-agreement",
    ),
    pytest.param(
        ["scripts/gated_vs_peers.py", "--sizes", "0", "--rounds", "1", "--gemm-min-run-time", "0.01"],
        "--sizes",
        id="gated-vs-peers",
    ),
    pytest.param(["scripts/linear_vs_peers.py", "--parts", "bogus", "--rounds", "1"], "--parts", id="linear"),
    # fla's chunked references cut N into 64-token chunks (an einops or assert traceback inside fla)
    pytest.param(
        ["scripts/linear_vs_peers.py", "--sizes", "100", "--rounds", "1"], "--sizes 100", id="linear-64"
    ),
    pytest.param(
        ["scripts/gated_vs_peers.py", "--sizes", "100", "--rounds", "1"], "--sizes 100", id="gated-64"
    ),
    # --no-sweep: the unfixed script starts nothing (no orphaned sweep), it idles until the timeout
    pytest.param(["scripts/busy_machine.py", "--no-sweep", "--hogs", "-1"], "--hogs", id="busy-machine"),
    pytest.param(
        ["scripts/docs_commands.py", "--root", ".", "--out", "{tmp}/d.md", "--cap-s", "0", "--list"],
        "--cap-s",
        id="docs-commands",
    ),
    # an output the script would lose after its whole run: a folder for a file, a file for a folder
    pytest.param(
        ["scripts/docs_commands.py", "--root", ".", "--out", "{tmp}", "--list"], "--out", id="docs-out-folder"
    ),
    pytest.param(["scripts/gate_noise.py", "--runs", "1", "--out", "README.md"], "--out", id="gate-out-file"),
    pytest.param(["scripts/ci_stress.py", "--runs", "1", "--out", "README.md"], "--out", id="stress-file"),
    # more threads than CPUs time threads queueing for cores
    pytest.param(
        ["scripts/pattern_vs_flex.py", "--lengths", "48", "--rounds", "1", "--threads", "100000"],
        "--threads",
        id="pattern-threads",
    ),
    pytest.param(["scripts/sinks_cost.py", "--threads", "100000"], "--threads", id="sinks-threads"),
]


@pytest.mark.parametrize(("args", "names"), CASES)
def test_bad_option_is_a_parser_error(args: list[str], names: str, tmp_path: Path) -> None:
    p = run_in_process(*(a.replace("{tmp}", str(tmp_path)) for a in args))
    last = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    assert p.returncode == 2, f"exit {p.returncode}; stderr ends: {p.stderr[-600:]}"
    assert "error:" in last and names in last, last
    assert "Traceback" not in p.stderr


def test_xformers_gate_check_help_runs_nothing() -> None:
    p = run_in_process("scripts/xformers_gate_check.py", "--help")
    assert p.returncode == 0, p.stderr[-600:]
    assert p.stdout.startswith("usage: xformers_gate_check.py")
    assert "CUDA GPU and xformers" in p.stdout


def test_the_device_checks_help_runs_nothing(tmp_path: Path) -> None:
    """--help was ignored: the script began installing wheels and, on a GPU machine, its 10-minute checks."""
    p = subprocess.run(
        ["bash", "scripts/device_checks.sh", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-600:]
    assert p.stdout.startswith("The GPU checks of the open issues") and "PART=train" in p.stdout
    assert not (tmp_path / "out").exists()  # nothing started


def test_a_contender_that_cannot_run_is_left_out_and_the_others_are_timed(monkeypatch, capsys, tmp_path):
    """On a lent GPU one contender's error (a kernel refused, a library missing) must not end the
    script before the others are timed: it is left out with its reason, and the JSON keeps the rest."""
    import json

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import pattern_vs_flex as pvf

    import variants

    class Broken(variants.get("naive")):
        def _attend(self, *a, **kw):
            raise RuntimeError("NYI: this kernel\nrefuses the shape")

    real = pvf.contenders
    monkeypatch.setattr(pvf, "contenders", lambda *a: {**real(*a), "broken": Broken()})
    out = tmp_path / "cells.json"
    argv = ["pattern_vs_flex.py", "--lengths", "128", "--rounds", "1", "--contenders", "broken,local_window"]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(out)])
    pvf.main()
    printed = capsys.readouterr().out
    assert "left out at N=128: RuntimeError: NYI: this kernel refuses the shape" in printed
    names = {row["name"] for row in json.loads(out.read_text())["rows"]}
    assert names == {"local_window", "sdpa (dense)"}


def test_hf_overhead_leaves_out_what_cannot_run_and_times_the_rest():
    """xFormers' CPU-less operator is left out with its one-line reason, a learned variant gets its own
    weights per layer and is timed; when nothing can run, exit 1 with one line, not a traceback."""
    tiny = [
        "--lengths",
        "8",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
    ]
    p = run_script(
        "scripts/hf_overhead.py", *tiny, "--impls", "sdpa", "attnbench_xformers", "attnbench_additive"
    )
    assert p.returncode == 0, p.stderr[-1500:]
    assert "attnbench_xformers left out: Unsupported: " in p.stdout
    assert "| 8 | attnbench_additive |" in p.stdout and "| 8 | sdpa | " in p.stdout
    assert "| 8 | attnbench_xformers |" not in p.stdout
    p = run_script("scripts/hf_overhead.py", *tiny, "--kv-heads", "1", "--impls", "attnbench_xformers")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-1500:]
    assert p.stderr.strip().splitlines()[-1] == "N=8: no implementation of --impls could run here"


def test_a_comparison_that_measured_nothing_exits_1():
    """Only the performer part, without performer-pytorch: the part is skipped, so nothing was measured
    (it ended in ``min() arg is an empty sequence``)."""
    pytest.importorskip("einops")
    try:
        import performer_pytorch  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("performer-pytorch is installed here: the part would run")
    p = run_script("scripts/linear_vs_peers.py", "--parts", "performer", "--rounds", "1")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-1500:]
    assert "performer-pytorch not importable" in p.stdout
    assert p.stderr.strip().splitlines()[-1].startswith("nothing was measured (--parts performer)")


def test_the_lent_gpu_s_checks_ask_only_for_what_exists(monkeypatch):
    """scripts/device_checks.sh runs on a lent GPU, where a misspelt override or contender costs
    scarce device time: each of its run.py command lines passes the sweep's preflight here, and every
    contender its pattern_vs_flex calls name is one the script builds on CUDA."""
    import re
    import shlex

    from experiments.sweep.hydra_nodes import register_hydra_pieces
    from experiments.sweep.preflight import preflight

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import pattern_vs_flex

    text = (ROOT / "scripts" / "device_checks.sh").read_text()
    register_hydra_pieces()
    runs = re.findall(r"python3 (run\.py [^;]*?)(?: \"\$\{@:2\}\")?;", text)
    assert len(runs) >= 8, runs
    for line in runs:
        argv = shlex.split(line.replace("$R/", "/tmp/device_checks/"))
        try:
            preflight(argv)
        except SystemExit as exc:
            pytest.fail(f"device_checks.sh: `{line}` fails the preflight ({exc.code})")
    asked = re.findall(r'--contenders "([^"]+)"', text)
    known = set(pattern_vs_flex.contenders(128, 64, "cuda"))
    assert asked and {c for names in asked for c in names.split(",")} <= known
