"""The store: every record, from any number of sweeps and machines, as one tidy pandas DataFrame.

One row per measurement (one record = one job = one row), with the workload config, the variant, the
figures and the environment as columns; ``kind`` says what the job measured (kernel, task, model,
pretrained: :class:`~experiments.measure.spec.Kind`) and :func:`of_kind` selects by it. Nothing is
dropped silently: records of every status are kept, unreadable files and duplicate copies are counted
and printed. The same configuration measured twice on one machine keeps both rows; the ``newest``
column marks the one tables show by default: the newest measurement, or of a sweep run in rounds the
median round (:mod:`experiments.records.rounds`).
:func:`newest_mask` is the one newest-record rule: every report section picks its rows with it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..measure.canary import slowdown
from ..measure.spec import KIND_GROUPS, Kind, kind_of
from .records import MANIFEST, STATUSES, record_problem
from .rounds import shown_rows

# folders a recursive search never enters: our own output and Hydra's config copies
_SKIP_DIRS = {"report", ".hydra"}

# the workload: what a row of a table is measured on (besides the variant and N)
WORKLOAD = [
    "device",
    "dtype",
    "mode",
    "batch",
    "tokens",
    "heads",
    "kv_len",
    "kv_heads",
    "head_dim",
    "v_head_dim",
    "causal",
    "cross",
    "padding",
    "documents",
    "scale",
    "bias",
]
# a measurement's identity: the same values here are "the same configuration" for newest-selection.
# min_run_time, accuracy_rows and the code version are left out on purpose: re-measuring with other
# run settings or newer code replaces the older row in tables.
CELL_KEYS = ["env_host", *WORKLOAD, "seed", "threads", "extra", "variant_key", "seq_len"]
# config keys that do not describe the variant's structure (shape hints follow the workload)
_NOT_KNOBS = {"_target_", "heads", "head_dim"}
#: a variant's record of which of its paths ran (``variant.describe()``): the tables tag a variant's
#: cells with it where it differs between them (chunked's C decode kernel at Nq=1, its PyTorch path at 16)
PATH_FIELDS = ("impl_ran", "decode_ran", "backend_ran")
_NULLABLE_INT = [
    "batch",
    "tokens",
    "heads",
    "seq_len",
    "kv_len",
    "kv_heads",
    "head_dim",
    "v_head_dim",
    "seed",
    "threads",
]


@dataclass
class LoadReport:
    """What loading found besides records: files it could not use, and duplicate copies."""

    files: int = 0
    unreadable: list[str] = field(default_factory=list)
    not_records: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    duplicates: int = 0


def _record_files(inputs: Iterable[str | Path], rep: LoadReport) -> list[Path]:
    """Record files named by ``inputs``: JSON files, manifests, sweep folders or record folders."""
    found: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_file() and p.name == MANIFEST:
            found += _manifest_entries(p, rep)
        elif p.is_file():
            found.append(p)
        elif p.is_dir():
            if (p / MANIFEST).is_file():  # a sweep folder: its records may live elsewhere
                found += _manifest_entries(p / MANIFEST, rep)
            found += [
                f
                for f in sorted(p.rglob("*.json"))
                if not f.name.startswith(".tmp-") and not _SKIP_DIRS & set(f.relative_to(p).parts[:-1])
            ]
        else:
            rep.missing.append(str(p))
    return found


def _manifest_entries(path: Path, rep: LoadReport) -> list[Path]:
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = Path(json.loads(line)["record"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by a crash
        if not rec.is_absolute():
            rec = path.parent / rec
        (out if rec.exists() else rep.missing).append(rec if rec.exists() else str(rec))
    return out


#: the store's columns that identify one record (one measurement): copies of it count once, and a
#: comparison that finds it on both sides has compared nothing
RECORD_IDENTITY = ["config_hash", "env_host", "started_at", "finished_at"]

#: JSON files a sweep writes beside its records (:mod:`experiments.sweep.runner`: the machine's
#: ceilings and canary per device, dtype and thread count), which a report reads past without a word
SWEEP_FILES = ("roofline-", "canary-")


def load_records(inputs: Iterable[str | Path]) -> tuple[list[dict[str, Any]], LoadReport]:
    """Read every record under ``inputs``; each record gets ``_path``. Copies of one record count once."""
    rep = LoadReport()
    seen_paths: set[Path] = set()
    seen_ids: set[tuple] = set()
    records = []
    for path in _record_files(inputs, rep):
        real = path.resolve()
        if real in seen_paths:  # a sweep's manifest and a folder scan can name the same file
            continue
        seen_paths.add(real)
        rep.files += 1
        try:
            rec = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            rep.unreadable.append(f"{path}: {exc}")
            continue
        if not (isinstance(rec, dict) and "config_hash" in rec and "status" in rec):
            if not path.name.startswith(SWEEP_FILES):  # the sweep's own ceilings and canary: expected
                rep.not_records.append(str(path))
            continue
        why = record_problem(rec)
        if why is not None:  # hash and status alone would be a row of nothing but its status
            rep.unreadable.append(f"{path}: {why}")
            continue
        env = rec["env"]
        ident = (
            rec["config_hash"],
            env.get("host"),
            rec.get("started_at"),
            rec.get("finished_at"),
        )  # RECORD_IDENTITY
        ident += (rec.get("job_wall_s"),)
        if ident in seen_ids:  # the same record copied into two folders (e.g. outputs/ and results/)
            rep.duplicates += 1
            continue
        seen_ids.add(ident)
        rec["_path"] = str(path)
        records.append(rec)
    return records, rep


def _derived_kind(cfg: dict[str, Any]) -> str:
    """The kind of a job from its config, for records (and saved stores) written before records
    stored their ``kind``: the only place the report side derives a kind instead of reading it."""
    return kind_of(cfg).value


def record_kind(rec: dict[str, Any]) -> str:
    """The record's ``kind`` (:class:`~experiments.measure.spec.Kind` value)."""
    return rec.get("kind") or _derived_kind(rec.get("config") or {})


