"""A busy machine on demand: a sweep of this suite and an unrelated CPU hog, running until stopped.

What the CI stress run (``scripts/ci_stress.py``) and the gate-noise measurement
(``scripts/gate_noise.py``) put beside the work they time: the load a shared 2-core CI runner sees when
another sweep of this suite measures on the same host and something unrelated keeps a core busy.

- **the sweep**: ``run.py -m experiment=quick`` (every variant, N = 256 and 1024, forward and
  forward+backward, one thread per job) into a scratch folder, with ``resume=false``, no report and
  ``settle_s=0`` (it never waits for the machine to go quiet), started again each time it ends. Its
  jobs leave their markers in the host's shared folder of measuring jobs
  (:mod:`experiments.sweep.concurrency`), as any other sweep on the host would.
- **the hog**: ``hogs`` processes spinning in a Python loop (one core each).

Everything runs in its own process group, killed as a whole on exit (Ctrl-C included).

    python scripts/busy_machine.py            # load the machine until Ctrl-C
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from arg_types import non_negative_int

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Load:
    """The processes loading the machine and where the sweep writes."""

    scratch: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def sweep_jobs_done(self) -> int:
        """Jobs the background sweep has finished so far (lines of its manifests)."""
        return sum(len(p.read_text().splitlines()) for p in self.scratch.glob("sweep-*/manifest.jsonl"))


def _sweep_loop(scratch: Path) -> list[str]:
    """A shell loop re-running the quick sweep into a fresh sweep folder each time it ends."""
    run = (
        f"{sys.executable} run.py -m experiment=quick resume=false report=false settle_s=0 "
        f"records_dir={scratch}/records hydra.sweep.dir={scratch}/sweep-$i"
    )
    return ["bash", "-c", f"i=0; while :; do i=$((i+1)); {run} >>{scratch}/sweep.log 2>&1; sleep 1; done"]


def _hog() -> list[str]:
    return [sys.executable, "-c", "while True: pass"]


@contextlib.contextmanager
def busy_machine(sweep: bool = True, hogs: int = 1, scratch: Path | None = None) -> Iterator[Load]:
    """Start the load, yield it, and kill every process of it on exit."""
    own_scratch = scratch is None
    scratch = Path(tempfile.mkdtemp(prefix="attnbench-load-")) if scratch is None else scratch
    scratch.mkdir(parents=True, exist_ok=True)
    load = Load(scratch)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmds = ([_sweep_loop(scratch)] if sweep else []) + [_hog() for _ in range(hogs)]
    # the load runs in sessions of its own, which a signal to this process's group does not reach:
    # SIGTERM (timeout, kill) must end this process through the cleanup below, as Ctrl-C does
    before = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        for cmd in cmds:
            # a session of its own: the whole group (bash, run.py, its job children) is killed together
            load.procs.append(
                subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
            )
        yield load
    finally:
        for p in load.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if own_scratch:
            subprocess.run(["rm", "-rf", str(scratch)], check=False)
        signal.signal(signal.SIGTERM, before)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--no-sweep", action="store_true", help="only the hog processes")
    ap.add_argument("--hogs", type=non_negative_int, default=1, help="spinning processes")
    args = ap.parse_args()
    if args.no_sweep and not args.hogs:  # else it would idle, loading nothing, until Ctrl-C
        ap.error("--no-sweep with --hogs 0 loads nothing")
    with busy_machine(sweep=not args.no_sweep, hogs=args.hogs) as load:
        print(f"loading the machine (scratch {load.scratch}); Ctrl-C stops it", flush=True)
        try:
            while True:
                time.sleep(60)
                print(f"{time.strftime('%H:%M:%S')} load sweep jobs: {load.sweep_jobs_done()}", flush=True)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
