"""How kernel-shaped records become tables: which rows are usable, each row's time in its own mode,
the group a row belongs to (device, dtype, mode and whatever else varies) and the variant x N grid of
cells, with the marks a time carries when it was measured beside other work or on a slow machine.

Shared by the kernel tables, the model table, the baseline comparison and the kernel plots.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from ..measure.canary import SLOW_RATIO
from ..measure.machine_load import LOADED_CORES
from ..records.store import PATH_FIELDS, WORKLOAD, is_false, is_true

#: a CPU figure whose process ran on fewer than this share of its threads' cores (CPU time over wall
#: time, ``<fig>_cpu_per_wall``) is flagged too: its threads waited, or other work pushed them off
#: (on the 2-core VM sdpa fwd+bwd at N=1024 ran at 1.32 cores, 105 ms with an IQR of 28%, while the
#: kernel reclaimed memory after an OOM kill)
ON_CORES = 0.9

GROUP_BASE = ["device", "dtype", "mode"]
# shown in a group's title only when they vary in the data
GROUP_EXTRA = ["env_host", *[c for c in WORKLOAD if c not in GROUP_BASE], "seed", "threads", "extra"]
#: a cell where no job was run
NO_RECORD = "–"


def is_invalid(df: pd.DataFrame) -> pd.Series:
    """True where the job ran but its correctness check failed (``figures.valid`` is False)."""
    return (df["status"] == "ok") & df["valid"].map(is_false).astype(bool)


def usable(df: pd.DataFrame) -> pd.Series:
    """True where the figures can be shown: status ok and not invalid."""
    return (df["status"] == "ok") & ~is_invalid(df)


def mode_times(df: pd.DataFrame) -> pd.DataFrame:
    """``time_s``, ``iqr_s``, ``q1_s``, ``q3_s``, ``cpu_per_wall``, ``page_faults``, ``steal``,
    ``retimed`` and ``unstable`` of each row's own mode (fwd or fwd_bwd)."""
    cols = ["time_s", "iqr_s", "q1_s", "q3_s", "cpu_per_wall", "page_faults", "steal", "retimed"]
    out = pd.DataFrame(index=df.index, columns=cols, dtype=float)
    out["unstable"] = False
    for mode in df["mode"].dropna().unique():
        rows = df["mode"] == mode
        for col in cols:
            src = f"{mode}_{col.replace('time', 'median')}"
            if src in df:
                out.loc[rows, col] = pd.to_numeric(df.loc[rows, src], errors="coerce")
        if f"{mode}_unstable" in df:  # records from before the flag existed count as stable
            out.loc[rows, "unstable"] = df.loc[rows, f"{mode}_unstable"].map(lambda v: v is True)
    return out


def length_axis(df: pd.DataFrame) -> str:
    """The tables' column axis: ``seq_len`` (N), or ``kv_len`` (Nk) where the key length takes more
    values than the query length among the rows that have one (decode sweeps: Nq = 1 or 16 against
    Nk = 1k to 128k); rows with a null kv_len (self-attention) take N either way (:func:`lengths`)."""
    if "kv_len" not in df:
        return "seq_len"
    # only rows with a key length vote: a self-attention sweep's lengths beside a decode sweep's
    # outnumbered its Nk and turned the decode sweep's tables into one per Nk
    keyed = df[df["kv_len"].notna()]
    nk = keyed["kv_len"].nunique()
    return "kv_len" if nk > 1 and nk >= keyed["seq_len"].nunique() else "seq_len"


def lengths(df: pd.DataFrame) -> pd.Series:
    """Each row's length on ``df``'s axis (:func:`length_axis`): N, or the key length Nk, and N for a
    row without a key length of its own (null kv_len: a self-attention sweep in a store that also holds
    decode sweeps, which the default records folder collects); ``O(rows)``."""
    n = pd.to_numeric(df["seq_len"], errors="coerce")
    if length_axis(df) == "seq_len":
        return n
    return pd.to_numeric(df["kv_len"], errors="coerce").fillna(n)


