"""Tables of the store: speed, memory, accuracy, scaling, status and a comparison with a baseline.

Every table is grouped by device, dtype and mode (and by any other workload field that varies in the
data, e.g. causal or the host), with one row per variant and one column per sequence length N. A cell
that has no number says why: the job's status (``oom``, ``unsupported``, ...), ``invalid`` when the
correctness check failed (its time and memory are not shown), ``–`` when no job was run there.
Each :class:`Section` holds the formatted tables (for Markdown) and a long numeric frame (for CSV).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..measure.canary import SLOW_RATIO
from ..records.rounds import numeric as _col
from ..records.store import CELL_KEYS, WORKLOAD, is_false, status_counts

#: above this many cores' worth of other processes' work (``others_cpu_cores``, see
#: :mod:`experiments.measure.machine_load`), a job's times are flagged as measured beside other work
LOADED_CORES = 0.5
#: a CPU figure whose process ran on fewer than this share of its threads' cores (CPU time over wall
#: time, ``<fig>_cpu_per_wall``) is flagged too: its threads waited, or other work pushed them off
#: (on the 2-core VM sdpa fwd+bwd at N=1024 ran at 1.32 cores, 105 ms with an IQR of 28%, while the
#: kernel reclaimed memory after an OOM kill)
ON_CORES = 0.9

GROUP_BASE = ["device", "dtype", "mode"]
# shown in a group's title only when they vary in the data
GROUP_EXTRA = ["env_host", *[c for c in WORKLOAD if c not in GROUP_BASE], "seed", "threads", "extra"]
MATCH_KEYS = [k for k in CELL_KEYS if k != "env_host"]  # what a baseline row is matched on
NO_RECORD = "–"
FLOPS_NOTE = (
    "FLOPs count the useful (query, key) pairs each variant lets interact (2·D + 2·Dv per pair forward, "
    "backward 2.5x forward; FlashAttention convention), not the work a blocked kernel actually does. "
    "The percentage beside GFLOP/s divides by the FLOP/s of a large matrix multiply in the same dtype, "
    "measured on the same device in the same sweep (the record's roofline)."
)
LEGEND = (
    f"Cells without a number give the job's status (oom, unsupported, ...); `invalid` = the "
    f"correctness check failed, so its figures are not shown; `{NO_RECORD}` = no job was run there; "
    f"a time marked `*` was measured beside other work: other jobs of this suite measuring on the "
    f"same host (`concurrent_jobs`), or other processes keeping more than {LOADED_CORES:g} CPU cores "
    f"busy on average (`others_cpu_cores`), or, on a CPU, its threads were on their cores less than "
    f"{ON_CORES:.0%} of the time (process CPU time over wall time, `<fig>_cpu_per_wall`, against its "
    "thread count: they waited, or other work pushed them off); it may be inflated. A time marked `~` "
    f"was measured while the machine ran slow: the job's canary (a fixed 1024x1024 matrix multiply "
    f"timed before and after it) took more than {SLOW_RATIO:.2f}x the fastest canary of the same host "
    "and thread count in these records (`machine_slowdown`). `unstable`: the "
    "timed runs never reached an IQR within 10% of the median (or fewer than 4 samples) in the "
    "figure's time budget."
)


@dataclass
class Section:
    """One kind of table: formatted tables per group (Markdown) and the numbers behind them (CSV)."""

    name: str
    title: str
    note: str = ""
    parts: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    data: pd.DataFrame = field(default_factory=pd.DataFrame)


# ---------------------------------------------------------------------------------------------- helpers
def num(x: float) -> str:
    """About three significant digits without exponents for ordinary magnitudes (12.3, 0.0512, 1234)."""
    if x is None or not math.isfinite(x):
        return "n/a"
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}" if a >= 1e-3 or a == 0 else f"{x:.2e}"


def sci(x: float) -> str:
    """Scientific notation for errors (``7.4e-07``)."""
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.1e}"


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


def select(df: pd.DataFrame, all_measurements: bool = False) -> pd.DataFrame:
    """The rows tables show: the newest per configuration, or all with a ``run`` column to tell them apart."""
    if not all_measurements:
        return df[df["newest"]].copy()
    out = df.copy()
    run = out["sweep_dir"].astype(object).map(lambda s: Path(s).name if isinstance(s, str) and s else None)
    stamp = out["started_at"].dt.strftime("%Y-%m-%d %H:%M:%S").astype(object)
    out["run"] = run.where(run.notna(), stamp)
    # the same configuration twice in one sweep folder: the older ones get their own row, by start time
    twice = out.sort_values("started_at").duplicated([*CELL_KEYS, "run"], keep="last").reindex(out.index)
    out.loc[twice, "run"] = out.loc[twice, "run"].astype(str) + " @ " + stamp[twice].astype(str)
    return out


def length_axis(df: pd.DataFrame) -> str:
    """The tables' column axis: ``seq_len`` (N), or ``kv_len`` (Nk) where the key length takes more
    values than the query length (decode sweeps: Nq = 1 or 16 against Nk = 1k to 128k)."""
    if "kv_len" not in df:
        return "seq_len"
    nk = df["kv_len"].dropna().nunique()
    return "kv_len" if nk > 1 and nk >= df["seq_len"].nunique() else "seq_len"


def group_keys(df: pd.DataFrame) -> list[str]:
    """device, dtype, mode, then every other workload field that takes several values in ``df``
    (except the length axis; with the key length as the axis, the query length is a group key)."""
    axis = length_axis(df)
    extra = [c for c in GROUP_EXTRA if c in df and c != axis and df[c].astype(str).nunique(dropna=False) > 1]
    if axis == "kv_len" and df["seq_len"].nunique() > 1:
        extra.append("seq_len")
    if "tokens" in df and df["tokens"].notna().any():
        extra = [c for c in extra if c != "batch"]  # batch = tokens // N: it follows the length
    return GROUP_BASE + extra


def groups(df: pd.DataFrame, keys: list[str]) -> list[tuple[str, pd.DataFrame]]:
    """``(title, rows)`` per group, e.g. ``cpu · float32 · fwd · causal=True``."""
    out = []
    for vals, sub in df.groupby(keys, dropna=False, sort=True):
        vals = vals if isinstance(vals, tuple) else (vals,)
        parts = [str(v) for v in vals[: len(GROUP_BASE)]]
        named = zip(keys[len(GROUP_BASE) :], vals[len(GROUP_BASE) :], strict=True)
        parts += [f"{k.removeprefix('env_')}={value_text(k, v)}" for k, v in named]
        out.append((" · ".join(parts), sub))
    return out


def value_text(key: str, v: object) -> object:
    """A config value for a title; null kv_len / v_head_dim mean "the same as the queries'"."""
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return {"kv_len": "seq_len", "v_head_dim": "head_dim"}.get(key, "null")
    return v


def workload_line(df: pd.DataFrame) -> str:
    """The workload fields that are the same in every row, e.g. ``batch=1, heads=8, head_dim=64``."""
    same = []
    for c in [*WORKLOAD[3:], "seed"]:
        if c in df and len(df) and df[c].astype(str).nunique(dropna=False) == 1:
            if c == "tokens" and pd.isna(df[c].iloc[0]):
                continue  # no token budget: the batch is as given
            same.append(f"{c}={value_text(c, df[c].iloc[0])}")
    return ", ".join(same)


def _unique(cols: list[str]) -> list[str]:
    """``cols`` without repeats (``seq_len`` is a group key in decode sweeps), in order."""
    return list(dict.fromkeys(cols))


def _row_index(df: pd.DataFrame) -> list[str]:
    return ["variant", "run"] if "run" in df else ["variant"]


def pivot_cells(df: pd.DataFrame, cell: Callable[[pd.Series], str]) -> pd.DataFrame:
    """Variant x N (or x Nk, see :func:`length_axis`) table of ``cell(row)`` strings; missing
    combinations show ``NO_RECORD``."""
    if df.empty:
        return pd.DataFrame()
    axis = length_axis(df)
    long = df.assign(_cell=df.apply(cell, axis=1), _n=df[axis].astype("Int64"))
    long = long.sort_values("started_at", na_position="first")
    table = long.pivot_table(index=_row_index(df), columns="_n", values="_cell", aggfunc="last")
    table = table.reindex(sorted(table.columns), axis=1).fillna(NO_RECORD)
    label = "Nk" if axis == "kv_len" else "N"
    table.columns = [f"{label}={n}" for n in table.columns]
    table.columns.name = None
    return table.sort_index()


def status_cell(row: pd.Series) -> str | None:
    """What to show instead of a number, or None when the row's figures are usable."""
    if row["status"] != "ok":
        return str(row["status"])
    if is_false(row["valid"]):
        return "invalid"
    return None


