"""The kernel jobs' section: speed, bandwidth, memory, accuracy, scaling and status tables.

Every table is grouped by device, dtype and mode (and by any other workload field that varies in the
data, e.g. causal or the host), with one row per variant and one column per sequence length N. A cell
that has no number says why: the job's status (``oom``, ``unsupported``, ...), ``invalid`` when the
correctness check failed (its time and memory are not shown), ``–`` when no job was run there.
Each :class:`~experiments.report.format.Section` holds the formatted tables (for Markdown) and a long
numeric frame (for CSV).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd

from ..measure.canary import SLOW_RATIO
from ..records.rounds import numeric as _col
from ..records.store import is_false, is_true, status_counts
from .format import Section, num, sci
from .grouping import (
    GROUP_BASE,
    LOADED_CORES,
    NO_RECORD,
    ON_CORES,
    group_keys,
    groups,
    is_invalid,
    key_frame,
    length_axis,
    lengths,
    marks,
    mode_times,
    pivot_cells,
    status_cell,
    usable,
)

FLOPS_NOTE = (
    "FLOPs count the useful (query, key) pairs each variant lets interact (2·D + 2·Dv per pair forward, "
    "backward 2.5x forward; FlashAttention convention), not the work a blocked kernel actually does; "
    "a form without pairs (linear, performer, retention, window_linear's far part, linformer, nystrom, "
    "the gated recurrences) counts its own algorithm's products, chunked where it runs in chunks. "
    "The percentage beside GFLOP/s divides by the FLOP/s of a large matrix multiply in the same dtype, "
    "measured on the same device in the same sweep (the record's roofline); on a CPU, half-precision "
    "inputs take the faster of their own GEMM and float32's, which CPU kernels compute them in (the "
    "header names the GEMM's dtype where it differs)."
)
#: how to read the tables' cells (the report's header)
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


def _unique(cols: list[str]) -> list[str]:
    """``cols`` without repeats (``seq_len`` is a group key in decode sweeps), in order."""
    return list(dict.fromkeys(cols))


def _value_cell(fmt: Callable[[pd.Series], str]) -> Callable[[pd.Series], str]:
    def cell(row: pd.Series) -> str:
        return status_cell(row) or fmt(row)

    return cell


def _numbers(df: pd.DataFrame, keys: list[str], cols: dict[str, pd.Series]) -> pd.DataFrame:
    """Long frame for CSV: identifying columns, status, and ``cols`` blanked where not usable."""
    # the key length tells decoding rows apart (their N is the queries per call)
    nk = ["kv_len"] if length_axis(df) == "kv_len" else []
    ident = _unique([*keys, "variant", *(["run"] if "run" in df else []), "seq_len", *nk, "status", "valid"])
    out = df[ident + ["reason", "config_hash", "started_at", "path"]].copy()
    ok = usable(df)
    for name, values in cols.items():
        out[name] = values.where(ok)
    return out.sort_values(_unique([*keys, "variant", "seq_len", *nk])).reset_index(drop=True)


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
            " A percentage above 100 (marked !): either the machine ran faster during that job than "
            "when the sweep measured its GEMM rate (the sweep measures it again in the next job), or the "
            "kernel outruns the GEMM that measures the ceiling, which is PyTorch's matrix multiply, not "
            "the core's nominal peak (the suite's C pattern kernel runs at up to 1.2x PyTorch's fp32 GEMM "
            "on an AMD Zen 5 core); where the machine's speed drifts, the percentages are approximate."
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


def _time_text(row: pd.Series) -> str:
    # one timed block (or one run) gives q1 == q3: printing 0 would read as "no noise at all"
    spread = "n/a" if row["iqr_ms"] == 0 else num(row["iqr_ms"])
    return f"{num(row['time_ms'])} ({spread}){marks(row)}"


def bandwidth_table(df: pd.DataFrame) -> Section:
    """Decoding (fewer queries than keys, forward): GB/s of the bytes a call must move (K/V cache, q,
    output, bias) and their share of the same sweep's copy bandwidth, variant x length, per group."""
    keys = group_keys(df)
    sec = Section(
        "bandwidth",
        "Bandwidth (decoding and prefill onto a cache)",
        "A forward call with fewer queries than keys must read K and V (the cache, with its own number "
        "of heads), q and the bias and write the output. GB/s = those bytes / median forward time (GB = "
        "1e9 bytes); the percentages divide by the copy bandwidth (bytes read + written per second) and "
        "the read bandwidth (a sum over a large tensor: a decode's true ceiling) measured on the same "
        "device in the same sweep. With many query heads per K/V head a decode also does 2 FLOPs per "
        "cached element per query head (a multiply-add), and on a CPU that can be the tighter bound: "
        "the data's `roofline_ms` is the larger of FLOPs / GEMM rate and bytes / read rate, `bound` "
        "says which, and `pct_of_roofline` is that time over the measured one. The bytes are full "
        "attention's: a pattern variant that reads only part of the cache (a window, sparse blocks) can "
        "pass 100%, which says it reads less, not that it moves bytes faster.",
    )
    nk = _col(df, "kv_len")
    dec = df[(nk > pd.to_numeric(df["seq_len"], errors="coerce")) & (df["mode"] == "fwd")]
    if "min_bytes" not in dec or dec.empty:
        return sec
    # a GB/s is a forward time's: it carries that time's marks, as the speed table shows them
    fwd = mode_times(dec)
    dec = dec.assign(cpu_per_wall=fwd["cpu_per_wall"], unstable=fwd["unstable"])
    if dec.get("roofline_read_op", pd.Series(dtype=object)).notna().any():  # recorded since 2026-11-27
        sec.note = sec.note.replace(
            "(a sum over a large tensor:",
            "(the faster of a sum and a matrix-vector product over a large tensor, `roofline_read_op` in the "
            "data:",
        )
    # on CUDA a decode step's eager time is mostly the host's launches; the CUDA-graph replay (taken in
    # fwd mode) is what a serving loop that captures its step sees, so its GB/s is shown beside
    graph_bps = _col(dec, "min_bytes") / _col(dec, "fwd_graph_median_s")
    has_graph = graph_bps.notna().any()
    cached = in_cache(dec)
    if cached.any():
        mib = sorted({f"{b / 2**20:g} MiB" for b in _col(dec, "cache_bytes")[cached]})
        sec.note += (
            f" `in cache`: the bytes fit in the CPU's last-level cache ({', '.join(mib)}), so the timed "
            "calls, repeated back to back, read them from it: that GB/s is the cache's and can pass the "
            "read bandwidth (measured over 512 MiB). A model's decode, whose other layers pass through "
            "the cache between two calls of one layer, reads memory: judge it at lengths past the cache."
        )
    for title, sub in groups(dec, keys):
        sec.parts.append(
            (f"{title}: GB/s (% of copy / % of read bandwidth)", pivot_cells(sub, _value_cell(_gbps_text)))
        )
        if graph_bps.loc[sub.index].notna().any():  # this group's device replayed its calls (CUDA)
            # the replay's time, same cells, with the replay's own flags
            graph = sub.assign(
                bytes_per_s=graph_bps.loc[sub.index],
                cpu_per_wall=_col(sub, "fwd_graph_cpu_per_wall"),
                unstable=_flag(sub, "fwd_graph_unstable"),
            )
            sec.parts.append(
                (
                    f"{title}: GB/s with the forward replayed as a CUDA graph (% of copy / % of read)",
                    pivot_cells(graph, _value_cell(_gbps_text)),
                )
            )
    if has_graph:
        sec.note += (
            " On CUDA an eager decode call is mostly the host's kernel launches (a split-K decode "
            "launches several kernels, a tenth of a millisecond of work): the second table times the "
            "forward replayed as a CUDA graph, as a serving loop that captures its decode step runs it."
        )
    graph_cols = (
        {
            "graph_gbytes_per_s": graph_bps / 1e9,
            "graph_pct_of_copy": 100 * graph_bps / _col(dec, "roofline_copy_bytes_per_s"),
        }
        if has_graph
        else {}
    )
    sec.data = _numbers(
        dec,
        keys,
        {
            "min_bytes": _col(dec, "min_bytes"),
            "gbytes_per_s": _col(dec, "bytes_per_s") / 1e9,
            "pct_of_copy": pct_of_copy(dec),
            "copy_gbytes_per_s": _col(dec, "roofline_copy_bytes_per_s") / 1e9,
            "pct_of_read": 100 * _col(dec, "bytes_per_s") / _col(dec, "roofline_read_bytes_per_s"),
            "read_gbytes_per_s": _col(dec, "roofline_read_bytes_per_s") / 1e9,
            "in_cache": in_cache(dec),
            **graph_cols,
            **decode_roofline(dec),
        },
    )
    return sec


