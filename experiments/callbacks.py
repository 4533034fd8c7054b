"""Hydra callbacks: a progress bar over the sweep and the report at its end.

Exit status of a sweep: 1 when any job ended ``error`` (after every record and the report are
written), else 0. ``unsupported``, ``unavailable``, ``oom``, ``timeout``, ``killed`` and ``nan`` are
results about the variant or the machine, recorded as data, not failures of the sweep.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def manifest_entries(sweep_dir: Path) -> list[dict[str, Any]]:
    """The lines of a sweep's manifest: ``{"config_hash", "record", "status"}`` per job (a skipped
    job has status ``skipped`` and points at its older record)."""
    path = sweep_dir / "manifest.jsonl"
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
                group = Path(__file__).resolve().parent.parent / "conf" / o.key_or_group
                names = {p.stem for p in group.glob("*.yaml")}
                if o.key_or_group == "variant":
                    from .preflight import known_variants

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
    """Progress over a multirun (terminal only) and, at its end, the report of its records."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # launchers pickle the callbacks into their workers: a live bar cannot go with them
        return {**self.__dict__, "bar": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.utils import to_absolute_path
        from tqdm import tqdm

        from .records_lock import RecordsDirError, prepare

        try:  # before the first job: nothing measured may be lost to an unusable folder
            prepare(Path(to_absolute_path(config.records_dir)), Path(config.hydra.sweep.dir))
        except RecordsDirError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

        # tqdm draws only on a terminal: no bar in logs or CI
        self.bar = tqdm(total=count_jobs(config), desc="sweep", unit="job", disable=not sys.stderr.isatty())

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
        sweep_dir = Path(config.hydra.sweep.dir)
        entries = manifest_entries(sweep_dir)
        records = [e["record"] for e in entries if e["record"] is not None]
        print(f"\nsweep finished: {len(records)} job(s); records listed in {sweep_dir / 'manifest.jsonl'}")
        if config.get("report", True) and records:
            from .report import report_paths

            report_paths(records, out_dir=sweep_dir / "report")
        errors = sum(e.get("status") == "error" for e in entries)
        refused = sum(e.get("status") == "invalid_config" for e in entries)
        if errors or refused:
            # after every record and the report are written: a sweep with a broken job fails
            why = [f"{errors} job(s) ended 'error' (see the status table)"] if errors else []
            why += [f"{refused} job(s) had an invalid config (see the error lines above)"] if refused else []
            print(f"{'; '.join(why)}: exit code 1", file=sys.stderr)
            raise SystemExit(1)
