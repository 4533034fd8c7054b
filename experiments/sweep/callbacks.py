"""Hydra callbacks: a progress bar over the sweep and the report at its end.

Exit status of a sweep: 1 when any job ended ``error``, had an invalid config, or computed a wrong
result (figures ``valid: false``: its output failed the check against the float64 oracle, whether
measured now or reused), when the sweep launched no job at all (an empty ``glob(...)``), when no job
measured anything (every one ``unsupported``, ``unavailable``, ...), and when the ``objective`` it
was asked to return is a figure of none of its records; else 0. Exit 1 comes after every record and
the report are written. ``unsupported``, ``unavailable``, ``oom``, ``timeout``, ``killed`` and
``nan`` are results about the variant or the machine, recorded as data, not failures of the sweep.

The last line before the exit code's says how many jobs were measured and how many were reused from
earlier records (``resume``), and how to measure those again.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import shutil
import signal
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ..measure.kinds import rules
from ..measure.spec import kind_of
from ..records.records import MANIFEST


def manifest_entries(sweep_dir: Path) -> list[dict[str, Any]]:
    """The lines of a sweep's manifest: ``{"config_hash", "record", "status"}`` per job (a skipped
    job has status ``skipped`` and points at its older record)."""
    path = sweep_dir / MANIFEST
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
            entry["record"] = None if entry["record"] is None else Path(entry["record"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        out.append(entry)
    return out


def manifest_records(sweep_dir: Path) -> list[Path]:
    """Record paths listed in a sweep's manifest (skipped jobs point at their older record; a job
    whose config was refused has no record)."""
    return [e["record"] for e in manifest_entries(sweep_dir) if e["record"] is not None]


def count_jobs(config: DictConfig) -> int | None:
    """Number of jobs the basic sweeper will launch, from the sweep overrides; None if unknown."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    try:
        params = config.hydra.sweeper.get("params") or {}
        overrides = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
        counts: dict[str, int] = {}
        for o in OverridesParser.create().parse_overrides(overrides):
            v = o.value()
            if isinstance(v, Glob):  # only config groups take glob(): count the group's options
                from .preflight import CONF, known_variants

                names = {p.stem for p in (CONF / o.key_or_group).glob("*.yaml")}
                if o.key_or_group == "variant":
                    names |= set(known_variants())  # plugins have generated config nodes
                counts[o.key_or_group] = len(v.filter(sorted(names)))
            elif o.is_sweep_override():
                counts[o.key_or_group] = len(list(o.sweep_string_iterator()))
            else:
                counts[o.key_or_group] = 1  # a plain value on the command line replaces a sweep
    except Exception:  # the bar is a convenience: never fail a sweep over it
        return None
    total = 1
    for n in counts.values():
        total *= n
    return total