def decode_roofline(df: pd.DataFrame) -> dict[str, pd.Series]:
    """Per row: ``roofline_ms``, the larger of the time its FLOPs take at the sweep's GEMM rate and the
    time its bytes take at the sweep's read bandwidth; ``bound`` ("compute" or "memory"), which one;
    ``pct_of_roofline``, that time over the measured forward time (NaN where a ceiling is missing)."""
    compute_s = _col(df, "flops") / _col(df, "roofline_gemm_flops_per_s")
    memory_s = _col(df, "min_bytes") / _col(df, "roofline_read_bytes_per_s")
    floor_s = np.fmax(compute_s, memory_s).where(compute_s.notna() & memory_s.notna())
    bound = pd.Series(np.where(compute_s > memory_s, "compute", "memory"), index=df.index).where(
        floor_s.notna()
    )
    return {
        "roofline_ms": floor_s * 1e3,
        "bound": bound,
        "pct_of_roofline": 100 * floor_s / _col(df, "fwd_median_s"),
    }


def pct_of_copy(df: pd.DataFrame) -> pd.Series:
    """Bytes moved per second as a percentage of the same sweep's copy bandwidth (NaN without one)."""
    return 100 * _col(df, "bytes_per_s") / _col(df, "roofline_copy_bytes_per_s")