def of_kind(df: pd.DataFrame, *kinds: Kind) -> pd.DataFrame:
    """The rows of ``df`` whose job is one of ``kinds``."""
    return df[df["kind"].isin([k.value for k in kinds])]


def _knobs(variant_cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sorted(variant_cfg.items()) if k not in _NOT_KNOBS}


def _cell(v: Any, sort_keys: bool = False) -> Any:
    """A record value as one frame cell: dicts and lists as JSON text (Parquet holds no mixed objects)."""
    return json.dumps(v, sort_keys=sort_keys, default=str) if isinstance(v, (dict, list)) else v


def _row(rec: dict[str, Any]) -> dict[str, Any]:
    """Flatten one record: config fields plain, figures plain (``fig_`` on a clash), env as ``env_*``."""
    cfg = rec.get("config") or {}
    vcfg = cfg.get("variant") or {}
    desc = rec.get("variant") or {}
    row: dict[str, Any] = {
        "variant_name": rec.get("variant_name") or desc.get("name") or "?",
        "variant_target": vcfg.get("_target_", ""),
        "knobs": json.dumps(_knobs(vcfg), sort_keys=True, default=str),
        "exact": desc.get("exact"),
        # which of a variant's paths ran (a kernel, a fallback) and why not the other
        **{k: desc.get(k) for k in (*PATH_FIELDS, "impl_note", "decode_note")},
        "kind": record_kind(rec),
        "status": rec["status"],
        "reason": rec.get("reason"),
        "label": rec.get("label"),
        "config_hash": rec["config_hash"],
        "schema_version": rec.get("schema_version"),
        "started_at": rec.get("started_at"),
        "finished_at": rec.get("finished_at"),
        "job_wall_s": rec.get("job_wall_s"),
        "measure_s": rec.get("measure_s"),
        "sweep_dir": rec.get("sweep_dir"),
        "path": rec["_path"],
    }
    for k, v in cfg.items():
        if k == "variant":
            continue
        row[k] = _cell(v, sort_keys=True)
    for k, v in (rec.get("figures") or {}).items():  # e.g. earlier_attempts, a list, as JSON text
        row[f"fig_{k}" if k in row else k] = _cell(v)
    for k, v in (rec.get("env") or {}).items():
        row[f"env_{k}"] = _cell(v)
    for k, v in (rec.get("roofline") or {}).items():  # the device's ceilings, measured in the sweep
        row[f"roofline_{k}"] = v
    return row