def group_keys(df: pd.DataFrame) -> list[str]:
    """device, dtype, mode, then every other workload field that takes several values in ``df``
    (except the length axis; with the key length as the axis, the query length is a group key)."""
    axis = length_axis(df)
    extra = [c for c in GROUP_EXTRA if c in df and c != axis and df[c].astype(str).nunique(dropna=False) > 1]
    if axis == "kv_len" and df["seq_len"].nunique() > 1:
        extra.append("seq_len")
    if "batch" in extra and key_frame(df, extra)["batch"].astype(str).nunique(dropna=False) <= 1:
        extra.remove("batch")  # only token budgets vary it (batch = tokens // N follows the length)
    return GROUP_BASE + extra


def key_frame(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """``df`` as :func:`group_keys`' ``keys`` see it: where a token budget set the batch
    (``tokens``), the batch follows the length and is no key (null), so those rows share a group
    apart from those of a given batch; where the query length is a key (decode sweeps), a row without a
    key length of its own (null kv_len) has its N on the axis, not in a key (null), so a self-attention
    sweep in the same store keeps one table across its lengths. ``O(rows)``."""
    if "seq_len" in keys and "kv_len" in df and df["kv_len"].isna().any():
        df = df.assign(seq_len=df["seq_len"].where(df["kv_len"].notna()))
    if "batch" not in keys or "tokens" not in df or df["tokens"].isna().all():
        return df
    return df.assign(batch=df["batch"].where(df["tokens"].isna()))


def groups(df: pd.DataFrame, keys: list[str]) -> list[tuple[str, pd.DataFrame]]:
    """``(title, rows)`` per group, e.g. ``cpu · float32 · fwd · causal=True``."""
    out = []
    for vals, keyed in key_frame(df, keys).groupby(keys, dropna=False, sort=True):
        sub = df.loc[keyed.index]
        vals = vals if isinstance(vals, tuple) else (vals,)
        parts = [str(v) for v in vals[: len(GROUP_BASE)]]
        parts += key_texts(keys[len(GROUP_BASE) :], vals[len(GROUP_BASE) :])
        out.append((" · ".join(parts), sub))
    return out


def key_texts(keys: list[str], vals: tuple | list) -> list[str]:
    """``key=value`` of each of a group's ``keys`` past :data:`GROUP_BASE`, for a title or a facet; a
    null seq_len is left out: it is that of rows whose N is the axis (:func:`key_frame`). A whole number
    shows as one (a key column with nulls, e.g. in the scaling fits, holds ``threads=1.0``)."""
    return [
        f"{k.removeprefix('env_')}={value_text(k, int(v) if isinstance(v, float) and v.is_integer() else v)}"
        for k, v in zip(keys, vals, strict=True)
        if not (k == "seq_len" and pd.isna(v))
    ]


def value_text(key: str, v: object) -> object:
    """A config value for a title; null kv_len / v_head_dim mean "the same as the queries'", a null
    batch one set by a token budget (:func:`key_frame`)."""
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return {"kv_len": "seq_len", "v_head_dim": "head_dim", "batch": "tokens/N"}.get(key, "null")
    return v


def varying_text(rows: pd.DataFrame, fields: list[str]) -> pd.Series:
    """Per row, `` · threads=2`` and the like: those of ``fields`` that take more than one value
    among ``rows`` (empty text where none do), for a title or a label, so that no row hides
    another. ``O(rows)``."""
    vary = [c for c in fields if c in rows and rows[c].astype(str).nunique(dropna=False) > 1]
    if not vary:
        return pd.Series("", index=rows.index, dtype=object)

    def text(row: pd.Series) -> str:
        return "".join(f" · {c.removeprefix('env_')}={value_text(c, row[c])}" for c in vary)

    return rows.apply(text, axis=1).astype(str)


def workload_line(df: pd.DataFrame) -> str:
    """The workload fields that are the same in every row, e.g. ``batch=1, heads=8, head_dim=64``."""
    same = []
    for c in [*WORKLOAD[3:], "seed"]:
        if c in df and len(df) and df[c].astype(str).nunique(dropna=False) == 1:
            if c == "tokens" and pd.isna(df[c].iloc[0]):
                continue  # no token budget: the batch is as given
            if c == "documents" and df[c].iloc[0] == 1:
                continue  # one document per sequence: nothing packed
            if c == "cross" and not bool(df[c].iloc[0]):
                continue  # self-attention
            same.append(f"{c}={value_text(c, df[c].iloc[0])}")
    return ", ".join(same)


def _row_index(df: pd.DataFrame) -> list[str]:
    return ["variant", "run"] if "run" in df else ["variant"]


def pivot_cells(df: pd.DataFrame, cell: Callable[[pd.Series], str]) -> pd.DataFrame:
    """Variant x N (or x Nk, see :func:`length_axis`) table of ``cell(row)`` strings; missing
    combinations show ``NO_RECORD``."""
    if df.empty:
        return pd.DataFrame()
    axis = length_axis(df)
    long = df.assign(_cell=df.apply(cell, axis=1), _n=lengths(df).astype("Int64"))
    long["_cell"] = long["_cell"] + _path_tags(long)
    long = long.sort_values("started_at", na_position="first")
    table = long.pivot_table(index=_row_index(df), columns="_n", values="_cell", aggfunc="last")
    table = table.reindex(sorted(table.columns), axis=1).fillna(NO_RECORD)
    label = "Nk" if axis == "kv_len" else "N"
    table.columns = [f"{label}={n}" for n in table.columns]
    table.columns.name = None
    return table.sort_index()


def path_text(row: pd.Series) -> str:
    """Which of its paths a variant ran for this record (:data:`~..records.store.PATH_FIELDS`), as
    ``decode=kernel``; empty when it records none."""
    return ", ".join(
        f"{c.removesuffix('_ran')}={row[c]}" for c in PATH_FIELDS if isinstance(row.get(c), str) and row[c]
    )


def _path_tags(long: pd.DataFrame) -> pd.Series:
    """`` [decode=torch]`` after each cell of a table row whose cells ran different paths of the
    variant (chunked's C decode kernel at one query, its PyTorch path at 16), else nothing: one row
    would otherwise read as one implementation's figures."""
    path = long.apply(path_text, axis=1).astype(str).replace("", None)  # None: no path recorded
    mixed = path.groupby([long[c] for c in _row_index(long)], dropna=False).transform("nunique") > 1
    return (" [" + path + "]").where(mixed & path.notna(), "")


def status_cell(row: pd.Series) -> str | None:
    """What to show instead of a number, or None when the row's figures are usable."""
    if row["status"] != "ok":
        return str(row["status"])
    if is_false(row["valid"]):
        return "invalid"
    return None


def beside_work(row: pd.Series) -> bool:
    """A time measured beside other work (marked ``*``): other processes kept more than
    :data:`LOADED_CORES` busy, other jobs of the suite measured at the same time, or its threads were
    off their cores (:func:`_off_cores`)."""
    busy = pd.to_numeric(row.get("others_cpu_cores"), errors="coerce")
    beside = pd.to_numeric(row.get("concurrent_jobs"), errors="coerce")
    loaded = (pd.notna(busy) and busy > LOADED_CORES) or (pd.notna(beside) and beside > 0)
    return bool(loaded or _off_cores(row))


def machine_marks(row: pd.Series) -> str:
    """`` *`` (:func:`beside_work`) and `` ~`` (:func:`slow_machine`), as a time's cell writes them
    after it: what the job's load and canary say of every time it measured (a model's prefill and
    decoding step alike)."""
    return (" *" if beside_work(row) else "") + (" ~" if slow_machine(row) else "")


def marks(row: pd.Series) -> str:
    """The marks a time carries, as the speed table writes them after it: :func:`machine_marks` and
    `` unstable`` (the row's ``unstable``); from the row's ``cpu_per_wall`` and ``unstable``, which must
    be those of the figure the time is (:func:`mode_times`, or a decoding step's), and its job's load
    and canary."""
    mark = machine_marks(row)
    if is_true(row.get("unstable")):
        mark += " unstable"
    return mark


def slow_machine(row: pd.Series) -> bool:
    """A time measured while the machine ran slow (marked ``~``): its canary above ``SLOW_RATIO``."""
    return bool(pd.to_numeric(row.get("machine_slowdown"), errors="coerce") > SLOW_RATIO)


def _off_cores(row: pd.Series) -> bool:
    """A CPU figure whose threads were on their cores less than :data:`ON_CORES` of its wall time."""
    threads = pd.to_numeric(row.get("fig_threads", row.get("threads")), errors="coerce")
    cpw = pd.to_numeric(row.get("cpu_per_wall"), errors="coerce")
    return row.get("device") == "cpu" and pd.notna(threads) and pd.notna(cpw) and cpw < ON_CORES * threads