def in_cache(df: pd.DataFrame) -> pd.Series:
    """Per row: whether the bytes a call must move fit in the CPU's last-level cache (``cache_bytes``,
    recorded by CPU jobs), so the repeated timed calls read them from it, not from memory."""
    return (_col(df, "min_bytes") <= _col(df, "cache_bytes")).fillna(False)


def _gbps_text(row: pd.Series) -> str:
    bps = pd.to_numeric(row.get("bytes_per_s", np.nan), errors="coerce")
    text = num(bps / 1e9)
    pct = 100 * bps / pd.to_numeric(row.get("roofline_copy_bytes_per_s", np.nan), errors="coerce")
    cached = " in cache" if bool(in_cache(row.to_frame().T).iloc[0]) else ""
    if pd.isna(pct):
        return text + marks(row) + cached
    read = 100 * bps / pd.to_numeric(row.get("roofline_read_bytes_per_s", np.nan), errors="coerce")
    text = f"{text} ({pct:.0f}%)" if pd.isna(read) else f"{text} ({pct:.0f}% / {read:.0f}%)"
    return text + marks(row) + cached


def _flag(df: pd.DataFrame, col: str) -> pd.Series:
    """A figure's boolean flag (``<fig>_unstable``) per row: True only where recorded True."""
    if col not in df:
        return pd.Series(False, index=df.index)
    return df[col].map(is_true).astype(bool)