def machine_names(df: pd.DataFrame) -> pd.Series:
    """Each row's machine as the tables, canaries and comparisons tell machines apart: its host name,
    with the CPU model where one host name ran on several CPUs (a VM moved between machines: the
    2-core VM here is ``vm`` on an Intel Xeon and on an AMD EPYC). By host name alone the Intel's
    canary made every AMD job look 2x slow, and one configuration's two figures fell into one cell."""
    host = df["env_host"].astype(object)
    if "env_cpu_model" not in df:
        return host
    model = df["env_cpu_model"].astype(object).where(df["env_cpu_model"].notna(), "?").map(_short_cpu)
    several = model.groupby(host.astype(str)).transform("nunique") > 1
    return host.where(~several, host.astype(str) + " (" + model.astype(str) + ")")


def _short_cpu(model: object) -> str:
    """A CPU model without its trademarks and filler (``Intel(R) Xeon(R) Processor`` -> ``Intel Xeon``),
    short enough for a plot title."""
    text = re.sub(r"\((R|TM|tm)\)|\bProcessor\b|\bCPU\b|\b\d+-Core\b", " ", str(model))
    return " ".join(text.split()) or "?"


def variant_labels(df: pd.DataFrame) -> pd.Series:
    """Display name per row: the registered name, plus the knobs that differ between rows of it.

    ``local_window(window=64)`` and ``local_window(window=256)`` when a store has both, plain
    ``local_window`` when it has one setting. A class that borrows a registered name (a subclass that
    inherits ``name``) is shown by its class name.
    """
    labels = pd.Series("", index=df.index, dtype=object)
    # an unregistered class is recorded by its import path: shown by its class name
    base = df["variant_name"].astype(object).map(lambda n: n.rsplit(".", 1)[-1] if isinstance(n, str) else n)
    for _, sub in df.groupby("variant_name", dropna=False):
        targets = sub["variant_target"].unique()
        if len(targets) > 1:
            for t in targets:
                if not str(t).startswith("variants."):  # not a built-in: name it by its class
                    base[sub.index[sub["variant_target"] == t]] = str(t).rsplit(".", 1)[-1]
    for _, sub in df.assign(_base=base).groupby("_base", dropna=False):
        settings = [json.loads(k) for k in sub["knobs"].unique()]
        varying = sorted(
            {k for s in settings for k in s if len({json.dumps(x.get(k)) for x in settings}) > 1}
        )
        for knobs_json, rows in sub.groupby("knobs"):
            knobs = json.loads(knobs_json)
            extra = ", ".join(f"{k}={knobs.get(k)}" for k in varying)
            labels[rows.index] = f"{rows['_base'].iloc[0]}({extra})" if extra else rows["_base"].iloc[0]
    return labels


def _arrow_safe(df: pd.DataFrame) -> pd.DataFrame:
    """Columns Parquet can hold: an object column mixing Python types becomes text."""
    out = df.copy()
    for col in out.columns:
        if out[col].dtype == object:
            kinds = {type(v) for v in out[col] if v is not None and not (isinstance(v, float) and v != v)}
            if len(kinds) > 1:
                out[col] = out[col].map(lambda v: None if v is None else str(v))
    return out


def to_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """The tidy DataFrame of ``records``: one row per measurement, with ``variant`` and ``newest``."""
    if not records:
        return pd.DataFrame(
            columns=["variant", "variant_name", "kind", "status", "seq_len", "newest", *CELL_KEYS]
        )
    return finish(pd.DataFrame([_row(r) for r in records]))