def _value_cell(fmt: Callable[[pd.Series], str]) -> Callable[[pd.Series], str]:
    def cell(row: pd.Series) -> str:
        return status_cell(row) or fmt(row)

    return cell


def _numbers(df: pd.DataFrame, keys: list[str], cols: dict[str, pd.Series]) -> pd.DataFrame:
    """Long frame for CSV: identifying columns, status, and ``cols`` blanked where not usable."""
    ident = _unique([*keys, "variant", *(["run"] if "run" in df else []), "seq_len", "status", "valid"])
    out = df[ident + ["reason", "config_hash", "started_at", "path"]].copy()
    ok = usable(df)
    for name, values in cols.items():
        out[name] = values.where(ok)
    return out.sort_values(_unique([*keys, "variant", "seq_len"])).reset_index(drop=True)


# ---------------------------------------------------------------------------------------------- tables
def speed_table(df: pd.DataFrame) -> Section:
    """Median time of the row's mode (ms, with IQR) and GFLOP/s, variant x N, per group."""
    keys = group_keys(df)
    t = mode_times(df)
    sec = Section(
        "speed",
        "Speed",
        FLOPS_NOTE + " Time: median of the timed runs of the mode, in ms, with the interquartile range; "
        "IQR n/a = one timed block, so no spread was measured.",
    )
    df = df.assign(
        time_ms=t["time_s"] * 1e3,
        iqr_ms=t["iqr_s"] * 1e3,
        unstable=t["unstable"],
        cpu_per_wall=t["cpu_per_wall"],
    )
    both = df["mode"] == "fwd_bwd"
    rounds_min = _col(df, "fwd_bwd_rounds_min_s").where(both, _col(df, "fwd_rounds_min_s"))
    rounds_max = _col(df, "fwd_bwd_rounds_max_s").where(both, _col(df, "fwd_rounds_max_s"))
    if _col(df, "rounds").notna().any():
        sec.note += (
            " Measured in rounds: each time is the median of its rounds (leaving out rounds whose canary "
            "ran slow, `~`, when others did not), with that round's IQR; "
            "speed.csv gives the range across rounds (rounds_min_ms, rounds_max_ms)."
        )
    for title, sub in groups(df, keys):
        sec.parts.append(
            (f"{title}: median time, ms (IQR)", pivot_cells(sub, _value_cell(_time_text))),
        )
        has_roof = _col(sub, "roofline_gemm_flops_per_s").notna().any()
        sec.parts.append(
            (
                f"{title}: GFLOP/s" + (" (% of the same sweep's GEMM rate)" if has_roof else ""),
                pivot_cells(sub, _value_cell(_gflops_text)),
            ),
        )
        if _col(sub, "fwd_graph_median_s").notna().any():  # CUDA jobs with cuda_graph=true
            sec.parts.append(
                (
                    f"{title}: forward replayed as a CUDA graph (launch overhead removed), median ms",
                    pivot_cells(sub, _value_cell(lambda r: num(1e3 * r.get("fwd_graph_median_s", np.nan)))),
                ),
            )
    sec.data = _numbers(
        df,
        keys,
        {
            "time_ms": df["time_ms"],
            "iqr_ms": df["iqr_ms"],
            "unstable": df["unstable"],
            "q1_ms": t["q1_s"] * 1e3,
            "q3_ms": t["q3_s"] * 1e3,
            "graph_ms": _col(df, "fwd_graph_median_s") * 1e3,
            "rounds": _col(df, "rounds"),
            "rounds_min_ms": rounds_min * 1e3,
            "rounds_max_ms": rounds_max * 1e3,
            "gflops_per_s": _col(df, "gflops_per_s"),
            "pct_of_gemm": pct_of_gemm(df),
            "gemm_gflops_per_s": _col(df, "roofline_gemm_flops_per_s") / 1e9,
            "tokens_per_s": _col(df, "tokens_per_s"),
            "flops": _col(df, "flops"),
            "cpu_per_wall": df["cpu_per_wall"],
            "page_faults": t["page_faults"],
            "steal": t["steal"],
            "retimed": t["retimed"],
            "others_cpu_cores": _col(df, "others_cpu_cores"),
            "concurrent_jobs": _col(df, "concurrent_jobs"),
            "machine_slowdown": _col(df, "machine_slowdown"),
            "attempts": _col(df, "attempts"),
        },
    )
    if (pct_of_gemm(df) > 100).any():
        sec.note += (
            " A percentage above 100 (marked !): the machine ran faster during that job than when the "
            "sweep measured its GEMM rate, so that ceiling is too low (the sweep measures it again in "
            "the next job); where the machine's speed drifts, the percentages are approximate."
        )
    if (_col(df, "attempts") > 1).any():
        sec.note += (
            " Some jobs were measured again because a figure of their first attempt was unstable or "
            "its canary said the machine ran slow (retry_unstable); the times are the last attempt's, "
            "speed.csv counts them (attempts)."
        )
    return sec