def decode_table(df: pd.DataFrame) -> Section:
    """Decoding (causal, fewer queries than keys, forward): time per new token and the bytes one
    sequence keeps per layer, variant x context length, per group; only for records that carry
    ``state_bytes`` (written since it was measured)."""
    keys = group_keys(df)
    sec = Section(
        "decode",
        "Decoding: time per token and the state it keeps",
        "Time per new token: a variant with a fixed-size state (supports_state) is timed through its "
        "decoding step on a state prefilled with the context (`step_median_s`); the others through "
        "their forward over the K/V cache (`fwd_median_s`); both divided by the queries per call. "
        "`forward, no step`: a state variant whose step was not timed (with padding the newest keys are "
        "the padded ones), shown by its forward over the whole context, which a decode never runs. "
        "State: the bytes one sequence keeps per layer (`state_bytes`: the K/V cache, which grows with "
        "the context, or the fixed-size state), MiB = 2^20 bytes.",
    )
    dec = decode_rows(df)
    if dec.empty:
        return sec
    if left_out := decode_left_out(df):  # a store that mixes records from before state_bytes
        sec.note += f" Not shown: {left_out} (their times are in the Speed and Bandwidth tables)."
    per_token = dec["ms_per_token"] / 1e3
    has_graph = dec["graph_ms_per_token"].notna().any()

    def cell(row: pd.Series) -> str:
        graph = "" if pd.isna(row["graph_ms_per_token"]) else f", graph {num(row['graph_ms_per_token'])}"
        forward = " forward, no step" if isinstance(row.get("step_skipped"), str) else ""
        return f"{num(row['ms_per_token'])} ms{forward}{marks(row)}{graph} ({num(row['state_mib'])} MiB)"

    for title, sub in groups(dec, keys):
        graphed = sub["graph_ms_per_token"].notna().any()  # this group's device replayed its calls (CUDA)
        what = "ms per token, eager and replayed as a CUDA graph" if graphed else "ms per token"
        sec.parts.append((f"{title}: {what} (state MiB)", pivot_cells(sub, _value_cell(cell))))
    if has_graph:
        sec.note += (
            " `graph`: the forward replayed as a CUDA graph, without the host's launches, as a serving "
            "loop that captures its decode step runs it; on a GPU a decode call's eager time is mostly "
            "those launches."
        )
    graph_col = {"graph_s_per_token": dec["graph_ms_per_token"] / 1e3} if has_graph else {}
    sec.data = _numbers(
        dec,
        keys,
        {
            "s_per_token": per_token,
            **graph_col,
            "state_bytes": _col(dec, "state_bytes"),
            "stepped": _col(dec, "step_median_s").notna(),
        },
    )
    return sec