def finish(df: pd.DataFrame) -> pd.DataFrame:
    """Normalise column types and (re)compute the ``variant`` label and ``newest`` flag of every row."""
    df = df.reset_index(drop=True)
    for col in ("started_at", "finished_at"):
        df[col] = pd.to_datetime(df[col], utc=True, format="ISO8601", errors="coerce")
    for col in _NULLABLE_INT:
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("Int64")
    for col in [*CELL_KEYS, "valid", "exact", "reason", "sweep_dir"]:
        if col not in df:
            df[col] = None
    df["env_host"] = machine_names(df)
    df["variant_key"] = df["variant_target"].astype(str) + df["knobs"].astype(str)
    df["variant"] = variant_labels(df).astype(str)
    # records from before rounds existed are round 0
    if "round" not in df:
        df["round"] = 0
    df["round"] = pd.to_numeric(df["round"], errors="coerce").fillna(0).astype("Int64")
    # and from before packed documents existed, one document per sequence; from before cross-attention,
    # self-attention
    df["documents"] = pd.to_numeric(df["documents"], errors="coerce").fillna(1).astype("Int64")
    df["cross"] = df["cross"].map(lambda v: str(v) == "True")
    # the machine's speed around each job against its fastest in the store (host, threads)
    df["machine_slowdown"] = slowdown(df)
    keys = cell_keys(df)
    df["newest"], values = shown_rows(df, keys, newest_mask(df, [*keys, "round"]))
    for col, by_row in values.items():  # a sweep run in rounds: its median figures on the shown row
        if col not in df:
            df[col] = pd.Series(None, index=df.index, dtype=object)
        elif df[col].dtype != object:
            df[col] = df[col].astype(object)  # a bool or int may land in a float column
        for i, v in by_row.items():
            df.at[i, col] = v
        df[col] = df[col].infer_objects()
    return df


def cell_keys(df: pd.DataFrame) -> list[str]:
    """A measurement's identity in ``df``: :data:`CELL_KEYS`, and a model job's model (its layers,
    its layer mix, its cache) where ``df`` has model records: the same variant on two models is two
    configurations. Not a column added to stores without one (their saved frames stay as they were)."""
    return [*CELL_KEYS, "model"] if "model" in df.columns else list(CELL_KEYS)


def newest_mask(df: pd.DataFrame, keys: list[str] | None = None) -> pd.Series:
    """True for the latest measurement (by start time, then finish time, then file, those of them
    ``df`` has) of each ``keys`` (default :func:`cell_keys`); a section whose rows are told apart by
    other config (a task, an encoder) passes its own keys."""
    keys = keys or cell_keys(df)
    order = df.sort_values([c for c in ("started_at", "finished_at", "path") if c in df], na_position="first")
    last = order.groupby(keys, dropna=False, sort=False).tail(1).index
    return pd.Series(df.index.isin(last), index=df.index)


def select(df: pd.DataFrame, all_measurements: bool = False) -> pd.DataFrame:
    """The rows tables show: the ``newest`` per configuration, or all with a ``run`` column to tell
    them apart."""
    if not all_measurements:
        return df[df["newest"]].copy()
    out = df.copy()
    run = out["sweep_dir"].astype(object).map(lambda s: Path(s).name if isinstance(s, str) and s else None)
    stamp = out["started_at"].dt.strftime("%Y-%m-%d %H:%M:%S").astype(object)
    out["run"] = run.where(run.notna(), stamp)
    # the same configuration twice in one sweep folder: the older ones get their own row, by start time
    twice = out.sort_values("started_at").duplicated([*cell_keys(out), "run"], keep="last").reindex(out.index)
    out.loc[twice, "run"] = out.loc[twice, "run"].astype(str) + " @ " + stamp[twice].astype(str)
    return out


def is_false(v: object) -> bool:
    """True only for a real False (``valid`` is True, False, or missing when nothing was checked)."""
    return isinstance(v, (bool, np.bool_)) and not v


def is_true(v: object) -> bool:
    """True only for a real True (a flag such as ``unstable`` is True, False, or missing: NaN)."""
    return isinstance(v, (bool, np.bool_)) and bool(v)


