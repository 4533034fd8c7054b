"""Plots of the kernel records (seaborn, PNG): time, memory and GFLOP/s against N, scaling exponents, the
accuracy heatmap; and two that need no records: each variant's attention pattern and its attention
weights on one structured input.

Only jobs that ran and passed their correctness check are drawn as numbers; the accuracy heatmap
writes the status in cells that have no error figure.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, safe inside Hydra callbacks and CI

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.colors import Normalize, PowerNorm, SymLogNorm  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402
from numpy.typing import ArrayLike  # noqa: E402

from ..measure.spec import Kind  # noqa: E402
from ..records.store import is_false, is_true  # noqa: E402
from .format import obj, rate, sci  # noqa: E402
from .grouping import (  # noqa: E402
    GROUP_BASE,
    beside_work,
    group_keys,
    groups,
    key_frame,
    key_texts,
    length_axis,
    lengths,
    mode_times,
    pivot_cells,
    slow_machine,
    usable,
)
from .kernel_tables import decode_left_out, decode_rows, scaling_fits  # noqa: E402

DPI = 110
MODE_TITLES = {"fwd": "forward", "fwd_bwd": "forward + backward"}


# ---------------------------------------------------------------------------------------------- helpers
def _facet_rows(df: pd.DataFrame, keys: list[str] | None = None) -> pd.Series:
    """Facet row label: device · dtype, plus any other workload field that varies (causal=True, ...):
    ``keys`` where ``df`` is derived from the records (the scaling fits), else ``df``'s own group keys."""
    keys = keys or group_keys(df)
    extra = [k for k in keys if k not in GROUP_BASE]
    df = key_frame(df, keys)

    def label(row: pd.Series) -> str:
        return " · ".join([str(row["device"]), str(row["dtype"]), *key_texts(extra, [row[k] for k in extra])])

    return df.apply(label, axis=1).astype(str) if len(df) else pd.Series("", index=df.index)


def _facet_order(labels: pd.Series) -> list[str]:
    """The distinct facet labels in natural order: numbers as numbers (``documents=4`` before
    ``documents=16``, ``kv_heads=8`` before ``kv_heads=32``)."""
    return sorted(
        labels.unique(), key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]
    )


def palette(names: list[str]) -> dict[str, tuple]:
    """A distinct color per name (in order): the same variant keeps its color across panels."""
    colors = sns.color_palette("tab10" if len(names) <= 10 else "tab20", len(names))
    return dict(zip(names, colors, strict=True))


def _markers(names: list[str]) -> dict[str, str]:
    shapes = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p"]
    return {n: shapes[i % len(shapes)] for i, n in enumerate(names)}