def _decoding(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of decoding calls: causal, fewer queries than keys, forward (``df`` has ``kv_len``)."""
    nk, nq = _col(df, "kv_len"), _col(df, "seq_len")
    causal = df["causal"].map(lambda c: c is True or c == "True")
    return df[(nk > nq) & (df["mode"] == "fwd") & causal]


def decode_left_out(df: pd.DataFrame) -> str:
    """``3 decoding record(s) of naive, sdpa, written before records carried `state_bytes```: the ok
    decoding records that :func:`decode_rows` leaves out for want of ``state_bytes``, so that a table or
    plot of a store mixing old and new records says whose rows are missing; empty when none is."""
    if "kv_len" not in df:
        return ""
    older = _decoding(df)
    older = older[(older["status"] == "ok") & _col(older, "state_bytes").isna()]
    if older.empty:
        return ""
    names = ", ".join(sorted(set(older["variant"])))
    return f"{len(older)} decoding record(s) of {names}, written before records carried `state_bytes`"


def decode_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The decoding rows (causal, fewer queries than keys, forward) of records that carry
    ``state_bytes``, with ``ms_per_token`` (the step where it was timed, else the forward over the
    cache, over the queries per call), ``graph_ms_per_token`` (that forward replayed as a CUDA graph,
    where it was: NaN on the CPU and for a timed step), ``state_mib``, and the ``cpu_per_wall`` and
    ``unstable`` of the figure ``ms_per_token`` is (the step's where it was timed), for its marks;
    empty for a sweep without them."""
    if "state_bytes" not in df or "kv_len" not in df:
        return df.iloc[:0]
    dec = _decoding(df)
    dec = dec[_col(dec, "state_bytes").notna() | (dec["status"] != "ok")]
    call = _col(dec, "fwd_median_s")
    stepped = _col(dec, "step_median_s").notna()
    graph = _col(dec, "fwd_graph_median_s").where(~stepped)
    if "step_median_s" in dec:
        call = _col(dec, "step_median_s").fillna(call)
    # a step's time carries the step's own flags (its core share, its stability), not the forward's
    fwd = mode_times(dec)
    return dec.assign(
        ms_per_token=call * 1e3 / _col(dec, "seq_len"),
        graph_ms_per_token=graph * 1e3 / _col(dec, "seq_len"),
        state_mib=_col(dec, "state_bytes") / 2**20,
        cpu_per_wall=_col(dec, "step_cpu_per_wall").where(stepped, fwd["cpu_per_wall"]),
        unstable=_flag(dec, "step_unstable").where(stepped, fwd["unstable"].astype(bool)),
    )


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
        "full attention (how far is the approximation?). FAIL = above the dtype's tolerance, over the "
        "whole output or in its worst row (accuracy.csv's `out_row_rel_err`: each row's error over its "
        "own scale; records since 2026-11-27), or in a decoding step's output (`step_rel_err`: the "
        "step on a prefilled state against the same oracle rows; records since 2026-11-28).",
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
        for col, what in (("grad_rel_err", "gradient"), ("step_rel_err", "decoding step")):
            if col in sub and sub[col].notna().any():
                sec.parts.append((f"{title}: {what} rel. error vs oracle", pivot_cells(sub, err_cell(col))))
    cols = [
        "out_rel_err",
        "out_row_rel_err",
        "out_max_err",
        "out_mean_err",
        "out_scale",
        "dev_full_rel_err",
        "grad_rel_err",
        "grad_row_rel_err",
        "step_rel_err",
        "step_row_rel_err",
    ]
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
    """Per group and variant (and run, where ``df`` keeps runs apart, ``--all-measurements``): exponents
    of time and of peak memory against N (or Nk, see :func:`lengths`), R² (NaN below
    :data:`MIN_R2_LENGTHS` lengths), length range, points."""
    keys = group_keys(df)
    # the speed table shows each run in a row of its own: pooled, two runs made one fit of neither
    by = [*keys, "variant", *(["run"] if "run" in df else [])]
    # the columns first, then the rows: assigning a Series to an empty frame takes the Series' index,
    # so a store with no usable record grew one row of NaN keys per record (a "nan · nan" table)
    figures = {"time_s": mode_times(df)["time_s"], "peak": _col(df, "peak_mib"), "_n": lengths(df)}
    ok = key_frame(df, keys).assign(**figures)[usable(df)]
    rows = []
    for vals, sub in ok.groupby(by, dropna=False, sort=True):
        row = dict(zip(by, vals, strict=True))
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
        sec.note = "No job ran and passed its check: there is nothing to fit."
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
            index=pd.MultiIndex.from_frame(sub[["variant", "run"]])
            if "run" in sub
            else pd.Index(sub["variant"], name="variant"),
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
            key_frame(bad, keys)
            .assign(**{axis: lengths(shown).loc[bad.index]})
            .groupby([*keys, "variant", "status", "reason"], dropna=False, sort=True)[axis]
            .agg(lambda s: ", ".join(str(int(n)) for n in sorted(set(s.dropna()))))
            .reset_index()
        )
        agg["where"] = _titles(agg, keys)
        tab = agg.set_index(["where", "variant"])[["status", axis, "reason"]]
        tab.columns = ["status", "Nk" if axis == "kv_len" else "N", "reason"]
        sec.parts.append(("jobs without usable figures (newest measurement of each configuration)", tab))
    elif (shown.get("kind") == "model").any():  # a model job times a transformers model: no oracle
        sec.note = (
            "Every shown job ran; a kernel job passed its correctness check, a model job has none of its "
            "own (the backend is checked against transformers' eager attention by the tests)."
        )
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