def status_counts(df: pd.DataFrame) -> pd.Series:
    """Number of records per status, known statuses first; ``ok`` rows that failed the check count as
    ``ok (invalid)``."""
    status = df["status"].astype(object).copy()
    status[(status == "ok") & df["valid"].map(is_false).astype(bool)] = "ok (invalid)"
    counts = Counter(status)
    order = [s for s in (*STATUSES[:1], "ok (invalid)", *STATUSES[1:]) if s in counts]
    order += sorted(s for s in counts if s not in order)
    return pd.Series({s: counts[s] for s in order}, dtype="int64", name="records")


def summary_line(df: pd.DataFrame, rep: LoadReport) -> str:
    """``loaded 20 records from 20 files: ok 12, unsupported 1, ...`` plus whatever was not loaded."""
    counts = ", ".join(f"{s} {n}" for s, n in status_counts(df).items()) if len(df) else "none"
    line = f"loaded {len(df)} record(s) from {rep.files} file(s): {counts}"
    extras = []
    if rep.duplicates:
        extras.append(f"{rep.duplicates} duplicate copie(s) counted once")
    if rep.unreadable:
        extras.append(f"{len(rep.unreadable)} unreadable file(s)")
    if rep.not_records:
        extras.append(f"{len(rep.not_records)} JSON file(s) that are not records")
    if rep.missing:
        extras.append(f"{len(rep.missing)} missing path(s)")
    if extras:
        line += "; " + ", ".join(extras)
        line += "".join(f"\n  unreadable: {u}" for u in rep.unreadable)
        line += "".join(f"\n  missing: {m}" for m in rep.missing)
    return line


def load(inputs: Iterable[str | Path], verbose: bool = True) -> pd.DataFrame:
    """Records under ``inputs`` (and saved stores, ``.parquet`` / ``.csv``) as one store DataFrame.

    Prints the count by status (and what could not be loaded) unless ``verbose`` is False.
    """
    inputs = [Path(p) for p in inputs]
    saved = [p for p in inputs if p.is_file() and p.suffix in (".parquet", ".csv")]
    records, rep = load_records([p for p in inputs if p not in saved])
    df = to_frame(records)
    if saved:
        stores = []
        for p in saved:
            try:
                stores.append(read_store(p))
            except (OSError, ValueError) as exc:  # a file cut short (pyarrow's ArrowInvalid is a ValueError)
                rep.unreadable.append(
                    f"{p}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                )
        frames = [f for f in (df, *stores) if len(f)]
        df = pd.concat(frames, ignore_index=True) if frames else df
        before = len(df)
        df = df.drop_duplicates(subset=RECORD_IDENTITY)
        rep.duplicates += before - len(df)
        rep.files += len(saved)
        df = finish(df) if len(df) else df
    if verbose:
        print(summary_line(df, rep))
    # for the report's header: files a reader of tables.md should know were skipped
    df.attrs["unreadable"] = list(rep.unreadable)
    df.attrs["not_records"] = list(rep.not_records)
    return df


def save(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Write ``store.parquet`` (when pyarrow is there) and ``store.csv`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    try:
        _arrow_safe(df).to_parquet(out / "store.parquet", index=False)
        written.append(out / "store.parquet")
    except ImportError:
        print("note: pyarrow is not installed: store.parquet not written (store.csv has the same data)")
    df.to_csv(out / "store.csv", index=False)
    written.append(out / "store.csv")
    return written


def read_store(path: str | Path) -> pd.DataFrame:
    """A saved store (``.parquet`` or ``.csv``) back as a DataFrame."""
    path = Path(path)
    df = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    if len(df) and (lacks := [c for c in ("status", *RECORD_IDENTITY) if c not in df]):
        # a report's table (speed.csv) or another file: no store (load lists it as unreadable)
        raise ValueError(f"not a saved store (store.csv / store.parquet): no column {', '.join(lacks)}")
    if "kind" not in df and len(df):  # saved before records stored their kind
        groups = [g.value for g in KIND_GROUPS if g.value in df]
        df["kind"] = [_derived_kind({g: _set(row[g]) for g in groups}) for _, row in df.iterrows()]
    return df


def _set(cell: Any) -> Any:
    """A saved config cell as its value: None for an empty cell (NaN, "", "null" after a round trip)."""
    return (
        None if cell is None or cell in ("", "null") or (isinstance(cell, float) and cell != cell) else cell
    )