def pct_of_gemm(df: pd.DataFrame) -> pd.Series:
    """Useful FLOP/s as a percentage of the GEMM FLOP/s measured in the same sweep (NaN without one)."""
    return 100 * _col(df, "gflops_per_s") * 1e9 / _col(df, "roofline_gemm_flops_per_s")


def _gflops_text(row: pd.Series) -> str:
    text = num(row.get("gflops_per_s", np.nan))
    pct = 100 * row.get("gflops_per_s", np.nan) * 1e9 / row.get("roofline_gemm_flops_per_s", np.nan)
    if pd.isna(pct):
        return text
    if pct > 100:  # above the ceiling measured in the same sweep: the note under the table says why
        return f"{text} ({pct:.0f}%!)"
    return f"{text} ({pct:.0f}%)" if pct >= 10 else f"{text} ({pct:.2g}%)"


def beside_work(row: pd.Series) -> bool:
    """A time measured beside other work (marked ``*``): other processes kept more than
    :data:`LOADED_CORES` busy, other jobs of the suite measured at the same time, or its threads were
    off their cores (:func:`_off_cores`)."""
    busy = pd.to_numeric(row.get("others_cpu_cores"), errors="coerce")
    beside = pd.to_numeric(row.get("concurrent_jobs"), errors="coerce")
    loaded = (pd.notna(busy) and busy > LOADED_CORES) or (pd.notna(beside) and beside > 0)
    return bool(loaded or _off_cores(row))


