"""The report of a set of records: every section, the store (Parquet and CSV), and the one CLI.

    python -m experiments.report.report [PATHS ...] [--out DIR] [--baseline OTHER ...] [--all-measurements]

PATHS are sweep folders (their manifest names the records), record folders (searched recursively),
record files, or saved stores (``store.parquet`` / ``store.csv``); default ``outputs/records``. It
works on whatever records exist, so a crashed or partial sweep still gets its report. A multirun
calls :func:`report_paths` at its end (``experiments/sweep/callbacks.py``).

Each kind of job has its section (the store's ``kind`` column says which rows are whose):

- kernel: ``tables.md`` (:mod:`.kernel_tables`), one CSV per table, the plots (:mod:`.plots`) and,
  with ``--baseline``, the comparison (:mod:`.compare`);
- model: its table in ``tables.md`` (:mod:`.model_section`);
- task: ``task_table.md``/``.csv`` and two plots (:mod:`.task_section`); recall records with their
  state: ``recall_frontier.md``/``.csv``/``.png`` (:mod:`.frontier_section`); task records with a
  step's peak memory: ``lra_efficiency.md``/``.csv`` (:mod:`.efficiency_section`);
- pretrained: ``pretrained.md``/``.csv`` and two plots per comparable set (:mod:`.pretrained_section`).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from ..measure.canary import SLOW_RATIO, job_canaries, machine_keys
from ..measure.spec import Kind
from ..records import store
from ..records.records import unwritable_dir
from . import efficiency_section, frontier_section, pretrained_section, task_section
from . import kernel_tables as K
from .compare import baseline_table, nothing_to_compare
from .format import Section, rate, rate_prefix, render
from .grouping import workload_line
from .model_section import model_table, plot_context

DEFAULT_INPUT = "outputs/records"


def default_out_dir(inputs: Sequence[str | Path]) -> Path:
    """``report/`` inside the first input folder (next to a file input)."""
    first = Path(inputs[0]) if inputs else Path(DEFAULT_INPUT)
    return (first if first.is_dir() else first.parent) / "report"


def _machines(df: pd.DataFrame) -> list[str]:
    """One line per machine in the store: host, CPU (model and vector instruction set), GPU, torch,
    commit, and the environment variables set that change speed (``env.speed_settings``)."""
    names = (
        "env_host", "env_cpu_model", "env_cpu_capability", "env_gpu_name", "env_torch", "env_git_commit",
        "env_speed_settings",
    )  # fmt: skip
    cols = [c for c in names if c in df]
    lines = []
    for vals, sub in df.groupby(cols, dropna=False):
        vals = vals if isinstance(vals, tuple) else (vals,)
        parts = [f"{c.removeprefix('env_')}={v}" for c, v in zip(cols, vals, strict=True) if not pd.isna(v)]
        lines.append(f"- {', '.join(parts)} ({len(sub)} records)")
    return lines


def _ceilings(df: pd.DataFrame) -> list[str]:
    """One line per (host, device, dtype, threads) roofline in the store: GEMM FLOP/s, copy bandwidth and
    (where measured) read bandwidth; a CPU's thread count is named where the records have it."""
    cols = ["env_host", "roofline_device", "roofline_dtype"]
    if not all(c in df for c in cols) or "roofline_gemm_flops_per_s" not in df:
        return []
    # a CPU's ceilings scale with its threads: one line per count, as the canaries have (pooled, a
    # 1-thread and a 2-thread sweep made one median with a range spanning both); NaN where not
    # recorded, or a GPU's, whose ceilings do not depend on the host's threads
    threads = pd.to_numeric(df.get("roofline_threads", pd.Series(index=df.index)), errors="coerce")
    df = df.assign(_threads=threads.where(df["roofline_device"] == "cpu"))
    lines = []
    for (host, device, dtype, n_threads), sub in df.dropna(subset=cols[1:]).groupby(
        [*cols, "_threads"], dropna=False
    ):
        gemm = pd.to_numeric(sub["roofline_gemm_flops_per_s"], errors="coerce")
        copy = pd.to_numeric(sub.get("roofline_copy_bytes_per_s"), errors="coerce")
        read = pd.to_numeric(sub.get("roofline_read_bytes_per_s", pd.Series(dtype=float)), errors="coerce")
        read_text = f", read {rate(read, 'B/s')}" if read.notna().any() else ""
        ops = sorted(sub.get("roofline_read_op", pd.Series(dtype=object)).dropna().unique())
        read_text += f" ({', '.join(ops)})" if read_text and ops else ""  # which read was the faster
        n_col = pd.to_numeric(sub.get("roofline_gemm_n", pd.Series(dtype=float)), errors="coerce").dropna()
        n = int(n_col.iloc[0]) if len(n_col) else "?"  # a whole number (the column is float beside NaN)
        gemm_dtype = sub["roofline_gemm_dtype"].dropna() if "roofline_gemm_dtype" in sub else []
        if len(gemm_dtype) and gemm_dtype.iloc[0] != dtype:  # a CPU's half precision: float32's GEMM
            n = f"{n}, in {gemm_dtype.iloc[0]}"
        where = f"{host} {device} {dtype}" + ("" if pd.isna(n_threads) else f", {int(n_threads)} thread(s)")
        lines.append(
            f"- {where}: GEMM {rate(gemm, 'FLOP/s')} (n={n}){_sweeps_range(gemm)}, "
            f"copy {rate(copy, 'B/s')}{_sweeps_range(copy)}{read_text}"
        )
    return lines


