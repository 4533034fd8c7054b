"""Run CI's test command N times, on a busy machine or a quiet one, and record how many runs passed.

The command is the one ``.ci/run`` runs (the README's test command, word for word) without its setup
steps (venv, ``pip install``): it runs in the environment this script runs in, which must have the
project installed with ``.[dev]``. With ``--load`` (the default) each run has beside it a sweep of
this suite and an unrelated CPU hog (:mod:`busy_machine`), started before the run and stopped after
it; ``--quiet`` runs with nothing beside it.

Each run appends one JSON line to ``--out``/runs.jsonl (start, seconds, exit code, passed, the failed
tests, the mean 1-minute load average, the load sweep's finished jobs) and keeps its output in
``--out``/logs/. At the end it prints how many runs passed.

    python scripts/ci_stress.py --runs 5                 # loaded
    python scripts/ci_stress.py --runs 1 --quiet
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from busy_machine import ROOT, busy_machine

SETUP = re.compile(r"^(python -m venv|\. |source |pip install)")


def test_command(ci_script: Path = ROOT / ".ci" / "run") -> str:
    """The test part of ``.ci/run``'s last command: its ``&&``-joined steps without the setup ones."""
    line = [s for s in ci_script.read_text().splitlines() if s.strip() and not s.startswith("#")][-1]
    steps = [s.strip() for s in line.split("&&")]
    kept = [s for s in steps if not SETUP.match(s)]
    if not kept or not any("pytest" in s for s in kept):
        raise SystemExit(f"error: found no pytest step in the last command of {ci_script}: {line!r}")
    return " && ".join(kept)


def _failed_tests(output: str) -> list[str]:
    """Test ids of pytest's ``FAILED``/``ERROR`` summary lines."""
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)


def _sample_load(samples: list[float], stop: threading.Event) -> None:
    while not stop.wait(10):
        samples.append(os.getloadavg()[0])


def run_once(command: str, log: Path, loaded: bool) -> dict:
    """One run of ``command`` (bash, repository root, this interpreter's folder first on PATH)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    samples: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(samples, stop), daemon=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    ctx = busy_machine() if loaded else contextlib.nullcontext()
    with ctx as load:
        sampler.start()
        with open(log, "w") as f:
            p = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        stop.set()
        sweep_jobs = load.sweep_jobs_done() if load is not None else None
    output = log.read_text(errors="replace")
    return {
        "started": started,
        "seconds": round(time.perf_counter() - t0),
        "loaded": loaded,
        "exit_code": p.returncode,
        "passed": p.returncode == 0,
        "failed": _failed_tests(output),
        "summary": [ln for ln in output.splitlines() if re.match(r"\d+ (passed|failed)", ln.strip("= "))],
        "load_avg_mean": round(sum(samples) / len(samples), 2) if samples else None,
        "load_sweep_jobs": sweep_jobs,
        "log": str(log.relative_to(ROOT)) if log.is_relative_to(ROOT) else str(log),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quiet", action="store_true", help="nothing beside the runs")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "cpu" / "ci_stress")
    args = ap.parse_args()
    command = test_command()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    kind = "quiet" if args.quiet else "loaded"
    print(f"{args.runs} {kind} run(s) of: {command}", flush=True)
    passed = 0
    for i in range(args.runs):
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        rec = run_once(command, args.out / "logs" / f"{stamp}-{kind}.log", loaded=not args.quiet)
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