def slow_machine(row: pd.Series) -> bool:
    """A time measured while the machine ran slow (marked ``~``): its canary above ``SLOW_RATIO``."""
    return bool(pd.to_numeric(row.get("machine_slowdown"), errors="coerce") > SLOW_RATIO)


def _time_text(row: pd.Series) -> str:
    # one timed block (or one run) gives q1 == q3: printing 0 would read as "no noise at all"
    spread = "n/a" if row["iqr_ms"] == 0 else num(row["iqr_ms"])
    mark = " *" if beside_work(row) else ""
    if slow_machine(row):
        mark += " ~"
    if row.get("unstable") is True:
        mark += " unstable"
    return f"{num(row['time_ms'])} ({spread}){mark}"


def _off_cores(row: pd.Series) -> bool:
    """A CPU figure whose threads were on their cores less than :data:`ON_CORES` of its wall time."""
    threads = pd.to_numeric(row.get("fig_threads", row.get("threads")), errors="coerce")
    cpw = pd.to_numeric(row.get("cpu_per_wall"), errors="coerce")
    return row.get("device") == "cpu" and pd.notna(threads) and pd.notna(cpw) and cpw < ON_CORES * threads


def bandwidth_table(df: pd.DataFrame) -> Section:
    """Decoding (fewer queries than keys, forward): GB/s of the bytes a call must move (K/V cache, q,
    output, bias) and their share of the same sweep's copy bandwidth, variant x length, per group."""
    keys = group_keys(df)
    sec = Section(
        "bandwidth",
        "Bandwidth (decoding and prefill onto a cache)",
        "A forward call with fewer queries than keys is bound by the bytes it moves, not by FLOPs: it must "
        "read K and V (the cache, with its own number of heads), q and the bias and write the output. "
        "GB/s = those bytes / median forward time (GB = 1e9 bytes); the percentage divides by the copy "
        "bandwidth measured on the same device in the same sweep (bytes read + written per second). "
        "The bytes are full attention's: a pattern variant that reads only part of the cache (a window, "
        "sparse blocks) can pass 100%, which says it reads less, not that it moves bytes faster.",
    )
    nk = _col(df, "kv_len")
    dec = df[(nk > pd.to_numeric(df["seq_len"], errors="coerce")) & (df["mode"] == "fwd")]
    if "min_bytes" not in dec or dec.empty:
        return sec
    for title, sub in groups(dec, keys):
        sec.parts.append((f"{title}: GB/s (% of copy bandwidth)", pivot_cells(sub, _value_cell(_gbps_text))))
    sec.data = _numbers(
        dec,
        keys,
        {
            "min_bytes": _col(dec, "min_bytes"),
            "gbytes_per_s": _col(dec, "bytes_per_s") / 1e9,
            "pct_of_copy": pct_of_copy(dec),
            "copy_gbytes_per_s": _col(dec, "roofline_copy_bytes_per_s") / 1e9,
        },
    )
    return sec


def pct_of_copy(df: pd.DataFrame) -> pd.Series:
    """Bytes moved per second as a percentage of the same sweep's copy bandwidth (NaN without one)."""
    return 100 * _col(df, "bytes_per_s") / _col(df, "roofline_copy_bytes_per_s")


def _gbps_text(row: pd.Series) -> str:
    bps = pd.to_numeric(row.get("bytes_per_s", np.nan), errors="coerce")
    text = num(bps / 1e9)
    pct = 100 * bps / pd.to_numeric(row.get("roofline_copy_bytes_per_s", np.nan), errors="coerce")
    return text if pd.isna(pct) else f"{text} ({pct:.0f}%)"


def is_model_job(df: pd.DataFrame) -> pd.Series:
    """Rows of model jobs (``model=``: a transformers model end to end), not kernel or task jobs."""
    if "model" not in df:
        return pd.Series(False, index=df.index)
    return df["model"].map(lambda m: isinstance(m, str) and m not in ("", "null"))


def _model_title(row: pd.Series) -> str:
    m = json.loads(row["model"])
    return (
        f"{row['device']} · {row['dtype']} · Llama-style, {m.get('layers')} layers, width {m.get('hidden')}, "
        f"{m.get('heads')} heads / {m.get('kv_heads')} K/V heads, batch {m.get('batch')}: "
        f"prefill {m.get('prefill_len')} tokens, then {m.get('new_tokens')} decoded"
    )