def _sweeps_range(rates: pd.Series) -> str:
    """`` (sweeps ranged 84.8-93.3)`` (in the unit :func:`~.format.rate` gives the median) where the
    store's sweeps measured a ceiling at more than one value (at three digits), else empty: a
    memory-bound time of one sweep against another's moves with the copy (this VM's halved between
    two days, its GEMM by 16%). Sweeps more than ``SLOW_RATIO`` apart are said to be in different
    machine states, as ``report --baseline`` says of two runs: their times side by side are not the
    code's difference."""
    scale = rate_prefix(rates.median())[1]
    lo, hi = f"{rates.min() / scale:.3g}", f"{rates.max() / scale:.3g}"
    if lo == hi:  # not one value written twice
        return ""
    apart = rates.max() / rates.min()
    if apart > SLOW_RATIO:
        return f" (sweeps ranged {lo}-{hi}: {apart:.2f}x apart, in different machine states)"
    return f" (sweeps ranged {lo}-{hi})"


def _canaries(df: pd.DataFrame) -> list[str]:
    """One line per (host, threads) with canaries: the fastest, median and slowest job canary, and how
    many jobs ran slower than ``SLOW_RATIO`` times the fastest (their times are marked ``~``). Jobs
    that measured nothing (unsupported, failed) are left out: they have no times to mark, and no
    thread count of their own (they made a ``?`` line)."""
    df = df[df["status"] == "ok"]
    job = job_canaries(df)
    lines = []
    for (host, n), sub in job.groupby(machine_keys(df)):
        sub = sub.dropna()
        if len(sub):
            slow = int((df.loc[sub.index, "machine_slowdown"] > SLOW_RATIO).sum())  # see store.finish
            lines.append(
                f"- {host}, {n} thread(s): {sub.min():.3g} / {sub.median():.3g} / {sub.max():.3g} ms "
                f"(fastest / median / slowest of {len(sub)} jobs); {slow} slower than "
                f"{SLOW_RATIO:.2f}x the fastest"
            )
    return lines


def _plugins(df: pd.DataFrame) -> str:
    """``dilated (dilated-attn 0.2.0)``: each variant a plugin package provided, with the package's
    versions in the records (records before 2026-11-29 do not say). O(rows)."""
    if "env_variant_package" not in df:
        return ""
    rows = df.dropna(subset=["env_variant_package"])
    return ", ".join(
        f"{name} ({', '.join(sorted(sub['env_variant_package'].astype(str).unique()))})"
        for name, sub in rows.groupby(rows["variant_name"].astype(str))
    )


def _sources(inputs: Sequence[str | Path]) -> str:
    """The inputs in a few words: folders as given, record files counted per folder."""
    files = Counter(str(Path(p).parent) for p in inputs if Path(p).suffix == ".json")
    named = [str(p) for p in inputs if Path(p).suffix != ".json"]
    return ", ".join(named + [f"{n} record file(s) in {d}" for d, n in files.items()])