def _n_axis(ax: plt.Axes, ns: list[int]) -> None:
    """Log-2 x axis with a tick at each measured N, labelled as plain token counts."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ns))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(round(x))}"))
    if len(ns) > 4:  # long labels (16384) collide when many lengths share a narrow facet
        ax.tick_params(axis="x", labelrotation=45)


def _spans_decades(values: pd.Series) -> bool:
    v = values[values > 0]
    return len(v) > 1 and v.max() / v.min() >= 10


#: two lines whose values at two neighbouring lengths both lie within this ratio of each other draw one
#: segment on top of the other (a 1.6-point line on a log axis of a few decades is about 5% thick)
COINCIDE_RTOL = 0.03
#: on a linear y axis the same test in absolute terms: within this share of the axis's span (a 1.5-point
#: line on a panel about 3 inches tall is about 1% of it)
COINCIDE_SPAN = 0.01
#: the length of one colour's dash where coinciding lines take turns (in line widths)
TURN_DASH = 3.0


def coinciding_styles(
    series: list[tuple[ArrayLike, ArrayLike]], rtol: float = COINCIDE_RTOL, atol: float = 0.0
) -> list[str | tuple]:
    """The line style of each of a panel's ``series`` ((x, y) in drawing order, x sorted): solid, except
    where lines coincide. Lines that share a segment (two neighbouring x with y within ``rtol`` of each
    other, or within ``atol``: a linear axis passes ``rtol=0`` and :data:`COINCIDE_SPAN` of its span),
    directly or through another, form a set of ``k``; its first line stays solid and the others are
    dashed, each its own ``1/k`` of a period of ``k`` dashes, so that along the common stretch the ``k``
    colours take turns (a line striped blue and red: the blue and the red series are one line there)
    instead of the last one drawn hiding the others. The plots of other sections call it too; their
    legends add :func:`coinciding_handle`. ``O(lines^2 * points)``."""
    points = [dict(zip(np.asarray(x, float), np.asarray(y, float), strict=True)) for x, y in series]

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= max(rtol * max(abs(a), abs(b)), atol)

    def shared(i: int, j: int) -> bool:  # a segment of line i (x sorted) that line j draws too
        pi, pj = points[i], points[j]
        xs = list(pi)
        return any(
            x0 in pj and x1 in pj and close(pi[x0], pj[x0]) and close(pi[x1], pj[x1])
            for x0, x1 in zip(xs[:-1], xs[1:], strict=True)
        )

    root = list(range(len(series)))  # union-find: the first line of each set of coinciding lines

    def find(i: int) -> int:
        while root[i] != i:
            i = root[i]
        return i

    for j in range(len(series)):
        for i in range(j):
            if find(i) != find(j) and shared(i, j):
                root[max(find(i), find(j))] = min(find(i), find(j))
    sets: dict[int, list[int]] = {}
    for i in range(len(series)):
        sets.setdefault(find(i), []).append(i)
    styles: list[str | tuple] = ["-"] * len(series)
    for members in sets.values():
        k = len(members)
        for turn, i in enumerate(members[1:], start=1):  # dash on [turn, turn + 1) of each period of k
            styles[i] = (TURN_DASH * (k - turn), (TURN_DASH, TURN_DASH * (k - 1)))
    return styles


def log_axis_rtol(values: pd.Series) -> float:
    """The ratio within which two values draw one line on a log axis spanning ``values`` (its decades,
    shared by a figure's panels): :data:`COINCIDE_SPAN` of the span in log units, at least
    :data:`COINCIDE_RTOL` (a 3.5-decade decode plot: 8%, where linear's 0.262 ms and local_window's
    0.271 hid one another at 3%). ``O(len(values))``."""
    pos = pd.to_numeric(values, errors="coerce")
    pos = pos[pos > 0]
    decades = float(np.log10(pos.max() / pos.min())) if len(pos) else 0.0
    return max(COINCIDE_RTOL, 10 ** (COINCIDE_SPAN * decades) - 1)


def coinciding_handle(lw: float = 1.6) -> plt.Line2D:
    """The legend entry of a plot some of whose lines take turns in dashes (:func:`coinciding_styles`)."""
    turns = "dashes of two or more colours:\nlines that coincide there"
    return plt.Line2D([], [], color="0.45", ls=(0, (TURN_DASH, TURN_DASH)), lw=lw, label=turns)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _plot_vs_n(
    df: pd.DataFrame,
    y: str,
    ylabel: str,
    title: str,
    path: Path,
    band: tuple[str, str] | None,
    ceiling: str | None = None,
    flag: str | None = None,
    coinciding: bool = False,
) -> Path | None:
    """Line per variant of ``y`` against N, faceted by device/dtype (rows) and mode (columns);
    ``ceiling`` names a column drawn as a dashed line at its median per panel (e.g. the GEMM rate);
    ``flag`` names a boolean column whose true points get a red ring (and the legend says why); points
    whose ``unstable`` column is true (the tables' ``unstable`` mark) get a gray square ring. Lines that
    coincide (:func:`coinciding_styles`) take turns in dashes of their colours, in any of these plots.
    ``coinciding``: series that may be identical (memory, state): hollow markers, each variant's smaller
    than the one before, so that a marker under another still shows, and a log y axis as x is."""
    data = df.dropna(subset=[y])
    data = data[data[y] > 0]
    if data.empty:
        return None
    # x: each row's length, N or Nk (a store's self-attention sweeps keep N beside its decode sweeps)
    data = data.assign(
        _row=_facet_rows(data), _col=data["mode"].map(lambda m: MODE_TITLES.get(m, m)), _x=lengths(data)
    )
    decoding = length_axis(data) == "kv_len"
    mixed = decoding and data["kv_len"].isna().any()  # panels on N and on Nk: each names its axis
    names = sorted(data["variant"].unique())
    colors, markers = palette(names), _markers(names)
    sizes = {n: (11 - 6 * i / max(1, len(names) - 1) if coinciding else 5) for i, n in enumerate(names)}
    rows, cols = _facet_order(data["_row"]), sorted(data["_col"].unique(), key=lambda c: c != "forward")
    fig, axes = plt.subplots(
        len(rows),
        len(cols),
        figsize=(5.2 * len(cols) + 2.4, 3.9 * len(rows) + 0.6),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    merged = False  # some panel's lines coincide somewhere (the legend says how they are drawn)
    rtol = log_axis_rtol(data[y])
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            ax = axes[i][j]
            sub = data[(data["_row"] == r) & (data["_col"] == c)]
            # decode sweeps: x = cached keys Nk, one line per variant and query length; a panel of rows
            # without a key length of their own (a self-attention sweep beside them) keeps x = N
            on_keys = decoding and sub["kv_len"].notna().any()
            by = ["variant", "seq_len"] if on_keys else ["variant"]
            styles = dict(zip(sorted(sub["seq_len"].unique()), ["-", "--", ":", "-."] * 4, strict=False))
            series = [(key, pts.sort_values("_x")) for key, pts in sub.groupby(by)]
            # lines with the same values (two variants keeping the same state, or the same peak memory)
            # take turns in dashes of their colours instead of the last one hiding the others
            turns = coinciding_styles([(pts["_x"], pts[y]) for _, pts in series], rtol=rtol)
            merged |= any(t != "-" for t in turns)
            for (key, pts), turn in zip(series, turns, strict=True):
                name = key[0] if isinstance(key, tuple) else key
                label = f"{name}, Nq={int(key[1])}" if on_keys else name
                ls = styles[key[1]] if on_keys else "-"
                ls = turn if ls == "-" else ls  # a query length's own dashes (a panel of several) stay
                ax.plot(
                    pts["_x"],
                    pts[y],
                    marker=markers[name],
                    color=colors[name],
                    label=label,
                    lw=1.6,
                    ms=sizes[name],
                    mfc="none" if coinciding else colors[name],
                    ls=ls,
                )
                if band is not None:
                    ax.fill_between(
                        pts["_x"], pts[band[0]], pts[band[1]], color=colors[name], alpha=0.2, lw=0
                    )
                if flag is not None and pts[flag].any():
                    hit = pts[pts[flag]]
                    ring = {"s": 110, "facecolors": "none", "edgecolors": "red", "lw": 1.4, "zorder": 5}
                    ax.scatter(hit["_x"], hit[y], **ring)
                if flag is not None and _unstable(pts).any():
                    hit = pts[_unstable(pts)]
                    square = {"s": 150, "marker": "s", "facecolors": "none", "edgecolors": "0.45", "lw": 1.4}
                    ax.scatter(hit["_x"], hit[y], zorder=5, **square)
            if ceiling is not None and ceiling in sub and sub[ceiling].notna().any():
                top = float(sub[ceiling].median())  # GFLOP/s, the axis' unit
                ax.axhline(top, ls="--", lw=1, color="0.4")
                ax.annotate(
                    # in G or T as its size asks: a GPU's 6.79e+05 GFLOP/s reads 679 TFLOP/s
                    f"GEMM, same sweep: {rate(sub[ceiling] * 1e9, 'FLOP/s')}",
                    (0.02, top),
                    xycoords=("axes fraction", "data"),
                    va="bottom",
                    fontsize=8,
                    color="0.3",
                )
            # ticks at the lengths of every panel on the same axis (N, or Nk), measured here or not
            same = data[data["kv_len"].notna() == on_keys] if decoding else data
            ns = sorted(int(n) for n in (same if len(same) else data)["_x"].unique())
            _n_axis(ax, ns)
            if coinciding or _spans_decades(data[y]):
                ax.set_yscale("log")
            ax.set_title(f"{r} | {c}", fontsize=10)
            xlabel = "cached keys Nk (tokens)" if on_keys else "sequence length N (tokens)"
            ax.set_xlabel(xlabel if i == len(rows) - 1 or mixed else "")
            ax.set_ylabel(ylabel if j == 0 else "")
            ax.grid(True, which="major", alpha=0.3)
            if sub.empty:
                ax.text(0.5, 0.5, "no usable jobs", transform=ax.transAxes, ha="center", color="gray")
    handles = [
        plt.Line2D(
            [], [], color=colors[n], marker=markers[n], mfc="none" if coinciding else colors[n], label=n
        )
        for n in names
    ]
    if flag is not None and data[flag].any():
        ring = "beside other work (*) or\nwhile the machine ran slow (~)"
        handles.append(plt.Line2D([], [], ls="", marker="o", mfc="none", mec="red", ms=9, label=ring))
    if flag is not None and _unstable(data).any():
        square = "unstable: the timed runs' spread\nnever settled (the tables' 'unstable')"
        handles.append(plt.Line2D([], [], ls="", marker="s", mfc="none", mec="0.45", ms=10, label=square))
    if merged:
        handles.append(coinciding_handle())
    fig.legend(handles=handles, title="variant", loc="outside right center", frameon=False)
    fig.suptitle(title, fontsize=12)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------- record plots
def _usable_rows(df: pd.DataFrame) -> pd.DataFrame:
    t = mode_times(df)
    out = df.assign(
        time_ms=t["time_s"] * 1e3,
        q1_ms=t["q1_s"] * 1e3,
        q3_ms=t["q3_s"] * 1e3,
        peak=pd.to_numeric(df.get("peak_mib"), errors="coerce"),
        cpu_per_wall=t["cpu_per_wall"],
        gflops=pd.to_numeric(df.get("gflops_per_s"), errors="coerce"),
        gemm_gflops=pd.to_numeric(df.get("roofline_gemm_flops_per_s"), errors="coerce") / 1e9,
    )
    out = out[usable(out)]
    return out.assign(flagged=_flagged(out), unstable=t["unstable"].reindex(out.index).astype(bool))


def _unstable(df: pd.DataFrame) -> pd.Series:
    """Per row: whether the tables mark its time ``unstable`` (false where the records do not say)."""
    return df["unstable"].map(is_true).astype(bool) if "unstable" in df else pd.Series(False, index=df.index)


def _flagged(df: pd.DataFrame) -> list[bool]:
    """Per row: whether the tables mark its time ``*`` or ``~`` (from its ``cpu_per_wall``, the time's
    figure's), which the plots mark too."""
    return [beside_work(r) or slow_machine(r) for _, r in df.iterrows()]


def plot_time(df: pd.DataFrame, out_dir: Path) -> Path | None:
    """``time_vs_n.png``: median time of each mode against N (log-log), band = interquartile range."""
    return _plot_vs_n(
        _usable_rows(df),
        "time_ms",
        "median time (ms)",
        "Time vs length (median; band = interquartile range)",
        out_dir / "time_vs_n.png",
        band=("q1_ms", "q3_ms"),
        flag="flagged",
    )


def plot_decode(df: pd.DataFrame, out_dir: Path) -> Path | None:
    """``decode_vs_nk.png``: time per decoded token against the context (log-log): the decoding step
    of a variant with a fixed-size state, the forward over the K/V cache of the others (on CUDA that
    forward replayed as a CUDA graph where it was: eager, a decode call's time is the host's)."""
    dec = decode_rows(_usable_rows(df))
    graphed = not dec.empty and dec["graph_ms_per_token"].notna().any()
    if graphed:
        # a point drawn at its CUDA-graph time carries that figure's own marks (``fwd_graph_unstable``,
        # ``fwd_graph_cpu_per_wall``), as the decoding table's graph panel does, never the eager
        # forward's (another measurement): not unstable where the records do not say the graph's was
        replayed = dec["graph_ms_per_token"].notna()
        own = dec.reindex(columns=["fwd_graph_unstable", "fwd_graph_cpu_per_wall"])
        dec = dec.assign(
            ms_per_token=dec["graph_ms_per_token"].where(replayed, dec["ms_per_token"]),
            unstable=own["fwd_graph_unstable"].map(is_true).astype(bool).where(replayed, dec["unstable"]),
            cpu_per_wall=pd.to_numeric(own["fwd_graph_cpu_per_wall"], errors="coerce").where(
                replayed, dec["cpu_per_wall"]
            ),
        )
    # a step's time is marked from the step's own core share, as the decoding table marks it
    dec = dec.assign(flagged=_flagged(dec), unstable=dec["unstable"].map(is_true).astype(bool))
    return _plot_vs_n(
        dec,
        "ms_per_token",
        "ms per token" + (" (CUDA graph replay where timed)" if graphed else ""),
        "Decoding: time per token vs context (a state variant's step; the others' forward over the cache)"
        + _not_shown(df),
        out_dir / "decode_vs_nk.png",
        band=None,
        flag="flagged",
    )


def _not_shown(df: pd.DataFrame) -> str:
    """A decoding plot's second title line naming the decoding records it cannot draw
    (:func:`decode_left_out`), wrapped; empty when it draws them all."""
    left_out = decode_left_out(df).replace("`", "")
    return "\n" + textwrap.fill(f"Not shown: {left_out}", 110) if left_out else ""


def plot_state(df: pd.DataFrame, out_dir: Path) -> Path | None:
    """``state_vs_nk.png``: the bytes one decoding sequence keeps per layer against the context:
    the K/V cache grows with it, a fixed-size state does not."""
    return _plot_vs_n(
        decode_rows(_usable_rows(df)),
        "state_mib",
        "state per sequence and layer (MiB)",
        "Decoding: what a sequence keeps vs context (K/V cache or fixed-size state)" + _not_shown(df),
        out_dir / "state_vs_nk.png",
        band=None,
        coinciding=True,
    )


def plot_memory(df: pd.DataFrame, out_dir: Path) -> Path | None:
    """``memory_vs_n.png``: peak memory above the inputs against N (log-log)."""
    return _plot_vs_n(
        _usable_rows(df),
        "peak",
        "peak memory (MiB)",
        "Peak memory vs length (above the inputs)",
        out_dir / "memory_vs_n.png",
        band=None,
        coinciding=True,
    )


def plot_gflops(df: pd.DataFrame, out_dir: Path) -> Path | None:
    """``gflops_vs_n.png``: throughput in counted GFLOP/s against N (the useful pairs' FLOPs; a form
    without pairs counts its own algorithm's products, as the tables' FLOPs note says)."""
    return _plot_vs_n(
        _usable_rows(df),
        "gflops",
        "GFLOP/s (counted)",
        "Throughput vs length (useful pairs' FLOPs; a pair-free form's own; dashed: the device's GEMM rate)",
        out_dir / "gflops_vs_n.png",
        band=None,
        ceiling="gemm_gflops",
    )


def plot_scaling(df: pd.DataFrame, out_dir: Path) -> Path | None:
    """``scaling_exponents.png``: fitted exponent of time and memory against N, one bar per variant."""
    fits = scaling_fits(df)
    if fits.empty:
        return None
    long = pd.concat(
        [
            fits.assign(quantity=q, exponent=fits[f"{q}_exponent"], r2=fits[f"{q}_r2"])
            for q in ("time", "memory")
        ]
    ).dropna(subset=["exponent"])
    if long.empty:
        return None
    # the records' group keys: the fits have no kv_len, so their own would take N for the length axis
    rows = _facet_rows(long, group_keys(df))
    long = long.assign(_row=rows, _col=long["mode"].map(lambda m: MODE_TITLES.get(m, m)))
    names = sorted(long["variant"].unique())
    g = sns.catplot(
        data=long,
        kind="bar",
        x="exponent",
        y="variant",
        hue="quantity",
        row="_row",
        col="_col",
        row_order=_facet_order(long["_row"]),
        order=names,
        hue_order=["time", "memory"],
        palette={"time": "#4C72B0", "memory": "#DD8452"},
        height=max(2.6, 0.42 * len(names) + 1.2),
        aspect=1.5,
        sharex=True,
        margin_titles=False,
    )
    for ax in g.axes.flat:
        for ref, style in ((1, ":"), (2, "--")):
            ax.axvline(ref, color="gray", ls=style, lw=1, zorder=0)  # behind the bars and their labels
        ax.grid(True, axis="x", alpha=0.3)
    g.set_axis_labels("fitted exponent k (y ∝ N^k)", "")
    g.set_titles("{row_name} | {col_name}")
    for ax in g.axes.flat:
        for bars in ax.containers:
            ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
        # a negative exponent (a launch-bound time that falls with N) must show, not be cut off at 0
        low = float(long["exponent"].min())
        ax.set_xlim(low * 1.15 - 0.3 if low < 0 else 0, max(2.3, float(long["exponent"].max()) * 1.15))
    g.legend.set_title("exponent of")
    # above the facet titles; bbox_inches="tight" on saving keeps it in the picture
    lo, hi = int(long["time_points"].min()), int(long["time_points"].max())
    over = f"over {lo} lengths" if lo == hi else f"over {lo}-{hi} lengths"
    if hi == 2:  # two lengths: no fit to speak of, the slope between them
        over = "the slope between its 2 lengths"
    g.figure.suptitle(
        "Scaling exponents: log-log fit against the length, N or Nk (1 = linear, 2 = quadratic)"
        f"\nper variant, {over}",
        y=1.1,
    )
    return _save(g.figure, out_dir / "scaling_exponents.png")


#: the check a failed record's figure belongs to, as a heatmap cell of another figure names it
FAILED_WHAT = {"out_rel_err": "fwd", "grad_rel_err": "grad", "step_rel_err": "step"}


def _failed_check(row: pd.Series) -> str | None:
    """Which figure of an invalid record failed its check, ``out_rel_err`` (the output),
    ``grad_rel_err`` (the gradients) or ``step_rel_err`` (a decoding step's output), by the
    tolerances of the record's dtype, on the whole error or its worst row's (``*_row_rel_err``);
    None if none is above its tolerance (a check the records do not say)."""
    import torch

    from ..measure.accuracy import grad_tolerance, tolerance

    dtype = getattr(torch, str(row.get("dtype")), None)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
    tolerances = {"out_rel_err": tolerance(dtype), "grad_rel_err": grad_tolerance(dtype)}
    for col, tol in {**tolerances, "step_rel_err": tolerance(dtype)}.items():
        # the whole output's error or its worst row's (records since 2026-11-27): either fails the check
        worst = pd.to_numeric(
            pd.Series([row.get(col), row.get(col.replace("_rel", "_row_rel"))]), errors="coerce"
        )
        if (worst > tol).any():
            return col
    return None


def plot_accuracy(df: pd.DataFrame, out_dir: Path) -> Path | None:
    """``accuracy_heatmap.png``: log10 relative error against the float64 oracle, of the output, (for
    ``fwd_bwd`` groups whose records have it) of the gradients and (for the variants of decode groups
    whose records have it) of the decoding step's output, and for approximate variants the
    deviation from full attention, variant x N, one panel per group; cells without a figure show the
    job's status; a failed job's cell says FAIL, and which check failed where it was another figure's."""
    if "out_rel_err" not in df:
        return None
    keys = group_keys(df)
    panels = []
    for title, sub in groups(df, keys):
        panels.append((title, "vs float64 oracle", sub, "out_rel_err"))
        graded = sub[sub["mode"] == "fwd_bwd"] if "grad_rel_err" in sub else sub.iloc[:0]
        if len(graded) and pd.to_numeric(graded["grad_rel_err"], errors="coerce").notna().any():
            panels.append((title, "gradient vs float64 oracle", graded, "grad_rel_err"))
        if "step_rel_err" in sub:  # decode jobs of state variants: their step's own output
            step_err = pd.to_numeric(sub["step_rel_err"], errors="coerce")
            stepping = sub["variant"].isin(sub.loc[step_err.notna(), "variant"])  # the state variants
            if stepping.any():
                panels.append((title, "decoding step vs float64 oracle", sub[stepping], "step_rel_err"))
        approx = sub[sub["exact"].map(is_false).astype(bool)]
        if "dev_full_rel_err" in sub and len(approx):
            panels.append((title, "deviation from full attention", approx, "dev_full_rel_err"))
    panels = [p for p in panels if (p[2]["status"] == "ok").any()]
    if not panels:
        return None

    def text(col: str):  # noqa: ANN202
        def cell(row: pd.Series) -> str:
            if row["status"] != "ok":
                return str(row["status"])
            v = pd.to_numeric(row.get(col), errors="coerce")
            if pd.isna(v):  # a check the job skipped (its oracle over the budget) says so
                why = "grad_check_skipped" if col == "grad_rel_err" else "accuracy_skipped"
                return "not\nchecked" if pd.notna(row.get(why)) else "n/a"
            if not is_false(row["valid"]):
                return sci(v)
            failed = _failed_check(row)  # this cell's figure, or the other one that failed its check
            return f"FAIL\n{sci(v)}" if failed in (None, col) else f"{sci(v)}\n{FAILED_WHAT[failed]} FAIL"

        return cell

    errs = pd.concat([pd.to_numeric(p[2][p[3]], errors="coerce") for p in panels])
    errs = errs[errs > 0]
    vmin, vmax = (np.log10(errs.min()), np.log10(errs.max())) if len(errs) else (-8, 0)
    if vmax - vmin < 1:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    heights = [max(1.6, 0.45 * p[2]["variant"].nunique() + 0.9) for p in panels]
    width = max(5.5, 1.15 * max(lengths(p[2]).nunique() for p in panels) + 3.5)
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(width, sum(heights)),
        squeeze=False,
        height_ratios=heights,
        layout="constrained",
    )
    for ax, (title, what, sub, col) in zip(axes[:, 0], panels, strict=True):
        annot = pivot_cells(sub, text(col))
        err = pd.to_numeric(sub[col], errors="coerce").where(sub["status"] == "ok")
        # an error of exactly 0 (a window that covers every key) is the best colour, not a gray "no figure"
        vals = sub.assign(_v=np.log10(err.clip(lower=1e-16)), _n=lengths(sub).astype("Int64"))
        vals = vals.pivot_table(index="variant", columns="_n", values="_v", aggfunc="last")
        vals = vals.reindex(index=annot.index, columns=[int(c.split("=")[1]) for c in annot.columns])
        ax.set_facecolor("#e6e6e6")  # cells without an error figure: gray, with the status written in
        shown = np.where(vals.notna().to_numpy(), annot.to_numpy(), "")
        sns.heatmap(
            vals,
            annot=shown,
            fmt="",
            cmap="rocket_r",
            vmin=vmin,
            vmax=vmax,
            ax=ax,
            cbar_kws={"label": "log10 relative error"},
            annot_kws={"fontsize": 8},
            linewidths=0.5,
            linecolor="white",
        )
        for (i, j), txt in np.ndenumerate(annot.to_numpy()):
            if pd.isna(vals.iat[i, j]):  # seaborn leaves empty cells unannotated: say why they are empty
                ax.text(j + 0.5, i + 0.5, txt, ha="center", va="center", fontsize=8, color="#555555")
        ax.set_title(f"{title}: {what}", fontsize=10)
        ax.set_xlabel(
            "cached keys Nk (tokens)" if length_axis(sub) == "kv_len" else "sequence length N (tokens)"
        )
        ax.set_ylabel("")
        ax.set_xticklabels([str(c) for c in vals.columns], rotation=0)
        # seaborn turns the variant names vertical where they overlap, as one name does on a one-row panel
        ax.tick_params(axis="y", labelrotation=0)
    grads = any(p[3] == "grad_rel_err" for p in panels)
    fig.suptitle(
        "Accuracy: max |out − ref| / max |ref|" + (" (gradients: worst of dq, dk, dv)" if grads else ""),
        fontsize=12,
    )
    return _save(fig, out_dir / "accuracy_heatmap.png")


# ------------------------------------------------------------------------------------- structure plots
@contextmanager
def _seeded() -> Iterator[None]:
    """torch drawing from seed 0 inside, the global generator restored after: a learned variant's
    random weights, so that a report drawn twice draws the same picture."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


def _example_variants() -> list[tuple[str, object | Exception]]:
    """``(title, variant or the exception building it)`` for every registered name, first example knobs."""
    import variants

    out: list[tuple[str, object | Exception]] = []
    for name in variants.available():
        knobs = dict(variants.get(name).example_knobs[0]) if variants.get(name).example_knobs else {}
        shown = {k: v for k, v in knobs.items() if k != "compile"}
        # None knobs are chosen from N when the variant runs: "auto" says so
        title = name + (
            f"({', '.join(f'{k}={v}' if v is not None else f'{k}=auto' for k, v in shown.items())})"
            if shown
            else ""
        )
        try:
            with _seeded():
                out.append((title, variants.build(name, heads=1, head_dim=16, **knobs)))
        except Exception as exc:  # a variant that cannot be built here still gets its panel, with why
            out.append((title, exc))
    return out


def _swept_variants(df: pd.DataFrame) -> list[tuple[str, object | Exception, tuple[bool, int]]]:
    """``(title, variant or the exception building it, (causal, documents))`` for every (variant, knobs)
    that ran ``ok`` in ``df``, built with the knobs it ran with, once per mask setting it ran under (its
    rows' distinct ``causal`` and packed ``documents``); empty if none ran."""
    import json

    from hydra.utils import get_class

    from variants.registry import construct

    out: list[tuple[str, object | Exception, tuple[bool, int]]] = []
    ran = df[df["status"] == "ok"].sort_values("variant")
    for _, rows in ran.groupby("variant_key", sort=False):
        row = rows.iloc[0]
        knobs = json.loads(row["knobs"]) if isinstance(row["knobs"], str) else {}
        shown = ", ".join(f"{k}={v}" for k, v in knobs.items() if v is not None and k != "compile")
        title = f"{row['variant_name']}({shown})" if shown else str(row["variant_name"])
        try:
            with _seeded():
                built: object | Exception = construct(
                    get_class(row["variant_target"]), heads=1, head_dim=16, **knobs
                )
        except Exception as exc:  # a plugin not installed where the report is drawn, say
            built = exc
        for setting in sorted(set(map(_mask_setting, rows.to_dict("records")))):
            out.append((title, built, setting))
    return out


def _mask_setting(row: dict) -> tuple[bool, int]:
    """``(causal, documents)`` of one record: the masks that shape its attention weights. A kernel job's
    are its workload's; a model job's Llama decoder is causal and a task's model is when its task says
    so, whatever the sweep's own ``causal``; records from before packed documents have one document."""
    if row.get("kind") == Kind.model.value:
        causal = True
    elif row.get("kind") == Kind.task.value:
        causal = bool((obj(row.get("task")) or {}).get("causal", False))
    else:
        causal = bool(row.get("causal"))
    documents = row.get("documents")
    return causal, 1 if pd.isna(documents) else int(documents)


def _setting_text(causal: bool, documents: int) -> str:
    """``"causal, 4 documents"``, ``"two-way"``: a mask setting in words."""
    return ("causal" if causal else "two-way") + (f", {documents} documents" if documents > 1 else "")


def _grid(
    n_panels: int, size: float = 2.9, cols: int = 4, title_lines: int = 2, colorbars: bool = False
) -> tuple[plt.Figure, np.ndarray]:
    """A grid of ``n_panels`` square panels, each row tall enough for a title of ``title_lines`` lines
    (:func:`_wrap_title`) above it, so that a long title does not run into the panel above; each column
    wider by a colorbar's room where ``colorbars`` (a panel with a colorbar of its own)."""
    cols = min(cols, n_panels)
    rows = -(-n_panels // cols)
    row = size + 0.16 * max(0, title_lines - 2)  # a 9-point line is about 0.16 inch
    col = size + (1.1 if colorbars else 0)
    fig, axes = plt.subplots(
        rows, cols, figsize=(col * cols + 1.2, row * rows + 1.0), squeeze=False, layout="constrained"
    )
    for ax in axes.flat[n_panels:]:
        ax.set_visible(False)
    return fig, axes


def _no_matrix(ax: plt.Axes, why: str, n: int) -> None:
    """A panel with no matrix: ``why`` in its middle, its axes those of an ``n x n`` image."""
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_ylim(n - 0.5, -0.5)  # query 0 at the top, as imshow draws it
    ax.text(0.5, 0.5, textwrap.fill(why, 30), transform=ax.transAxes, ha="center", va="center", fontsize=7)


def _wrap_title(title: str) -> str:
    """A panel's title as drawn: each of its lines wrapped at 34 characters."""
    return "\n".join(w for line in title.split("\n") for w in textwrap.wrap(line, 34))


def _in_unit_range(weights: np.ndarray) -> bool:
    """Whether every weight lies in [0, 1] (up to rounding): a softmax's weights do, a variant's without
    one (retention, linear, ...) need not."""
    return bool(weights.min() >= -1e-9 and weights.max() <= 1 + 1e-9)


def _weight_norm(weights: np.ndarray) -> Normalize:
    """The colour scale of a panel of attention weights: a power scale over [0, 1] where they all lie in
    it; else a symmetric log scale centred on 0 over their whole range, which clips none of them and
    still shows the small ones (linear within a thousandth of the largest magnitude)."""
    if _in_unit_range(weights):
        return PowerNorm(0.4, 0, 1)
    top = max(float(np.abs(weights).max()), 1e-12)
    return SymLogNorm(top * 1e-3, vmin=-top, vmax=top, base=10)


def _symlog_ticks(norm: SymLogNorm) -> list[float]:
    """At most 7 ticks for a colorbar of :func:`_weight_norm`'s symmetric log scale, far enough apart
    for their labels: 0, and on each side the first power of ten past the linear range around 0, one
    power of ten about halfway to the end (where one lies a decade past it and half a decade short of
    the end) and the end, the largest magnitude. (Matplotlib's own put a label at every decade and at
    the powers of ten inside the linear range, a stack of them over 0.)"""
    top, lin = float(norm.vmax), float(norm.linthresh)
    low = 10.0 ** np.ceil(np.log10(lin))
    side = [low] if low <= top / 10**0.5 else []
    inner = [10.0**p for p in range(round(np.log10(low)) + 1, int(np.floor(np.log10(top))) + 1)]
    inner = [t for t in inner if t <= top / 10**0.5]
    if side and inner:  # the power of ten nearest the middle of the log range between low and top
        side.append(min(inner, key=lambda t: abs(np.log10(t) - (np.log10(low) + np.log10(top)) / 2)))
    side.append(top)
    return [-t for t in reversed(side)] + [0.0] + side


def _compact(value: float) -> str:
    """A colorbar label in two significant figures: ``0``, ``0.01``, ``−2.2``, ``27``, ``1e−5``."""
    if value == 0:
        return "0"
    return f"{value:.2g}".replace("e-0", "e-").replace("e+0", "e").replace("-", "\u2212")


def _matrix_axes(ax: plt.Axes, title: str, n: int) -> None:
    ax.set_title(_wrap_title(title), fontsize=9)
    ax.set_xlabel("key j", fontsize=8)
    ax.set_ylabel("query i", fontsize=8)
    ticks = list(range(0, n, 16 if n <= 64 else n // 4))
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.tick_params(labelsize=7)


def pattern_panels(df: pd.DataFrame, n_max: int = 1024) -> tuple[int, str, list[tuple[str, object, bool]]]:
    """What ``patterns.png`` draws: ``(N, which variants in words, [(title, variant or the exception
    building it, causal)])``: each variant that ran ``ok`` in ``df``, with the knobs it ran with, once per
    causal setting it ran with, at the longest length that ran (N, or a decoding sweep's Nk; at most
    ``n_max``); every registered variant with its example knobs at N = 48, two-way, when nothing ran.
    Packed documents are left out (``pattern`` is the variant's own)."""
    panels = [(t, v, causal) for t, v, (causal, _) in _swept_variants(df)] if len(df) else []
    if not panels:
        return 48, "every registered variant, example knobs", [(t, v, False) for t, v in _example_variants()]
    ok = df[df["status"] == "ok"]
    ran = lengths(ok).dropna()  # N, or a decoding sweep's key length
    n = min(n_max, max(48, int(ran.max()) if len(ran) else 48))
    which = "the variants that ran, with their knobs"
    if len(ran) and ran.max() > n:
        which += f"; they ran up to {'Nk' if length_axis(ok) == 'kv_len' else 'N'} = {int(ran.max())}"
    return n, which, list(dict.fromkeys(panels))  # two documents settings of one causal setting: one panel


def plot_patterns(df: pd.DataFrame, out_dir: Path, n_max: int = 1024) -> Path:
    """``patterns.png``: which key each query may attend to (dark = allowed), per panel of
    :func:`pattern_panels` (an ``n_max``-square boolean each at most)."""
    n, which, panels = pattern_panels(df, n_max)
    fig, axes = _grid(len(panels))
    for ax, (title, var, causal) in zip(axes.flat, panels, strict=False):  # the grid may have spare cells
        try:
            if isinstance(var, Exception):
                raise var
            # a causal-only variant (a recurrence) has no two-way pattern: its causal one is drawn
            causal_only = not getattr(var, "supports_noncausal", True)
            pat = var.pattern(n, n, causal or causal_only).numpy()
            # above the panel's pixels, a band's share of pairs shows as grey, not as aliased stripes
            smooth = "antialiased" if n > 256 else "nearest"
            ax.imshow(pat, cmap="Greys", vmin=0, vmax=1.25, interpolation=smooth)
            grid = getattr(var, "grid", None)  # axial: the rows x cols grid it chose for this N
            title += (
                (f", {'x'.join(map(str, grid(n)))} grid" if callable(grid) else "")
                + f"\n{pat.mean():.0%} of pairs"
                + (", causal only" if causal_only else ", causal" if causal else "")
            )
        except Exception as exc:
            _no_matrix(ax, f"no pattern: {exc}", n)
        _matrix_axes(ax, title, n)
    fig.suptitle(f"Attention patterns at N = {n} (dark: query i may attend to key j; {which})", fontsize=11)
    return _save(fig, out_dir / "patterns.png")


def structured_input(n: int = 48, d: int = 16, seed: int = 0) -> tuple[object, str]:
    """``x (1, 1, n, d)`` float64 random tokens with a repeated phrase and a repeated token, and a
    description of where the copies are.

    Used as q = k: each token attends most to itself and to its copies, so the copied phrase shows as
    a short off-diagonal line wherever the variant's pattern lets the copies see each other.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)
    a, b, length = n // 12, n // 2 + n // 12, n // 8  # tokens a..a+length-1 copied to b..
    x[0, 0, b : b + length] = x[0, 0, a : a + length].clone()
    x[0, 0, n - 3] = x[0, 0, n // 3].clone()
    # sharper than unit scale: a token's score with itself (|x|^2 / sqrt(d)) then dominates its row
    where = f"tokens {a}-{a + length - 1} repeated at {b}-{b + length - 1}, token {n // 3} at {n - 3}"
    return x * 1.8, where


def attention_weights(variant: object, x: object, causal: bool = False, documents: int = 1) -> np.ndarray:
    """``(n, n)`` effective attention weights of ``variant`` on q = k = ``x`` by the float64 oracle,
    causal or not, over ``documents`` packed documents (lengths drawn as a sweep draws them at this
    ``n``, seed 0: :func:`~experiments.measure.inputs.document_lengths`).

    The oracle is linear in v, so with v = identity its output *is* the weight matrix; this also
    covers variants that define ``oracle_forward`` (axial: the two stages compose; the recurrences,
    causal only, drawn causal: their state is linear in the values, the delta rule's included).
    ``O(n^2)`` memory, ``O(n^3)`` time at most (n values of width n).
    """
    import torch

    import variants
    from experiments.measure.inputs import document_ids, document_lengths

    n = x.shape[2]
    eye = torch.eye(n, dtype=torch.float64)[None, None]  # (1, 1, N, N): value j = one-hot j
    causal = causal or not getattr(variant, "supports_noncausal", True)  # a recurrence: causal only
    ids = document_ids(document_lengths(1, n, documents)) if documents > 1 else None  # (1, N)
    with torch.no_grad():
        return variants.oracle(variant, x, x, eye, causal=causal, documents=ids)[0, 0].numpy()


def plot_weights(df: pd.DataFrame, out_dir: Path, n_max: int = 256) -> Path:
    """``attention_weights.png``: the attention weights on one structured input of each variant that
    ran in ``df``, with the knobs it ran with and under each mask setting it ran with (causal or not,
    packed documents), at the sweep's shortest length (at most ``n_max``); every registered variant
    with its example knobs at N = 48, two-way, when nothing ran. Where every variant ran under each of
    two to four settings, each variant takes a row and each setting a column."""
    panels = _swept_variants(df) if len(df) else []
    if panels:
        # at least 16 tokens: a decode sweep's single query shows no pattern
        ran = df.loc[df["status"] == "ok", "seq_len"]
        shortest = int(ran.min()) if len(ran) else 16
        n = min(n_max, max(16, shortest))
        which = "the variants that ran, with their knobs and masks"
    else:
        n, shortest, which = 48, 48, "every registered variant, example knobs"
        panels = [(title, var, (False, 1)) for title, var in _example_variants()]
    at = f"at N = {n}"
    if n < shortest:  # an N x N image of thousands of tokens shows no single weight
        at += f" (they ran at N ≥ {shortest}: shorter, to be legible)"
    settings = sorted({setting for *_, setting in panels})
    if len(settings) == 1:  # said once, in the figure's title
        at += f", {_setting_text(*settings[0])}"
    if any(documents > 1 for _, documents in settings):
        at += "; packed documents drawn at this N as the sweep draws them"
    x, where = structured_input(n)
    # every variant under every setting: a variant a row, a setting a column
    matrix = 1 < len(settings) <= 4 and len(panels) == len({id(var) for _, var, _ in panels}) * len(settings)
    drawn: list[tuple[str, np.ndarray | Exception]] = []
    for title, var, setting in panels:
        if len(settings) > 1:
            title += f"\n{_setting_text(*setting)}"
        try:
            if isinstance(var, Exception):
                raise var
            weights = attention_weights(var, x, *setting)
        except Exception as exc:
            drawn.append((title, exc))
            continue
        lo, hi = float(weights.min()), float(weights.max())
        if not _in_unit_range(weights):  # no softmax: said in the title, drawn on its own scale
            title += f"\nunnormalised, range {lo:.3g}..{hi:.3g}"
        drawn.append((title, weights))
    lines = max((len(_wrap_title(title).split("\n")) for title, _ in drawn), default=2)
    own_scale = any(isinstance(w, np.ndarray) and not _in_unit_range(w) for _, w in drawn)
    fig, axes = _grid(
        len(panels), cols=len(settings) if matrix else 4, title_lines=lines, colorbars=own_scale
    )
    image = None
    for ax, (title, weights) in zip(axes.flat, drawn, strict=False):  # the grid may have spare cells
        if isinstance(weights, Exception):
            _no_matrix(ax, f"no weights: {weights}", n)
        elif _in_unit_range(weights):
            image = ax.imshow(weights, cmap="viridis", norm=_weight_norm(weights))
        else:  # weights of either sign or above 1: a diverging scale centred on 0, a colorbar of its own
            own = ax.imshow(weights, cmap="RdBu_r", norm=_weight_norm(weights))
            bar = fig.colorbar(own, cax=ax.inset_axes([1.04, 0.1, 0.05, 0.8]))  # beside its own image
            bar.set_ticks(_symlog_ticks(own.norm), labels=[_compact(t) for t in _symlog_ticks(own.norm)])
            bar.ax.yaxis.set_minor_locator(NullLocator())
            bar.set_label("effective weight\n(symmetric log, 0 = white)", fontsize=8)
            bar.ax.tick_params(labelsize=7)
        _matrix_axes(ax, title, n)
    if image is not None:  # about two panels tall, however many rows
        shrink = min(0.6, 2 / axes.shape[0])
        fig.colorbar(image, ax=axes, shrink=shrink, label="attention weight (power scale)")
    title = f"Attention weights (float64 oracle) of {which}, {at}"
    width = int(fig.get_figwidth() * 11)  # characters of an 11-point title across the figure
    fig.suptitle(textwrap.fill(title, width) + f"\nq = k random, {where}", fontsize=11)
    return _save(fig, out_dir / "attention_weights.png")


def _why_empty(fn: object, df: pd.DataFrame) -> str:
    """Why plot ``fn`` had nothing to draw from ``df``, in a few words."""
    usable = _usable_rows(df) if len(df) else df
    if fn is plot_scaling and len(usable):
        ns = sorted(int(n) for n in lengths(usable).dropna().unique())
        if len(ns) < 2:
            return f"scaling needs >= 2 lengths per variant (these records have only N={ns[0]})"
    return "no usable records"


def write_all(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """Every plot into ``out_dir``. A plot without data is skipped with a note; one that fails says so
    and the others are still drawn (a report at the end of a long sweep must not be lost to one plot)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    plots = [plot_time, plot_memory, plot_gflops, plot_scaling, plot_accuracy]
    if len(df) and not decode_rows(df).empty:  # decoding sweeps only: no note for the others
        plots += [plot_decode, plot_state]
    jobs = [(fn, (df, out)) for fn in plots]
    jobs += [(plot_patterns, (df, out)), (plot_weights, (df, out))]
    for fn, args in jobs:
        name = fn.__name__.removeprefix("plot_")
        try:
            path = fn(*args) if len(df) or fn in (plot_patterns, plot_weights) else None
        except Exception as exc:
            plt.close("all")
            print(f"warning: {name} plot failed: {type(exc).__name__}: {exc}")
            continue
        if path is None:
            print(f"note: {name} plot skipped: {_why_empty(fn, df)}")
        else:
            written.append(path)
    return written