def model_table(df: pd.DataFrame) -> Section:
    """Model jobs: prefill time, time per decoded token and peak memory per variant, per model."""
    sec = Section(
        "model",
        "A transformers model end to end",
        "Each variant as the attention of a random-weight Llama-style model (Hugging Face transformers, "
        "through attn_implementation='attnbench_<name>'). Prefill: median of 3 forwards of the prompt "
        "into an empty cache; decode: median time of one greedy step (one token against the cache). "
        "Peak: CUDA allocator peak, or on the CPU the process high-water mark during the run (weights, "
        "cache and allocator slack included: an upper bound).",
    )
    rows = df[is_model_job(df)]
    if rows.empty:
        return sec
    rows = rows.assign(_title=rows.apply(_model_title, axis=1))
    cols = {"prefill ms": "prefill_ms", "ms / decoded token": "decode_ms_per_token", "peak MiB": "peak_mib"}
    for title, sub in rows.groupby("_title", sort=True):
        sub = sub.sort_values("started_at").groupby("variant").tail(1).set_index("variant").sort_index()
        tab = pd.DataFrame(index=sub.index)
        for name, col in cols.items():
            tab[name] = [
                status_cell(r) or num(pd.to_numeric(r.get(col), errors="coerce")) for _, r in sub.iterrows()
            ]
        sec.parts.append((title, tab))
    sec.data = rows.drop(columns="_title")[
        ["device", "dtype", "model", "variant", "status", "reason", *cols.values(), "config_hash", "path"]
    ].reset_index(drop=True)
    return sec


def memory_table(df: pd.DataFrame) -> Section:
    """Peak memory (MiB above the inputs) during one call of the mode, variant x N, per group."""
    keys = group_keys(df)
    sec = Section(
        "memory",
        "Memory",
        "Peak memory allocated during one call of the mode, above the inputs (MiB = 2^20 bytes).",
    )
    for title, sub in groups(df, keys):
        cells = pivot_cells(sub, _value_cell(lambda r: num(r.get("peak_mib", np.nan))))
        sec.parts.append((f"{title}: peak MiB", cells))
    sec.data = _numbers(df, keys, {"peak_mib": _col(df, "peak_mib"), "peak_bytes": _col(df, "peak_bytes")})
    return sec


def accuracy_table(df: pd.DataFrame) -> Section:
    """Relative error against the float64 oracle; for approximate variants, deviation from full attention.

    Relative error = max |out - ref| / max |ref| over the checked query rows. A job whose check
    failed shows its error marked ``FAIL`` (the error is the evidence, not an invalid figure).
    """
    keys = group_keys(df)
    sec = Section(
        "accuracy",
        "Accuracy",
        "Relative error = max |out − ref| / max |ref|. `vs oracle`: against float64 attention over the "
        "variant's own pattern (is it computed right?). `vs full`: approximate variants against float64 "
        "full attention (how far is the approximation?). FAIL = above the dtype's tolerance.",
    )

    def err_cell(col: str) -> Callable[[pd.Series], str]:
        def cell(row: pd.Series) -> str:
            if row["status"] != "ok":
                return str(row["status"])
            v = pd.to_numeric(row.get(col, np.nan), errors="coerce")
            if pd.isna(v):
                return "n/a"
            return f"FAIL {sci(v)}" if status_cell(row) == "invalid" else sci(v)

        return cell

    for title, sub in groups(df, keys):
        sec.parts.append((f"{title}: rel. error vs oracle", pivot_cells(sub, err_cell("out_rel_err"))))
        approx = sub[sub["exact"].map(is_false).astype(bool)]
        if "dev_full_rel_err" in sub and len(approx):
            sec.parts.append(
                (
                    f"{title}: rel. deviation vs full attention",
                    pivot_cells(approx, err_cell("dev_full_rel_err")),
                )
            )
        if "grad_rel_err" in sub and sub["grad_rel_err"].notna().any():
            sec.parts.append(
                (f"{title}: gradient rel. error vs oracle", pivot_cells(sub, err_cell("grad_rel_err")))
            )
    cols = ["out_rel_err", "out_max_err", "out_mean_err", "out_scale", "dev_full_rel_err", "grad_rel_err"]
    ident = _unique(
        [*keys, "variant", *(["run"] if "run" in df else []), "seq_len", "status", "valid", "exact"]
    )
    data = df[ident].copy()
    for c in cols:
        data[c] = _col(df, c).where(df["status"] == "ok")
    sec.data = data.sort_values(_unique([*keys, "variant", "seq_len"])).reset_index(drop=True)
    return sec