class SweepCallback(Callback):
    """Before a multirun: check and lock the records folder, follow the manifest (progress and the
    summary lines of jobs run elsewhere). After it, or when interrupted: the report of its records,
    and exit status 1 if a job ended ``error``."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.follower: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # launchers pickle the callbacks into their workers: a live bar or thread cannot go with them
        return {**self.__dict__, "bar": None, "follower": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.utils import to_absolute_path
        from tqdm import tqdm

        from ..records.records_lock import RecordsDirError, prepare
        from .progress import ManifestFollower

        try:  # before the first job: nothing measured may be lost to an unusable folder
            prepare(Path(to_absolute_path(config.records_dir)), Path(config.hydra.sweep.dir))
        except RecordsDirError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        if earlier := set_aside_earlier_sweep(Path(config.hydra.sweep.dir)):
            print(
                f"note: hydra.sweep.dir held an earlier sweep; its manifest and ceilings moved to {earlier}"
            )
        warn_parallel_timing(config)
        # tqdm draws only on a terminal: no bar in logs or CI
        self.bar = tqdm(total=count_jobs(config), desc="sweep", unit="job", disable=not sys.stderr.isatty())
        self.follower = ManifestFollower(Path(config.hydra.sweep.dir), self.bar).start()
        if threading.current_thread() is threading.main_thread():
            handler = functools.partial(self._interrupted, config)
            signal.signal(signal.SIGINT, handler)
            signal.signal(signal.SIGTERM, handler)

    def _interrupted(self, config: DictConfig, signum: int, frame: Any) -> None:
        """Ctrl-C or SIGTERM of the submitting process: stop every job, report what finished."""
        from .progress import stop_jobs

        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends at once
        launcher = config.hydra.launcher
        slurm_name = launcher.get("name") if "Slurm" in str(launcher.get("_target_", "")) else None
        stopped = stop_jobs(slurm_name)
        print(
            f"\ninterrupted by {signal.Signals(signum).name}: stopped {stopped} job process(es)"
            + (f", cancelled Slurm jobs named {slurm_name}" if slurm_name else ""),
            file=sys.stderr,
            flush=True,
        )
        try:
            self._finish(config, interrupted=True)
        except SystemExit:
            pass
        os._exit(128 + signum)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish(config)

    def _finish(self, config: DictConfig, interrupted: bool = False) -> None:
        """Report the sweep's records, say what it measured in its last line and exit 1 when it
        failed; ``interrupted``: stopped by a signal (whose exit status the caller gives), so a sweep
        with no finished job is not said to have matched nothing."""
        if self.follower is not None:
            self.follower.stop()
        if self.bar is not None:
            self.bar.close()
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            entries = manifest_entries(sweep_dir)
        except OSError as exc:  # the bookkeeping is lost, not the records: say so, and count it below
            print(f"warning: could not read the sweep's manifest: {exc}", file=sys.stderr, flush=True)
            entries = []
        unlisted = 0 if interrupted else max(0, started_jobs(sweep_dir) - len(entries))
        records = [e["record"] for e in entries if e["record"] is not None]
        if config.get("report", True) and records:
            from ..report.report import report_paths

            report_paths(records, out_dir=sweep_dir / "report")
        # nothing launched, or every job refused: the error lines say why, and no empty folder stays
        unmeasured = not (records or unlisted) and all(e.get("status") == "invalid_config" for e in entries)
        last = finished_line(entries)
        if unlisted:  # an append that failed (its warning is above) or a job that died before its record
            last += f"; {unlisted} more job(s) ran that the manifest does not list (see the warnings above)"
        if interrupted:
            last = last.replace("sweep finished", "sweep interrupted", 1)
        if unmeasured and remove_unmeasured_sweep(sweep_dir):
            if entries or interrupted:
                print(f"\n{last}; nothing measured, sweep folder removed", flush=True)
        else:
            print(f"\n{last}; records listed in {sweep_dir / MANIFEST}", flush=True)
        from hydra.utils import to_absolute_path

        junk = unreadable_records(Path(to_absolute_path(config.records_dir)))
        if junk:  # a file no report reads: say so where the sweep ends, not only when a report loads it
            more = f" (and {len(junk) - 3} more)" if len(junk) > 3 else ""
            print(
                f"warning: records_dir holds {len(junk)} unreadable file(s), left out of every report: "
                + ", ".join(str(p) for p in junk[:3])
                + more,
                file=sys.stderr,
                flush=True,
            )
        globs = [o for o in config.hydra.overrides.task if "glob(" in o]
        why = failures(entries, empty=" or ".join(f"'{g}'" for g in globs) or None)
        if unlisted and not entries:  # jobs ran: not a sweep list that matched nothing
            why = [
                f"the sweep's manifest lists none of the {unlisted} job(s) that ran, so nothing says what "
                f"they measured; their records are in {config.records_dir}"
            ]
        why += objective_missing(entries, config.get("objective"))
        if interrupted and not entries:
            why = []  # stopped before a job finished: not an empty sweep list
        if why:  # after every record and the report are written: a sweep with a broken job fails
            print(f"{'; '.join(why)}: exit code 1", file=sys.stderr, flush=True)
            raise SystemExit(1)


#: what a sweep leaves in its folder that the next sweep there would take as its own: the list of its
#: jobs (counted in the last line and the exit code, reported) and the ceilings and canary it measured
EARLIER_SWEEP = (MANIFEST, "roofline-*.json", "canary-cpu-*.json", "report")


def set_aside_earlier_sweep(sweep_dir: Path) -> Path | None:
    """Move what an earlier sweep into the same ``sweep_dir`` (a fixed ``hydra.sweep.dir``) left
    there (:data:`EARLIER_SWEEP`) into ``sweep_dir/earlier-<n>``, so that this sweep counts, reports and
    compares with its own; the folder it moved them to, or None when there was no earlier sweep."""
    if not (sweep_dir / MANIFEST).exists():
        return None
    n = 1
    while (sweep_dir / f"earlier-{n}").exists():
        n += 1
    dest = sweep_dir / f"earlier-{n}"
    dest.mkdir()
    for pattern in EARLIER_SWEEP:
        for path in sweep_dir.glob(pattern):
            path.rename(dest / path.name)
    return dest


def started_jobs(sweep_dir: Path) -> int:
    """How many jobs Hydra started in ``sweep_dir``: its numbered job folders."""
    if not sweep_dir.is_dir():
        return 0
    return sum(p.name.isdigit() and p.is_dir() for p in sweep_dir.iterdir())


def remove_unmeasured_sweep(sweep_dir: Path) -> bool:
    """Remove a sweep folder that holds only what Hydra and the sweep wrote for jobs that measured
    nothing (``multirun.yaml``, the manifest, per-job ``run.log`` and ``.hydra/``); anything else in
    it (a folder the user named, with files of their own) keeps it. True when it was removed."""

    def ours(p: Path) -> bool:
        if p.is_dir():
            return p.name.isdigit() and {c.name for c in p.iterdir()} <= {"run.log", ".hydra"}
        return p.name in ("multirun.yaml", MANIFEST)

    if not sweep_dir.is_dir() or not all(ours(p) for p in sweep_dir.iterdir()):
        return False
    shutil.rmtree(sweep_dir, ignore_errors=True)
    return not sweep_dir.exists()


def unreadable_records(records_dir: Path) -> list[Path]:
    """The ``*.json`` files directly in ``records_dir`` that are not readable records (cut short,
    not JSON, not an object)."""
    bad = []
    for path in sorted(records_dir.glob("*.json")) if records_dir.is_dir() else []:
        try:
            ok = isinstance(json.loads(path.read_text()), dict)
        except (OSError, ValueError):
            ok = False
        if not ok:
            bad.append(path)
    return bad


def finished_line(entries: list[dict[str, Any]]) -> str:
    """``sweep finished: 5 job(s): 2 measured, 1 unsupported (...), 2 reused ...``: what the sweep did,
    from its manifest; "measured" counts the jobs that ended ``ok``."""
    records = [e for e in entries if e["record"] is not None]
    reused = [e for e in records if e.get("status") == "skipped"]
    ok = sum(e.get("status") == "ok" for e in records)
    line = f"sweep finished: {len(records)} job(s): {ok} measured"
    other = Counter(e["status"] for e in records if e.get("status") not in ("ok", "skipped"))
    if other:  # a job that measured nothing says so here, not only in a table further up
        line += ", " + ", ".join(f"{n} {s}" for s, n in sorted(other.items())) + " (see the status table)"
    if reused:
        # what the reused records hold (older manifests do not say: taken as ok), so that an
        # unsupported job found again is not counted among the results
        kinds = Counter(e.get("reused") or "ok" for e in reused)
        held = (
            ""
            if set(kinds) == {"ok"}
            else " (" + ", ".join(f"{n} {s}" for s, n in sorted(kinds.items())) + ")"
        )
        line += (
            f", {len(reused)} reused from earlier records in records_dir{held} (same config, code and "
            "machine; resume=false measures them again)"
        )
    return line


def failures(entries: list[dict[str, Any]], empty: str | None = None) -> list[str]:
    """Why the sweep fails ([] when it does not): jobs that ended ``error``, had an invalid config or
    computed a wrong result, no job at all (``empty``: the sweep overrides that may have matched
    nothing), or no job that measured anything (every one ``unsupported``, ``unavailable``, ``oom``, ...,
    measured now or reused: a findings-only sweep is data, but a run that measured nothing must not
    pass)."""
    if not entries:
        return [f"the sweep launched no job: {empty or 'a sweep list'} matched nothing"]
    count = {
        "error": sum(e.get("status") == "error" for e in entries),
        "refused": sum(e.get("status") == "invalid_config" for e in entries),
        "invalid": sum(bool(e.get("invalid")) for e in entries),
    }
    why = {
        "error": "job(s) ended 'error' (see the status table)",
        "refused": "job(s) had an invalid config (see the error lines above)",
        "invalid": "job(s) computed a wrong result: INVALID, their output failed the check against the "
        "float64 oracle",
    }
    out = [f"{n} {why[k]}" for k, n in count.items() if n]
    # a reused record's status is in its entry (older manifests: unknown, taken as measured)
    measured = [
        e
        for e in entries
        if e.get("status") == "ok" or (e.get("status") == "skipped" and e.get("reused", "ok") == "ok")
    ]
    if not measured and not out:  # (otherwise the lines above say what went wrong)
        ended = Counter(e.get("reused") or e.get("status") for e in entries)
        out.append(
            "no job measured anything ("
            + ", ".join(f"{n} {s}" for s, n in sorted(ended.items()))
            + "; the status table says why)"
        )
    return out


def objective_missing(entries: list[dict[str, Any]], figure: str | None) -> list[str]:
    """``["objective=<figure> is a figure of none of the N measured records ..."]`` when the sweep was
    asked to return a figure (for an optimising sweeper) that no ``ok`` record has: a misspelt name
    made every trial NaN. ``[]`` when it was not asked, or nothing was measured to tell."""
    if not figure:
        return []
    figures = []
    for e in entries:
        if e.get("record") and (e.get("status") == "ok" or e.get("reused") == "ok"):
            try:
                figures.append(json.loads(Path(e["record"]).read_text()).get("figures") or {})
            except (OSError, json.JSONDecodeError):
                continue
    if not figures or any(figure in f for f in figures):
        return []
    names = sorted({k for f in figures for k, v in f.items() if isinstance(v, int | float)})
    close = difflib.get_close_matches(figure, names, n=3)
    hint = f"did you mean {' or '.join(close)}?" if close else f"their figures: {', '.join(names)}"
    return [
        f"objective={figure} is a figure of none of the {len(figures)} measured record(s), so every job "
        f"returned NaN; {hint}"
    ]


def warn_parallel_timing(config: DictConfig) -> None:
    """One warning line when a launcher will time several jobs at once on one machine."""
    launcher = config.hydra.launcher
    target = str(launcher.get("_target_", ""))
    if not rules(kind_of(config)).timed:
        return  # training for accuracy: parallel jobs are fine
    parallel = None
    if "Joblib" in target and launcher.get("n_jobs", 1) not in (1, None):
        parallel = f"hydra.launcher.n_jobs={launcher.get('n_jobs')}"
    elif "LocalLauncher" in target and (count_jobs(config) or 2) > 1:
        parallel = "hydra/launcher=submitit_local (it starts every job at once)"
    if parallel:
        print(
            f"warning: {parallel} times several jobs at once on this machine: they slow each other down. "
            "Records count the jobs measuring beside each one (concurrent_jobs) and tables mark their "
            "times; for clean timings run them one at a time (the default launcher, or hydra/launcher=slurm)",
            file=sys.stderr,
            flush=True,
        )
