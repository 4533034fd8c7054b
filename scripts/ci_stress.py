"""Run CI's test command N times, on a busy machine or a quiet one, and record how many runs passed.

With ``--fresh-clone`` each run is CI's whole run: a clone of this repository's ``HEAD`` (what is
committed) into a temporary folder, and ``bash .ci/run`` there (a new virtual environment, the
installs, the README's test command). Without it, the command is the one ``.ci/run`` runs without its
setup steps (venv, ``pip install``), in the environment this script runs in, which must have the
project installed with ``.[dev]``. By default (the default) each run has beside it a sweep of
this suite and an unrelated CPU hog (:mod:`busy_machine`), started before the run and stopped after
it; ``--quiet`` runs with nothing beside it.

Each run appends one JSON line to ``--out``/runs.jsonl (start, seconds, exit code, passed, the failed
tests, the mean 1-minute load average, the load sweep's finished jobs) and keeps its output in
``--out``/logs/. At the end it prints how many runs passed.

    python scripts/ci_stress.py --runs 5 --fresh-clone   # loaded, as CI runs it
    python scripts/ci_stress.py --runs 1 --quiet
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from arg_types import output_dir, positive_int
from busy_machine import ROOT, busy_machine

from experiments.records.environment import cpu_model

SETUP = re.compile(r"^(python -m venv|\. |source |pip install)")


def test_command(ci_script: Path = ROOT / ".ci" / "run") -> str:
    """The test part of ``.ci/run``'s last command: its ``&&``-joined steps without the setup ones."""
    line = [s for s in ci_script.read_text().splitlines() if s.strip() and not s.startswith("#")][-1]
    steps = [s.strip() for s in line.split("&&")]
    kept = [s for s in steps if not SETUP.match(s)]
    if not kept or not any("pytest" in s for s in kept):
        raise SystemExit(f"error: found no pytest step in the last command of {ci_script}: {line!r}")
    return " && ".join(kept)


def git_commit(cwd: Path = ROOT) -> str:
    """``HEAD``'s short hash in ``cwd``, with ``+dirty`` when tracked files differ from it (what ran was the
    working tree, not the commit); ``unknown`` without git."""
    git = ["git", "-C", str(cwd)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    )
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _failed_tests(output: str) -> list[str]:
    """Test ids of pytest's ``FAILED``/``ERROR`` summary lines."""
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)


def _sample_load(samples: list[float], stop: threading.Event) -> None:
    while not stop.wait(10):
        samples.append(os.getloadavg()[0])


def run_once(command: str, log: Path, loaded: bool, fresh_clone: bool = False) -> dict:
    """One run of ``command`` (bash, in the repository root, this interpreter's folder first on PATH),
    or with ``fresh_clone`` of ``bash .ci/run`` in a new clone of ``HEAD`` (removed after)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    cwd, scratch = ROOT, None
    if fresh_clone:
        scratch = tempfile.mkdtemp(prefix="attnbench-ci-")
        cwd = Path(scratch) / "repo"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(cwd)], check=True)
        # .ci/run makes its own environment: none of this one's on the way
        here = str(Path(sys.executable).parent)
        path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != here)
        env = {**{k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}, "PATH": path}
        command = "bash .ci/run"
    commit = git_commit(cwd)  # a fresh clone is HEAD; this checkout may be dirty
    samples: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(samples, stop), daemon=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    ctx = busy_machine() if loaded else contextlib.nullcontext()
    with ctx as load:
        sampler.start()
        with open(log, "w") as f:
            p = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        stop.set()
        sweep_jobs = load.sweep_jobs_done() if load is not None else None
    if scratch is not None:
        subprocess.run(["rm", "-rf", scratch], check=False)
    output = log.read_text(errors="replace")
    return {
        "started": started,
        "seconds": round(time.perf_counter() - t0),
        "loaded": loaded,
        "command": command,
        "commit": commit,  # what ran: the clone's HEAD, or this checkout (+dirty: its working tree)
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "exit_code": p.returncode,
        "passed": p.returncode == 0,
        "failed": _failed_tests(output),
        "summary": [ln for ln in output.splitlines() if re.match(r"\d+ (passed|failed)", ln.strip("= "))],
        "load_avg_mean": round(sum(samples) / len(samples), 2) if samples else None,
        "load_sweep_jobs": sweep_jobs,
        "log": str(log.relative_to(ROOT)) if log.is_relative_to(ROOT) else str(log),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--runs", type=positive_int, default=5, help="how many runs of CI's test command")
    ap.add_argument("--quiet", action="store_true", help="nothing beside the runs")
    ap.add_argument("--fresh-clone", action="store_true", help="each run: .ci/run in a new clone of HEAD")
    ap.add_argument(
        "--out",
        type=output_dir,
        default=ROOT / "results" / "cpu" / "ci_stress",
        help="folder: runs.jsonl is appended to, logs/ keeps each run's output",
    )
    args = ap.parse_args()
    command = "bash .ci/run (fresh clone)" if args.fresh_clone else test_command()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    kind = "quiet" if args.quiet else "loaded"
    print(f"{args.runs} {kind} run(s) of: {command}; {socket.gethostname()}, {cpu_model()}", flush=True)
    passed = 0
    for i in range(args.runs):
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        log = args.out / "logs" / f"{stamp}-{kind}.log"
        rec = run_once(command, log, loaded=not args.quiet, fresh_clone=args.fresh_clone)
        passed += rec["passed"]
        with open(args.out / "runs.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        verdict = "passed" if rec["passed"] else f"FAILED ({', '.join(rec['failed']) or 'see log'})"
        print(f"run {i + 1}/{args.runs} ({kind}): {verdict} in {rec['seconds']} s, "
              f"load average {rec['load_avg_mean']}; {rec['log']}", flush=True)  # fmt: skip
    print(f"{passed} of {args.runs} {kind} run(s) passed", flush=True)
    sys.exit(0 if passed == args.runs else 1)


if __name__ == "__main__":
    main()