def fit_exponent(n: np.ndarray | list[float], y: np.ndarray | list[float]) -> tuple[float, float]:
    """Least-squares slope of ``log y`` against ``log n`` and its R² (in log space).

    ``y ~ c * n^k`` gives ``k``: about 1 for linear growth, 2 for quadratic. Needs at least two
    distinct ``n`` and positive ``y``; raises ``ValueError`` otherwise.
    """
    x = np.log(np.asarray(n, dtype=float))
    z = np.log(np.asarray(y, dtype=float))
    if x.size < 2 or np.ptp(x) == 0 or not np.all(np.isfinite(x)) or not np.all(np.isfinite(z)):
        raise ValueError("need at least two distinct n and positive, finite y")
    slope, intercept = np.polyfit(x, z, 1)
    ss_res = float(np.sum((z - (slope * x + intercept)) ** 2))
    ss_tot = float(np.sum((z - z.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0  # constant y: a flat line fits exactly
    return float(slope), r2


#: fewest lengths for which a fit's R² is given: through two lengths the line fits exactly
MIN_R2_LENGTHS = 3


def scaling_fits(df: pd.DataFrame) -> pd.DataFrame:
    """Per group and variant: exponents of time and of peak memory against N (or Nk, see
    :func:`length_axis`), R² (NaN below :data:`MIN_R2_LENGTHS` lengths), length range, points."""
    keys = group_keys(df)
    axis = length_axis(df)
    ok = df[usable(df)].assign(time_s=mode_times(df)["time_s"], peak=_col(df, "peak_mib"), _n=_col(df, axis))
    rows = []
    for vals, sub in ok.groupby([*keys, "variant"], dropna=False, sort=True):
        row = dict(zip([*keys, "variant"], vals, strict=True))
        for what, col in (("time", "time_s"), ("memory", "peak")):
            pts = sub[sub[col] > 0]  # log needs positive values; a zero peak is "below resolution"
            try:
                row[f"{what}_exponent"], row[f"{what}_r2"] = fit_exponent(pts["_n"], pts[col])
            except ValueError:
                row[f"{what}_exponent"] = row[f"{what}_r2"] = np.nan
            row[f"{what}_points"] = int(pts["_n"].nunique())
            if row[f"{what}_points"] < MIN_R2_LENGTHS:  # a line through two points always has R² = 1
                row[f"{what}_r2"] = np.nan
            row[f"{what}_n_min"] = pts["_n"].min() if len(pts) else pd.NA
            row[f"{what}_n_max"] = pts["_n"].max() if len(pts) else pd.NA
        rows.append(row)
    return pd.DataFrame(rows)


def scaling_table(df: pd.DataFrame) -> Section:
    """Fitted exponents of time and memory against N per variant (log-log least squares)."""
    keys = group_keys(df)
    sec = Section(
        "scaling",
        "Scaling with N",
        "Exponent k of a least-squares fit of log(y) = k·log(N) + c over the N where the job ran and "
        "passed its check: k ≈ 1 is linear, k ≈ 2 quadratic. R² is the fit's in log space, given for fits "
        "over 3 or more lengths (a fit through two is the slope between them, and exact). At small N "
        "fixed overheads flatten the curve, so k is underestimated there; read it with its N range.",
    )
    fits = scaling_fits(df)
    sec.data = fits
    if fits.empty:
        return sec
    for title, sub in groups(fits, keys):
        tab = pd.DataFrame(
            {
                "time exponent": [_exp_text(r, "time") for _, r in sub.iterrows()],
                "time R²": [_r2_text(r["time_r2"]) for _, r in sub.iterrows()],
                "memory exponent": [_exp_text(r, "memory") for _, r in sub.iterrows()],
                "memory R²": [_r2_text(r["memory_r2"]) for _, r in sub.iterrows()],
                "fitted on N": [_range_text(r) for _, r in sub.iterrows()],
            },
            index=pd.Index(sub["variant"], name="variant"),
        )
        if sub[["time_r2", "memory_r2"]].isna().all(axis=None):  # no fit with an R² that says anything
            tab = tab.drop(columns=["time R²", "memory R²"])
        sec.parts.append((f"{title}: exponent of time and peak memory vs N", tab))
    return sec


def _exp_text(row: pd.Series, what: str) -> str:
    if pd.isna(row[f"{what}_exponent"]):
        return f"n/a ({row[f'{what}_points']} length{'s' if row[f'{what}_points'] != 1 else ''})"
    return f"{row[f'{what}_exponent']:.2f}"


def _r2_text(r2: float) -> str:
    return "n/a" if pd.isna(r2) else f"{r2:.3f}"


def _range_text(row: pd.Series) -> str:
    if pd.isna(row["time_n_min"]):
        return "n/a"
    if row["time_points"] == 1:
        return f"{row['time_n_min']} (1 length)"
    return f"{row['time_n_min']}–{row['time_n_max']} ({row['time_points']} lengths)"


def status_table(df_all: pd.DataFrame, shown: pd.DataFrame) -> Section:
    """Count by status over the whole store, and every shown job that did not run (or failed its
    check) with its reason and the lengths it concerns."""
    sec = Section("status", "Status: what did not run and why")
    counts = status_counts(df_all).rename_axis("status").to_frame()
    sec.parts.append(("records in the store, by status (all measurements)", counts))
    bad = shown[(shown["status"] != "ok") | is_invalid(shown)].copy()
    keys = group_keys(shown) if len(shown) else GROUP_BASE
    if len(bad):
        bad["status"] = bad["status"].where(~is_invalid(bad), "ok (invalid)")
        bad["reason"] = bad["reason"].astype(object).fillna("(no reason recorded)")
        axis = length_axis(shown)  # the lengths listed: N, or Nk in a decode sweep
        agg = (
            bad.groupby([*keys, "variant", "status", "reason"], dropna=False, sort=True)[axis]
            .agg(lambda s: ", ".join(str(int(n)) for n in sorted(set(s.dropna()))))
            .reset_index()
        )
        agg["where"] = _titles(agg, keys)
        tab = agg.set_index(["where", "variant"])[["status", axis, "reason"]]
        tab.columns = ["status", "Nk" if axis == "kv_len" else "N", "reason"]
        sec.parts.append(("jobs without usable figures (newest measurement of each configuration)", tab))
    else:
        sec.note = "Every shown job ran and passed its correctness check."
    sec.data = shown[
        _unique([*keys, "variant", "seq_len", "status", "valid", "reason", "config_hash", "path"])
    ]
    return sec


def _titles(df: pd.DataFrame, keys: list[str]) -> list[str]:
    """Group title of each row of ``df`` (the same text :func:`groups` uses)."""
    titles = pd.Series("", index=df.index, dtype=object)
    for title, sub in groups(df, keys):
        titles[sub.index] = title
    return list(titles)


#: a speedup within this fraction of 1 is within noise whatever the two runs' spreads say: their
#: quartiles describe the calls of one process, and the same job run again later on this project's
#: 2-core VM moved by more than that (README, "Repeatable CPU timings")
NOISE_FLOOR = 0.05


def noise_verdict(row: pd.Series) -> str:
    """Whether a compared cell's difference is outside the two runs' own noise: ``slow machine`` when
    either run's canary says its machine ran slow (``machine_slowdown`` above ``SLOW_RATIO``: the
    difference may be the machine's), ``within noise`` when the two runs' quartile ranges of the time
    overlap or the speedup is within :data:`NOISE_FLOOR` of 1, else ``faster`` or ``slower``."""
    slow = [pd.to_numeric(row.get(c), errors="coerce") for c in ("machine_slowdown", "machine_slowdown_base")]
    if any(s > SLOW_RATIO for s in slow):
        return "slow machine"
    q1, q3, q1b, q3b = (
        pd.to_numeric(row.get(c), errors="coerce") for c in ("q1_s", "q3_s", "q1_s_base", "q3_s_base")
    )
    overlap = pd.notna(q1) and pd.notna(q1b) and max(q1, q1b) <= min(q3, q3b)
    if overlap or abs(row["speedup"] - 1) <= NOISE_FLOOR:
        return "within noise"
    return "faster" if row["speedup"] > 1 else "slower"


#: the mark a speedup cell carries for each :func:`noise_verdict`
VERDICT_MARK = {"within noise": " ≈", "slow machine": " ~", "faster": "", "slower": ""}


def baseline_table(cur: pd.DataFrame, base: pd.DataFrame) -> Section:
    """Speedup (baseline time / this time) and memory ratio (this / baseline) per variant x N, each
    speedup with its :func:`noise_verdict`, and a count of the verdicts in the note.

    Rows are matched on the workload, the variant and N (not on the host: comparing machines is the
    point); each side uses its newest measurement. ``>1x`` speedup means this set is faster.
    """
    sec = Section(
        "baseline",
        "Against the baseline",
        "speedup = baseline time / this time (>1: faster now); memory = this peak / baseline peak "
        "(<1: less now). `≈`: within the two runs' noise (their time quartiles overlap, or within "
        f"{NOISE_FLOOR:.0%}); `~`: one of the two ran while its machine was slow (its canary), not "
        "compared. " + env_diff(cur, base),
    )
    cur = cur[cur["newest"]] if "newest" in cur else cur
    cur, base = _newest_by_match(cur), _newest_by_match(base)
    cols = [
        "status",
        "valid",
        "time_s",
        "q1_s",
        "q3_s",
        "machine_slowdown",
        "peak_mib",
        "variant",
        "env_host",
    ]

    def with_times(df: pd.DataFrame) -> pd.DataFrame:
        t = mode_times(df)
        return df.assign(
            time_s=t["time_s"], q1_s=t["q1_s"], q3_s=t["q3_s"], peak_mib=_col(df, "peak_mib"),
            machine_slowdown=_col(df, "machine_slowdown"),
        )  # fmt: skip

    cur, base = with_times(cur), with_times(base)
    m = cur[MATCH_KEYS + cols].merge(
        base[MATCH_KEYS + cols], on=MATCH_KEYS, how="left", suffixes=("", "_base"), indicator=True
    )
    m["started_at"] = pd.NaT
    ok_now = usable(m)
    ok_base = (m["status_base"] == "ok") & ~m["valid_base"].map(is_false).astype(bool)
    both = ok_now & ok_base
    m["speedup"] = (m["time_s_base"] / m["time_s"]).where(both)
    m["memory_ratio"] = (m["peak_mib"] / m["peak_mib_base"]).where(both)
    m["verdict"] = m.apply(lambda r: noise_verdict(r) if pd.notna(r["speedup"]) else None, axis=1)

    def ratio_cell(col: str) -> Callable[[pd.Series], str]:
        def cell(row: pd.Series) -> str:
            if row["_merge"] == "left_only":
                return "no baseline"
            now = status_cell(row)
            if now:
                return now
            if row["status_base"] != "ok":
                return f"{row['status_base']} (baseline)"
            if is_false(row["valid_base"]):
                return "invalid (baseline)"
            if pd.isna(row[col]):
                return "n/a"
            mark = VERDICT_MARK.get(row["verdict"], "") if col == "speedup" else ""
            return f"{row[col]:.2f}x{mark}"

        return cell

    keys = group_keys(m)
    unmatched = []
    for title, sub in groups(m, keys):
        if (sub["_merge"] == "left_only").all():  # a whole table of "no baseline" says nothing
            unmatched.append(title)
            continue
        sec.parts.append((f"{title}: speedup vs baseline", pivot_cells(sub, ratio_cell("speedup"))))
        sec.parts.append((f"{title}: memory vs baseline", pivot_cells(sub, ratio_cell("memory_ratio"))))
    if unmatched:
        sec.note += f" No baseline record at all for: {'; '.join(unmatched)}."
    sec.note = f"{verdict_summary(m['verdict'])}. " + sec.note
    sec.data = m.drop(columns=["_merge", "started_at"])
    return sec


def verdict_summary(verdicts: pd.Series) -> str:
    """``3 faster, 1 slower, 5 within noise, 2 on a slow machine (of 11 compared)``."""
    n = verdicts.value_counts()
    parts = [
        f"{n.get('faster', 0)} faster",
        f"{n.get('slower', 0)} slower",
        f"{n.get('within noise', 0)} within noise",
    ]
    if n.get("slow machine", 0):
        parts.append(f"{n['slow machine']} on a slow machine")
    return ", ".join(parts) + f" (of {int(n.sum())} compared)"


def _newest_by_match(df: pd.DataFrame) -> pd.DataFrame:
    """The newest row per workload, variant and N, whatever machine measured it."""
    return df.sort_values("started_at").groupby(MATCH_KEYS, dropna=False).tail(1)


def env_diff(cur: pd.DataFrame, base: pd.DataFrame) -> str:
    """What differs between two sets' environments (host, CPU, GPU, torch, commit), as one sentence."""
    fields = ["env_host", "env_cpu_model", "env_gpu_name", "env_torch", "env_cuda", "env_git_commit"]
    diffs = []
    for f in fields:
        a = sorted(cur[f].dropna().astype(str).unique()) if f in cur else []
        b = sorted(base[f].dropna().astype(str).unique()) if f in base else []
        if a != b:
            diffs.append(
                f"{f.removeprefix('env_')}: {', '.join(a) or '?'} (this) vs {', '.join(b) or '?'} (baseline)"
            )
    return (
        ("Differences: " + "; ".join(diffs) + ".") if diffs else "The two sets report the same environment."
    )


# ---------------------------------------------------------------------------------------------- output
LEFT_COLUMNS = ("status", "N", "reason", "task")


def markdown(table: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table of ``table`` (index levels become the first columns).

    Index columns and text columns (status, reason, lists of N) are left-aligned, figures right.
    """
    flat = table.reset_index()
    head = [str(c) for c in flat.columns]
    rows = [
        ["" if pd.isna(v) else str(v).replace("|", "\\|") for v in r] for r in flat.itertuples(index=False)
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    n_idx = table.index.nlevels
    left = [i < n_idx or h in LEFT_COLUMNS for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if lf else c.rjust(w) for c, w, lf in zip(cells, widths, left, strict=True))
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|" + "|".join("-" * (w + 1) + ("-" if lf else ":") for w, lf in zip(widths, left, strict=True)) + "|"
    )
    return "\n".join([line(head), rule, *(line(r) for r in rows)])


def render(sec: Section) -> str:
    """A section as Markdown: its title, note and each table under a bold heading."""
    out = [f"## {sec.title}", ""]
    if sec.note:
        out += [sec.note, ""]
    for heading, tab in sec.parts:
        if tab.empty:
            continue
        out += [f"**{heading}**", "", markdown(tab), ""]
    return "\n".join(out)
