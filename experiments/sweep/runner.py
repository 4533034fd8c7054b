"""One Hydra job: validate, skip if already measured, measure (isolated), write the record."""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

from variants.registry import provider

from ..measure.common import job_threads
from ..measure.kinds import rules
from ..measure.roofline import implausible
from ..measure.spec import JobSpec, kind_of
from ..records.environment import environment, kind_environment, variant_code_version
from ..records.records import (
    MANIFEST,
    SCHEMA_VERSION,
    config_hash,
    find_existing,
    read_json,
    write_json_atomic,
    write_record,
)
from .allocator import set_job_allocator_env
from .allocator import settings as malloc_settings
from .checks import check_job, one_line
from .labels import job_label, summary_line
from .progress import following, say
from .retry import measure_with_retries

log = logging.getLogger("attnbench")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def handle_sigterm() -> None:
    """SIGTERM (``kill``, a scheduler ending the job) stops the sweep as Ctrl-C does: the running job's
    child is killed and nothing half-measured is written. Only the main thread can install it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # the sweep's own handler stays
        signal.signal(signal.SIGTERM, _interrupt)


def _fail(msg: str) -> None:
    """A config error: one line, no traceback; ends a single run with exit code 1, and makes a sweep
    exit 1 at its end (the manifest notes it, and the submitting process's follower prints its line:
    printed here too only where no follower does)."""
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN or not following():
        print(f"error: {msg}", file=sys.stderr, flush=True)
    if hc.mode != RunMode.MULTIRUN:
        raise SystemExit(1)
    _manifest(Path(hc.sweep.dir), None, None, "invalid_config", reason=msg, line=f"error: {msg}")


def objective(record: dict[str, Any] | None, figure: str | None = None) -> float:
    """The number ``run.py`` returns for a job, for sweepers that optimise (Hydra's Optuna sweeper
    minimises or maximises it): ``figure`` of the record's figures, by default the job's time in its
    mode (``fwd_median_s`` or ``fwd_bwd_median_s``; a task's ``test_accuracy``, a pretrained job's
    ``cosine_mean``, a model's ``decode_ms_per_token``). NaN, which the Optuna sweeper records as a
    failed trial, when the job has no such figure: it did not run, failed its check, or the name is
    not one of its figures."""
    if not record or record.get("status") != "ok":
        return float("nan")
    figures = record.get("figures") or {}
    if figures.get("valid") is False:
        return float("nan")
    value = figures.get(figure or headline_figure(record))
    return float(value) if isinstance(value, (int, float)) else float("nan")


def headline_figure(record: dict[str, Any]) -> str:
    """The figure a record of its kind is about (what :func:`objective` returns by default): the job's
    time in its mode for a kernel job, its kind's objective otherwise."""
    cfg = record.get("config") or {}
    return rules(record.get("kind") or kind_of(cfg)).objective or f"{cfg.get('mode', 'fwd')}_median_s"


#: what :attr:`variants.ckernel.CKernel.error` says when a C kernel could not be built or loaded (the
#: compiler failed, timed out, or the kernel cache could not be written), as opposed to a call shape the
#: kernel refuses
_BUILD_FAILED = ("could not be built or loaded", "could not build ")


def kernel_build_failure(description: Any) -> str | None:
    """The note in a record's variant description (an ``impl_note``, ``decode_note``, ... at any depth)
    that says a C kernel could not be built or loaded, so its PyTorch fallback ran; None if none says so."""
    if isinstance(description, dict):
        for key, value in description.items():
            if isinstance(value, str) and key.endswith("_note") and any(m in value for m in _BUILD_FAILED):
                return f"{key}: {value}"
            if isinstance(value, (dict, list)) and (found := kernel_build_failure(value)):
                return found
    elif isinstance(description, list):
        return next((f for v in description if (f := kernel_build_failure(v))), None)
    return None


def not_reusable(record: dict[str, Any]) -> str | None:
    """Why resume must not reuse this record. An ``ok`` record cut short, edited, or from a broken
    writer: its headline figure is missing or not a finite number. Any record measured on a fallback
    because a C kernel could not be built then (a transient cause: a full or unwritable cache, the
    compile timeout on a busy machine): the kernel may build now, and its figures would differ. None
    when it may be reused."""
    if failed := kernel_build_failure(record.get("variant")):
        return f"it ran a fallback because a C kernel could not be built then ({failed})"
    if record.get("status") != "ok":
        return None
    if not isinstance(record.get("config"), dict):
        return f"its config is a {type(record.get('config')).__name__}, not an object"
    try:
        figure = headline_figure(record)
    except ValueError as exc:  # a config that selects two kinds
        return str(exc)
    figures = record.get("figures")
    if figures is not None and not isinstance(figures, dict):
        return f"its figures are a {type(figures).__name__}, not an object"
    value = (figures or {}).get(figure)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"its status is ok but its {figure} is {value!r}, not a number"
    return None


def run_job(dcfg: DictConfig) -> dict[str, Any] | None:
    """Measure the job described by ``dcfg``; returns its record (None if the config is invalid)."""
    handle_sigterm()
    t_job = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        cfg: dict[str, Any] = OmegaConf.to_container(dcfg, resolve=True, enum_to_str=True)
    except Exception as exc:  # e.g. an interpolation that does not resolve
        _fail(f"config does not resolve: {exc}")
        return None
    try:
        conf, cls, name, variant = check_job(cfg)
    except Exception as exc:
        _fail(one_line(exc))
        return None
    label = job_label(conf, name)
    chash = config_hash(cfg)  # of the dict the record stores
    hc = HydraConfig.get()
    sweep_dir = Path(hc.sweep.dir if hc.mode == RunMode.MULTIRUN else hc.runtime.output_dir)
    records_dir = Path(to_absolute_path(conf.records_dir))
    if hc.mode != RunMode.MULTIRUN:  # a sweep checked and locked its folder before its first job
        from ..records.records_lock import RecordsDirError, prepare

        try:
            prepare(records_dir, sweep_dir)
        except RecordsDirError as exc:
            _fail(str(exc))
            return None
    env = environment()
    env["variant_code"] = variant_code_version(cls)
    env["variant_package"] = provider(name)  # a plugin's distribution and version; None: built in
    env["launcher"] = _launcher_name(hc)
    if conf.isolate:
        set_job_allocator_env()  # what the job's process will start with (isolation.context_for sets it too)
    env["malloc"] = malloc_settings(conf.isolate)
    spec = JobSpec.from_config(cfg)  # what the job's process gets: the measurement's half of conf
    # the threads the job will run on (threads=null: every CPU it may use, which differs by allocation)
    env["job_threads"] = job_threads(spec) if spec.device.value == "cpu" else None
    env.update(kind_environment(spec.kind.value, spec.pretrained))  # compared on resume too

    existing = find_existing(records_dir, chash, env, not_reusable) if conf.resume else None
    if existing is not None:
        log.info("[%s] already measured: %s (resume=false to measure again)", label, existing)
        line = f"[{label}] skipped: already measured ({existing.name})"
        _say(line)
        old = json.loads(existing.read_text())
        _manifest(
            sweep_dir,
            chash,
            existing,
            "skipped",
            line=line,
            invalid=not _valid(old),
            reused=old.get("status"),
        )
        _end_single_run(old)
        return old

    from ..measure.kernel import precheck

    # the device's ceilings, once per sweep, (device, dtype) and on a CPU thread count (a GEMM on two
    # threads runs about twice one's): the first job that runs measures them
    threads = f"-{job_threads(spec)}t" if spec.device.value == "cpu" else ""
    roof_path = sweep_dir / f"roofline-{conf.device.value}-{conf.dtype.value}{threads}.json"
    want_roof = conf.roofline and rules(spec.kind).roofline and not roof_path.exists()
    result = precheck(spec, variant)  # unsupported / unavailable without spawning a child
    if result is None:
        canary_path = sweep_dir / f"canary-cpu-{job_threads(spec)}.json"
        result = measure_with_retries(spec, conf, label, want_roof, canary_path)
    roof = result.get("roofline")
    ceiling = None
    if roof and "error" not in roof:
        ceiling = roof
        _try_write(label, "the GEMM ceiling file", lambda: write_json_atomic(roof_path, roof))
    elif roof:
        log.warning("[%s] roofline not measured: %s", label, roof["error"])
    # the record keeps the ceiling this job was compared with (its own when the file could not be written)
    ceiling = read_json(roof_path) or ceiling
    figures = result.get("figures") or {}
    if implausible(figures.get("gflops_per_s"), ceiling, figures.get("threads")):
        # the report marks this job's share; the next job re-measures
        if _try_write(label, "the GEMM ceiling file", lambda: roof_path.unlink(missing_ok=True)):
            say(
                f"[{label}] ran faster than the sweep's GEMM ceiling: the next job measures the ceiling again"
            )
    # what torch saw in a CUDA job's child fills in what nvidia-smi could not tell (resume compares
    # the sweep's own view, so it is not overwritten)
    for k, v in (result.get("env") or {}).items():
        env.setdefault(k, v)
    record = {
        "schema_version": SCHEMA_VERSION,
        "kind": spec.kind.value,
        "variant_name": name,
        "label": label,
        "config": cfg,
        "config_hash": chash,
        "status": result["status"],
        "reason": result["reason"],
        "variant": result.get("variant"),
        "figures": result.get("figures", {}),
        "env": env,
        "roofline": ceiling,
        "sweep_dir": str(sweep_dir),
        "started_at": started,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "child_wall_s": result.get("wall_s"),
        "measure_s": result.get("measure_s"),
    }
    if "traceback" in result:
        record["traceback"] = result["traceback"]
    record["job_wall_s"] = time.perf_counter() - t_job
    path = _write_somewhere(record, records_dir, sweep_dir)
    line = summary_line(record)
    _manifest(sweep_dir, chash, path, record["status"], line=line, invalid=not _valid(record))
    _say(line)
    log.debug("record: %s", path)  # the manifest lists it; the terminal shows the summary line
    _end_single_run(record)
    return record


def _try_write(label: str, what: str, write: Callable[[], object]) -> bool:
    """Run ``write``, a change to one of the sweep folder's diagnostic files (a ceiling or canary); on
    ``OSError`` (the sweep folder full, read-only or gone) warn in one line and return False, so the job
    goes on to write its record: a measurement is never lost to a diagnostic."""
    try:
        write()
    except OSError as exc:
        say(f"[{label}] warning: could not write {what} in the sweep folder: {exc}; the record is kept")
        return False
    return True


def _end_single_run(record: dict[str, Any]) -> None:
    """A single run (not ``-m``) whose job measured nothing (``error``, ``unsupported``,
    ``unavailable``, ``oom``, ...) or computed a wrong result exits 1, its record written; a sweep says
    so at its end (:func:`experiments.sweep.callbacks.failures`)."""
    if HydraConfig.get().mode == RunMode.MULTIRUN or (record["status"] == "ok" and _valid(record)):
        return
    why = "computed a wrong result (INVALID)" if record["status"] == "ok" else f"ended '{record['status']}'"
    print(f"the job {why}, so it measured nothing: exit code 1", file=sys.stderr, flush=True)
    raise SystemExit(1)


def _write_somewhere(record: dict[str, Any], records_dir: Path, sweep_dir: Path) -> Path:
    """Write the record to ``records_dir``; if that fails now (disk full, folder gone), to the sweep
    folder, and as a last resort print it: a measurement is never lost to a write error."""
    try:
        return write_record(record, records_dir)
    except OSError as exc:
        print(f"error: could not write the record to {records_dir}: {exc}", file=sys.stderr, flush=True)
    fallback = sweep_dir / "unwritten_records"
    try:
        path = write_record(record, fallback)
        print(f"error: record written to {path} instead", file=sys.stderr, flush=True)
        return path
    except OSError:
        print("RECORD " + json.dumps(record, default=str), flush=True)
        raise


def _say(line: str) -> None:
    """A job's line for the terminal, unless this process's manifest follower shows it (above the
    progress bar) once the manifest has it."""
    if not following():
        print(line, flush=True)


def _launcher_name(hc: Any) -> str:
    """The Hydra launcher running this job, e.g. ``BasicLauncher`` or ``JoblibLauncher``."""
    try:
        return str(hc.launcher._target_).rsplit(".", 1)[-1]
    except Exception:  # a single run has the basic launcher too; never fail a job over a label
        return "BasicLauncher"


def _valid(record: dict[str, Any]) -> bool:
    """False when the record's output failed its check against the float64 oracle (``figures.valid``)."""
    return bool((record.get("figures") or {}).get("valid", True))


def _manifest(
    sweep_dir: Path,
    chash: str | None,
    path: Path | None,
    status: str,
    reason: str | None = None,
    line: str | None = None,
    invalid: bool = False,
    reused: str | None = None,
) -> None:
    """Append this job's record path to the sweep's manifest (one short line: an atomic append), with
    the job's summary ``line`` for the submitting process to show (:mod:`experiments.sweep.progress`),
    ``invalid`` when its result failed the correctness check (the sweep then exits 1) and, for a job
    skipped because it was measured before, the status of the record it ``reused``.

    The manifest is the sweep's bookkeeping, not its data: an append that fails (the sweep folder
    full, read-only or gone) is one warning line, the job's summary line is shown here instead of by
    the follower, and the sweep goes on; the record is already safe in ``records_dir``."""
    entry = {"config_hash": chash, "record": None if path is None else str(path), "status": status}
    if invalid:
        entry["invalid"] = True
    if reused is not None:
        entry["reused"] = reused
    if reason is not None:
        entry["reason"] = reason
    if line is not None:
        entry["line"] = line
    text = json.dumps(entry) + "\n"
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        with open(sweep_dir / MANIFEST, "a") as f:
            f.write(text)
    except OSError as exc:
        kept = f"the record is kept ({path}), but " if path is not None else ""
        say(
            f"warning: could not add a job to {sweep_dir / MANIFEST}: {exc}; {kept}the sweep's last line, "
            "exit code and report leave the job out"
        )
        if line is not None and following():  # the follower shows only what the manifest holds
            say(line)