def header(
    df: pd.DataFrame, shown: pd.DataFrame, inputs: Sequence[str | Path], all_measurements: bool
) -> str:
    """The report's opening: where the records came from, what was measured, how to read the cells."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    counts = ", ".join(f"{s} {n}" for s, n in store.status_counts(df).items())
    lines = [
        "# Attention benchmark report",
        "",
        f"Generated {stamp} from {len(df)} record(s) ({counts}) in: {_sources(inputs)}.",
        "",
        "Machines:",
        *_machines(df),
        "",
    ]
    if plugins := _plugins(df):
        lines += [f"Variants from installed packages (not this repository's commit): {plugins}.", ""]
    skipped = [f"- unreadable: {u}" for u in df.attrs.get("unreadable", [])]
    skipped += [f"- not a record: {u}" for u in df.attrs.get("not_records", [])]
    if skipped:
        lines += [f"Skipped {len(skipped)} file(s) that hold no usable record:", *skipped, ""]
    ceilings = _ceilings(df)
    if ceilings:
        lines += ["Ceilings measured in the sweeps (the records' median):", *ceilings, ""]
    canaries = _canaries(df)
    if canaries:
        lines += ["Machine speed around each CPU job (the canary, a 1024x1024 float32 GEMM):", *canaries, ""]
    workload = workload_line(store.of_kind(shown, Kind.kernel))  # a model job's shapes are its model's
    if workload:
        lines += [f"Workload in every table: {workload}.", ""]
    hidden = len(df) - len(shown)
    if not all_measurements and hidden:
        lines += [
            f"{hidden} other measurement(s) of the same configurations are hidden: tables show the newest, "
            "or of a sweep run in rounds the median round of those measured at the machine's usual speed "
            "(`--all-measurements` shows every one, one row "
            "per run).",
            "",
        ]
    lines += [K.LEGEND, ""]
    return "\n".join(lines)


def build_sections(df: pd.DataFrame, shown: pd.DataFrame, base: pd.DataFrame | None) -> list[Section]:
    """Every table of ``tables.md`` in reading order: the model jobs' table, then the kernel jobs'
    tables (and the baseline comparison); ``df`` and ``shown`` hold kernel and model rows."""
    models = model_table(store.of_kind(shown, Kind.model))
    kernels = store.of_kind(df, Kind.kernel)
    if kernels.empty:
        return [models, K.status_table(df, shown)]
    df, shown = kernels, store.of_kind(shown, Kind.kernel)
    sections = [
        K.speed_table(shown),
        *[sec for sec in [K.bandwidth_table(shown), K.decode_table(shown)] if sec.parts],  # decoding jobs
        K.memory_table(shown),
        K.accuracy_table(shown),
        K.scaling_table(shown),
        K.status_table(df, shown),
    ]
    if models.parts:
        sections.insert(0, models)
    if base is not None and len(base):
        sections.append(baseline_table(df, base))
    return sections


def _unwritable(out: Path) -> str | None:
    """Why the report could not be written under ``out`` (checked before any work), or None. Tried
    for real (the folder made, a file written and removed), not asked of ``os.access``, which says
    yes to root on a read-only mount or ``/proc``; the folders it made are removed again."""
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    why = unwritable_dir(out)
    return None if why is None else f"{out} cannot be written: {why}"


class NoBaseline(Exception):
    """A comparison was asked for (``--baseline``) and its paths hold no record."""


def report_paths(
    paths: Sequence[str | Path],
    out_dir: str | Path | None = None,
    *,
    baseline: Sequence[str | Path] | None = None,
    all_measurements: bool = False,
    plots: bool = True,
    echo: bool = True,
) -> list[Path]:
    """Load the records under ``paths``, print the tables and write tables, store and plots to
    ``out_dir`` (default :func:`default_out_dir`); returns the files written."""
    paths = list(paths) or [DEFAULT_INPUT]
    out = Path(out_dir) if out_dir is not None else default_out_dir(paths)
    df = store.load(paths)
    if df.empty:
        print("no records found: nothing to report")
        return []
    base = None
    if baseline:
        print("baseline: ", end="")
        base = store.load(baseline)
        if base.empty:  # the comparison asked for cannot be made: say so before writing anything
            raise NoBaseline(
                f"--baseline {' '.join(map(str, baseline))}: no records there to compare against"
            )
        if why := nothing_to_compare(df, base):
            raise NoBaseline(f"--baseline {' '.join(map(str, baseline))}: {why}")
    out.mkdir(parents=True, exist_ok=True)
    written = store.save(df, out)
    # task and pretrained jobs have files of their own (the task table puts the kernel records' speed
    # beside accuracy, so it gets the whole store); kernel and model jobs share tables.md
    for kind, section, table in (
        (Kind.task, task_section, "task_table.md"),
        (Kind.pretrained, pretrained_section, "pretrained.md"),
    ):
        if not store.of_kind(df, kind).empty:
            written += section.write_report(df, out, plots=plots)
            if echo:
                print("\n" + (out / table).read_text())
    # recall records that say what state they keep make a frontier (experiment=recall_frontier)
    if not store.of_kind(df, Kind.task).empty and (
        front := frontier_section.write_report(df, out, plots=plots)
    ):
        written += front
        if echo:
            print("\n" + (out / "recall_frontier.md").read_text())
    # task records that measured a step's memory make the training-cost table (experiment=lra_efficiency)
    if not store.of_kind(df, Kind.task).empty and (cost := efficiency_section.write_report(df, out)):
        written += cost
        if echo:
            print("\n" + (out / "lra_efficiency.md").read_text())
    df = store.of_kind(df, Kind.kernel, Kind.model)
    if df.empty:
        print(f"report written to {out}: {', '.join(p.name for p in written)}")
        return written
    shown = store.select(df, all_measurements)
    sections = build_sections(df, shown, base)
    text = header(df, shown, paths, all_measurements) + "\n" + "\n".join(render(s) for s in sections)
    (out / "tables.md").write_text(text)
    written.append(out / "tables.md")
    for sec in sections:
        sec.data.to_csv(out / f"{sec.name}.csv", index=False)
        written.append(out / f"{sec.name}.csv")
    if echo:
        print("\n" + text)
    if plots:
        from .plots import write_all

        # plots always show the newest measurement: several runs on one line would zigzag; model jobs
        # get a table, no plots
        written += write_all(store.select(store.of_kind(df, Kind.kernel)), out)
        # model jobs at several prompt lengths: decoding cost and K/V bytes against the context
        context = plot_context(store.of_kind(shown, Kind.model), out / "model_context.png")
        written += [context] if context is not None else []
    print(f"report written to {out}: {', '.join(p.name for p in written)}")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (1 when no record was found)."""
    ap = argparse.ArgumentParser(
        prog="python -m experiments.report.report",
        description="Tables, store and plots of benchmark records (sweep folders, record folders or files).",
    )
    ap.add_argument(
        "paths",
        nargs="*",
        help=f"sweep/record folders, record files or saved stores (default {DEFAULT_INPUT})",
    )
    ap.add_argument("--out", help="output folder (default: report/ inside the first path)")
    ap.add_argument(
        "--baseline",
        nargs="+",
        action="extend",
        metavar="OTHER",
        help="records to compare against (another commit, machine or library version): speedups, each "
        "marked when within the two runs' noise or measured on a slow machine",
    )
    ap.add_argument(
        "--all-measurements",
        action="store_true",
        help="show every measurement of a configuration (one row per run), not only the newest",
    )
    ap.add_argument("--no-plots", action="store_true", help="tables and store only")
    args = ap.parse_args(argv)
    if gone := [p for p in [*args.paths, *(args.baseline or [])] if not Path(p).exists()]:
        # a misspelt folder would drop its records from the report, or a side of the comparison
        print(f"error: no such file or folder: {', '.join(gone)}", file=sys.stderr)
        return 1
    if args.out and (why := _unwritable(Path(args.out))):
        print(f"error: --out {args.out}: {why}", file=sys.stderr)
        return 1
    if not args.out and (why := _unwritable(out := default_out_dir(args.paths or [DEFAULT_INPUT]))):
        # a shared, read-only results folder: the report goes elsewhere
        print(
            f"error: the report's default folder {out}: {why}; write it elsewhere with --out", file=sys.stderr
        )
        return 1
    try:
        written = report_paths(
            args.paths,
            args.out,
            baseline=args.baseline,
            all_measurements=args.all_measurements,
            plots=not args.no_plots,
        )
    except NoBaseline as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
