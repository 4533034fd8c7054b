"""The task jobs' section: a table and two plots from task records.

- :func:`task_table`: one row per (variant, task, N): test accuracy as mean ± std over seeds, beside
  the training cost and parameter counts of those runs and the same variant's kernel speed and memory
  at that N (from the kernel records in the same store, when there are any).
- :func:`plot_recall_vs_distance`: recall accuracy against the key-to-query distance, one line per
  variant (from the per-distance accuracies every recall record carries).
- :func:`plot_trained_attention`: attention-weight heatmaps of trained models. Each task record
  carries, in ``figures["attention"]``, the head-averaged weights of one core on the first test
  example (seq2seq: the last decoder cross-attention; otherwise the last encoder self-attention),
  average-pooled to at most ``heatmap_size`` per side: ``{"module", "stride", "shape", "weights"}``
  with ``weights`` a nested list. Records are self-contained, so no other file is needed.

:func:`write_report` writes ``task_table.md``, ``task_table.csv`` and the two PNGs (the report,
:mod:`experiments.report.report`, calls it when the store has task records). ``O(records)``.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import variants

from ..measure.spec import Kind
from ..measure.tasks.train import Settings, job_context_floor
from ..records.store import WORKLOAD, newest_mask, of_kind
from .format import markdown as markdown_table
from .format import obj
from .grouping import varying_text

# task-config keys left out of a task's label even when they vary: they change how a run is done or
# reported, not what is learned (a run the time cap stopped says so in its stopped_early figure)
_TRAINING_KEYS = {"max_train_s", "eval_batch", "heatmap_size", "distance_bins"}
# task settings a record written before they existed had at their default
_SETTING_DEFAULTS = {f.name: f.default for f in fields(Settings)}
# settings since removed (the variant's class now names the knob the budget shrinks: size_knob)
_RETIRED_KEYS = {"budget_knob"}


#: where a task ran: the same task on another host, device, dtype or thread count is another
#: measurement, never a re-run that replaces it
PLACE = ["env_host", "device", "dtype", "threads"]
#: what a kernel record's call is, beside the variant, N and place: one median per (variant, N,
#: place) is only a figure when the store timed one such call there
SHAPE = [c for c in WORKLOAD if c not in ("device", "dtype", "mode", "causal")]


def _text(values: pd.Series) -> pd.Series:
    """``values`` as text with one spelling for a missing value (pandas writes a missing Int64 as
    NaN, ``str`` as ``<NA>``: the two sides of a merge would not meet, and groupby drops NaN keys)."""
    return values.astype(object).map(lambda v: "nan" if pd.isna(v) else str(v))


def newest_runs(sub: pd.DataFrame) -> pd.Series:
    """True for the newest record of each task run in ``sub`` (:func:`task_rows`' rows): the same
    variant, task config, N and seed in the same :data:`PLACE`. A re-run replaces it; a run elsewhere
    is another."""
    key = "variant_key" if "variant_key" in sub else "variant_label"
    return newest_mask(sub, [key, "_task_json", "seq_len", "seed", *[c for c in PLACE if c in sub]])


def _task_dict(v: Any) -> dict[str, Any] | None:
    """A task cell as its config dict (``{"name": ...}`` when a flattened frame holds only the name)."""
    v = obj(v)
    if isinstance(v, dict) and "name" in v:
        return v
    if isinstance(v, str) and v:  # a flattened frame may hold just the name
        return {"name": v}
    return None


def _variant_col(df: pd.DataFrame) -> pd.Series:
    """The variant's display label per row (the registered name where labels are missing)."""
    if "variant" in df and df["variant"].map(lambda x: isinstance(x, str)).all():
        return df["variant"]
    return df["variant_name"]


def task_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The task records of ``df`` with ``task_name``, ``task_label`` and ``variant_label`` columns.

    ``task_label`` is the task name plus the task-config values that differ between its records
    (e.g. ``recall(gap=32)`` or ``reverse(steps=450)``), except the time cap and reporting settings.
    A causal model (``causal=true``) is told by its row, not its task: ``variant_label`` gets
    `` (causal)``, so the exact variants' rows can sit beside a causal-only core's. Where the records
    ran in more than one place (:data:`PLACE`), the label names it before that (``sdpa · device=cuda``);
    ``_variant_base`` is the label without it, ``_where`` the place's text.
    """
    sub = of_kind(df, Kind.task).copy()
    if sub.empty:
        return sub.assign(task_name=[], task_label=[], variant_label=[])
    # a setting missing from an older record had its default; causal goes to the row's label
    tasks = sub["task"].map(lambda v: {**_SETTING_DEFAULTS, **_task_dict(v)})
    causal = tasks.map(lambda t: bool(t["causal"]))
    sub["task_name"] = tasks.map(lambda t: t["name"])
    sub["_task_json"] = tasks.map(lambda t: json.dumps(t, sort_keys=True, default=str))
    labels = pd.Series("", index=sub.index, dtype=object)
    for name, rows in sub.groupby("task_name"):
        dicts = [json.loads(j) for j in rows["_task_json"]]
        skip = _TRAINING_KEYS | _RETIRED_KEYS | {"name", "causal"}
        keys = {k for d in dicts for k in d if k not in skip}
        varying = sorted(k for k in keys if len({json.dumps(d.get(k)) for d in dicts}) > 1)
        for idx, d in zip(rows.index, dicts, strict=True):
            extra = ", ".join(f"{k}={d.get(k)}" for k in varying)
            labels[idx] = f"{name}({extra})" if extra else name
    sub["task_label"] = labels
    sub["_where"] = varying_text(sub, PLACE)
    name = _variant_col(sub)
    sub["_variant_base"] = name.where(~causal, name + " (causal)")
    shrunk = _shrunk_text(sub)
    named = _with_set_knobs(name, sub)  # the kernel columns still join on _variant_base
    sub["variant_label"] = (named + shrunk + sub["_where"]).where(
        ~causal, named + shrunk + sub["_where"] + " (causal)"
    )
    return sub


#: knobs a task row's label never names: how a core is computed, or a draw that moves with the seed
_UNNAMED_KNOBS = {"impl", "seed"}


def _with_set_knobs(labels: pd.Series, sub: pd.DataFrame) -> pd.Series:
    """``labels`` naming, too, each knob a row's record set away from its class's default that the
    label leaves out: the store names only knobs that vary within it, so a store of sparse at block 8
    alone said plain ``sparse``, which reads as the default block of 64 (``sparse(block=8)`` now)."""
    if "knobs" not in sub or "variant_name" not in sub:
        return labels
    out = labels.copy()
    for idx, label, name, knobs in zip(sub.index, labels, sub["variant_name"], sub["knobs"], strict=True):
        knobs = obj(knobs)
        if not isinstance(knobs, dict) or not isinstance(label, str):
            continue
        try:
            defaults = inspect.signature(variants.get(str(name)).__init__).parameters
        except (variants.UnknownVariant, TypeError, ValueError):  # not a registered class: as labelled
            continue
        extra = [
            f"{k}={v}"
            for k, v in sorted(knobs.items())
            if k in defaults
            and k not in _UNNAMED_KNOBS
            and defaults[k].default is not inspect.Parameter.empty
            and defaults[k].default != v
            and f"{k}=" not in label
        ]
        if extra:
            more = ", ".join(extra)
            inside = label.endswith(")") and "(" in label  # the store named some: add to its list
            out[idx] = f"{label[:-1]}, {more})" if inside else f"{label}({more})"
    return out


def _shrunk_text(sub: pd.DataFrame) -> pd.Series:
    """`` [hidden=63]`` where the parameter budget shrank a core knob below its configured value (the
    record's ``core_knobs`` against its config's knobs; the draw ``seed`` moves by design), else ``""``.
    A label names the configured setting, so without this a shrunk core would pass for it."""

    def text(configured: Any, used: Any) -> str:
        conf, used = obj(configured), obj(used)
        if not isinstance(conf, dict) or not isinstance(used, dict):
            return ""
        changed = [f"{k}={v}" for k, v in used.items() if k != "seed" and (k not in conf or conf[k] != v)]
        return f" [trained at {', '.join(changed)}]" if changed else ""

    if "core_knobs" not in sub:
        return pd.Series("", index=sub.index, dtype=object)
    return pd.Series(
        [text(c, u) for c, u in zip(sub["knobs"], sub["core_knobs"], strict=True)], index=sub.index
    )


#: how the report names a task's context-only floor (:func:`~experiments.measure.tasks.data.context_floor`)
FLOOR_LABEL = "floor (modal answer from the context)"
#: how plots draw it: a horizontal line under the variants' lines, in long dark-grey dashes (the
#: legend entry of coinciding lines, :func:`~experiments.report.plots.coinciding_handle`, is short
#: light-grey dashes)
FLOOR_STYLE = {"colors": "0.2", "linestyles": [(0, (7, 3))], "linewidths": 1.4, "zorder": 1}


def draw_floor(ax: Any, floor: float) -> None:
    """A dashed line across ``ax`` at ``100 * floor`` (%). A line collection, not a Line2D: it is
    a reference level, not one of the panel's data lines (which the coinciding-line styling and the
    plot tests walk)."""
    ax.hlines(100 * floor, 0, 1, transform=ax.get_yaxis_transform(), **FLOOR_STYLE)


@functools.lru_cache(maxsize=256)
def _context_floor(task_json: str, seq_len: int, seed: int) -> float:
    """The context-only floor of one task run (its config as :func:`task_rows`' ``_task_json``), on
    the test set that run evaluated on; NaN for a task without one or a config this code cannot build.
    Cached: every variant of a store shares its few (task, N, seed) test sets."""
    cfg = {k: v for k, v in json.loads(task_json).items() if k not in _RETIRED_KEYS}
    try:
        floor = job_context_floor(cfg, seq_len, seed)
    except (ValueError, TypeError):  # an old record's task this code no longer builds: no floor
        return math.nan
    return math.nan if floor is None else floor


def context_floors(sub: pd.DataFrame) -> pd.Series:
    """Per row of :func:`task_rows`' ``sub``: the accuracy of predicting, at every scored position of
    its test set, the example's most frequent candidate answer seen in its input. Records do not carry
    it; it is recomputed from the record's task settings and seed (milliseconds per test set)."""
    if not len(sub) or "seed" not in sub or "seq_len" not in sub:
        return pd.Series(math.nan, dtype=float, index=sub.index)
    return pd.Series(
        [
            _context_floor(t, int(n), int(s)) if pd.notna(s) and pd.notna(n) else math.nan
            for t, n, s in zip(sub["_task_json"], sub["seq_len"], sub["seed"], strict=True)
        ],
        index=sub.index,
        dtype=float,
    )


# ---------------------------------------------------------------------------------------------- table
def _speed_beside(df: pd.DataFrame) -> pd.DataFrame:
    """Median kernel time (forward, forward+backward) and forward peak memory per (variant, N) and
    place (``_<field>`` columns of :data:`PLACE`, as text), from the ok kernel records of ``df`` that
    tables show."""
    cols = ["variant_label", "seq_len", *[f"_{c}" for c in PLACE], "fwd_ms", "fwd_bwd_ms", "peak_mib"]
    timing = of_kind(df, Kind.kernel)
    if not len(timing) or "status" not in timing:
        return pd.DataFrame(columns=cols)
    timing = timing[(timing["status"] == "ok") & timing.get("newest", True)].copy()
    if "valid" in timing:
        timing = timing[timing["valid"].astype(object) != False]  # noqa: E712 (None = not checked)
    if not len(timing):
        return pd.DataFrame(columns=cols)
    # a causal kernel record times the call of a causal model's rows (see task_rows)
    causal = timing["causal"].astype(bool) if "causal" in timing else pd.Series(False, index=timing.index)
    timing["variant_label"] = _variant_col(timing).where(~causal, _variant_col(timing) + " (causal)")
    timing = timing.assign(**{f"_{c}": _text(timing[c]) if c in timing else "nan" for c in PLACE})
    shape = [c for c in SHAPE if c in timing]
    timing["_shape"] = timing[shape].apply(lambda r: "|".join(_text(r)), axis=1) if shape else ""
    out = []
    places = [f"_{c}" for c in PLACE]
    for (v, n, *where), g in timing.groupby(["variant_label", "seq_len", *places]):
        row = {"variant_label": v, "seq_len": n, **dict(zip(places, where, strict=True))}
        if g["_shape"].nunique() > 1:  # a median over calls of several shapes is no call's figure
            out.append({**row, "fwd_ms": math.nan, "fwd_bwd_ms": math.nan, "peak_mib": math.nan})
            continue
        fwd = g[g.get("mode", pd.Series("fwd", index=g.index)) == "fwd"]
        bwd = g[g.get("mode", pd.Series("", index=g.index)) == "fwd_bwd"]
        row["fwd_ms"] = 1e3 * fwd["fwd_median_s"].median() if "fwd_median_s" in fwd and len(fwd) else math.nan
        has_fb = "fwd_bwd_median_s" in bwd and len(bwd)
        row["fwd_bwd_ms"] = 1e3 * bwd["fwd_bwd_median_s"].median() if has_fb else math.nan
        row["peak_mib"] = fwd["peak_mib"].median() if "peak_mib" in fwd and len(fwd) else math.nan
        out.append(row)
    return pd.DataFrame(out, columns=cols)


def _pm(mean: float, std: float, scale: float = 100.0) -> str:
    if mean is None or not math.isfinite(mean):
        return "n/a"
    if std is None or not math.isfinite(std):
        return f"{scale * mean:.1f}"
    return f"{scale * mean:.1f} ± {scale * std:.1f}"


def task_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (variant, task, N): accuracy over seeds beside cost, parameters, speed and memory.

    Numeric columns: ``seeds`` (ok runs), ``acc_mean``/``acc_std`` (test accuracy per answer token,
    std with ddof=1, NaN for one seed), ``floor`` (the context-only floor on the same runs' test sets,
    mean over them: :func:`context_floors`), ``exact_mean`` (whole answers right), ``final_loss``,
    ``steps`` (mean), ``capped`` (runs the time cap stopped), ``train_s``, ``step_ms``, ``params``,
    ``params_baseline``, and from the timing records
    ``fwd_ms``, ``fwd_bwd_ms``, ``peak_mib``. Text columns: ``accuracy`` (``mean ± std`` in %) and
    ``status`` (``ok``, or why no run counted: ``unsupported: <reason>``, ...).
    """
    sub = task_rows(df)
    keys = ["variant_label", "task_label", "seq_len"]
    cols = [
        *keys,
        "seeds",
        "accuracy",
        "acc_mean",
        "acc_std",
        "floor",
        "exact_mean",
        "final_loss",
        "steps",
        "capped",
        "train_s",
        "step_ms",
        "params",
        "params_baseline",
        "fwd_ms",
        "fwd_bwd_ms",
        "peak_mib",
        "status",
    ]
    if not len(sub):
        return pd.DataFrame(columns=cols)
    # a re-run replaces a seed's record, it does not add a seed; oldest first, so that a cell with no
    # ok run shows its newest run's status
    sub = sub[newest_runs(sub)].sort_values("started_at")
    sub = sub.assign(_floor=context_floors(sub))
    rows = []
    for (v, t, n), g in sub.groupby(keys, sort=True):
        ok = g[g["status"] == "ok"]
        row: dict[str, Any] = {"variant_label": v, "task_label": t, "seq_len": n, "seeds": len(ok)}
        # the kernel figures beside it are the same variant's where it ran (one place: see task_rows)
        row["_variant_base"] = g["_variant_base"].iloc[0]
        row.update({f"_{c}": _text(g[c]).iloc[0] if c in g else "nan" for c in PLACE})

        def stat(col: str, how: str = "mean", ok: pd.DataFrame = ok) -> float:
            if col not in ok or not len(ok):
                return math.nan
            vals = pd.to_numeric(ok[col], errors="coerce")
            return float(getattr(vals, how)()) if how != "std" else float(vals.std(ddof=1))

        row["acc_mean"], row["acc_std"] = stat("test_accuracy"), stat("test_accuracy", "std")
        # what a model that binds nothing scores on the same test sets (the runs' own seeds)
        row["floor"] = stat("_floor")
        row["exact_mean"] = stat("test_exact_match")
        row["final_loss"] = stat("final_loss")
        row["train_s"], row["step_ms"] = stat("train_s"), stat("step_ms")
        row["steps"] = stat("steps")
        capped = ok["stopped_early"] if "stopped_early" in ok else pd.Series(False, index=ok.index)
        row["capped"] = int((capped.astype(object) == True).sum())  # noqa: E712 (NaN for old records)
        row["params"], row["params_baseline"] = stat("params", "max"), stat("params_baseline", "max")
        row["accuracy"] = _pm(row["acc_mean"], row["acc_std"]) if len(ok) else "–"
        if len(ok):
            row["status"] = "ok" if len(ok) == len(g) else f"ok ({len(g) - len(ok)} failed)"
        else:
            first = g.iloc[-1]
            reason = first.get("reason")
            row["status"] = (
                f"{first['status']}: {reason}" if isinstance(reason, str) and reason else first["status"]
            )
        rows.append(row)
    table = pd.DataFrame(rows)
    speed = _speed_beside(df)
    if len(speed):
        speed = speed.rename(columns={"variant_label": "_variant_base"})
        table = table.merge(speed, on=["_variant_base", "seq_len", *[f"_{c}" for c in PLACE]], how="left")
    for c in cols:
        if c not in table:
            table[c] = math.nan
    return table[cols].rename(columns={"variant_label": "variant", "task_label": "task", "seq_len": "N"})


def markdown(table: pd.DataFrame) -> str:
    """``table`` as a GitHub Markdown table of its display columns (numbers rounded)."""
    show = ["variant", "task", "N", "seeds", "accuracy", "floor", "exact_mean", "steps", "train_s", "params"]
    show += ["params_baseline"]
    show += ["fwd_ms", "fwd_bwd_ms", "peak_mib", "status"]
    t = table[[c for c in show if c in table]].copy()
    if "floor" in t:
        t["floor"] = t["floor"].map(lambda x: "" if pd.isna(x) else f"{100 * x:.1f}")
    if "exact_mean" in t:
        t["exact_mean"] = t["exact_mean"].map(lambda x: "" if pd.isna(x) else f"{100 * x:.1f}")
    if "steps" in t:  # mean steps, and how many runs the time cap stopped
        t["steps"] = [
            "" if pd.isna(n) else f"{n:.0f}" + (f" ({c} capped)" if c else "")
            for n, c in zip(table["steps"], table["capped"], strict=True)
        ]
    for c in ("train_s", "fwd_ms", "fwd_bwd_ms", "peak_mib"):
        if c in t:
            t[c] = t[c].map(lambda x: "" if pd.isna(x) else f"{x:.3g}")
    for c in ("params", "params_baseline"):
        if c in t:
            t[c] = t[c].map(lambda x: "" if pd.isna(x) else f"{int(x)}")
    names = {
        "accuracy": "test acc % (mean ± std)",
        "floor": "floor % (modal answer from the context)",
        "exact_mean": "exact match %",
        "train_s": "train s",
        "params_baseline": "params (exact baseline)",
        "fwd_ms": "fwd ms",
        "fwd_bwd_ms": "fwd+bwd ms",
        "peak_mib": "fwd peak MiB",
    }
    return markdown_table(t.rename(columns=names).set_index("variant"))


def combined_markdown(table: pd.DataFrame) -> str:
    """Cost and quality in one Markdown table: one row per (variant, N), the test accuracy on every
    task side by side (mean ± std in %, with the mean training steps when the time cap cut a run
    short), then the kernel's forward and forward+backward time and forward peak memory at that N;
    last, per N, the tasks' context-only floors (:data:`FLOOR_LABEL`).
    ``table`` is :func:`task_table`'s output."""
    if not len(table):
        return ""
    tasks = sorted(table["task"].unique())
    out = []
    for (v, n), g in table.groupby(["variant", "N"], sort=True):
        row = {"variant": v, "N": n}
        for t in tasks:
            r = g[g["task"] == t]
            if not len(r):
                row[t] = ""
                continue
            r = r.iloc[0]
            cell = r["accuracy"] if r["seeds"] else str(r["status"]).split(":")[0]
            if r["seeds"] and r["capped"]:
                cell += f" ({r['steps']:.0f} steps)"
            row[t] = cell
        for c in ("fwd_ms", "fwd_bwd_ms", "peak_mib"):
            x = g[c].dropna()
            row[c] = f"{x.iloc[0]:.3g}" if len(x) else ""
        out.append(row)
    # a row per N: what a model that binds nothing scores on each task there (mean over the rows' runs)
    for n, g in table.groupby("N", sort=True):
        floor = {t: g.loc[g["task"] == t, "floor"].dropna() for t in tasks}
        if any(len(f) for f in floor.values()):
            row = {"variant": FLOOR_LABEL, "N": n, "fwd_ms": "", "fwd_bwd_ms": "", "peak_mib": ""}
            out.append(row | {t: f"{100 * f.mean():.1f}" if len(f) else "" for t, f in floor.items()})
    names = {t: f"{t} acc %" for t in tasks} | {
        "fwd_ms": "fwd ms",
        "fwd_bwd_ms": "fwd+bwd ms",
        "peak_mib": "fwd peak MiB",
    }
    return markdown_table(pd.DataFrame(out).rename(columns=names).set_index("variant"))


# ---------------------------------------------------------------------------------------------- plots
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (folders made as needed) and close it; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return path


def _window_size(row: pd.Series) -> float | None:
    """The window of a local_window record (tokens), else None."""
    knobs = obj(row.get("knobs")) if "knobs" in row else None
    if (
        isinstance(knobs, dict)
        and "window" in knobs
        and str(row.get("variant_name", "")).startswith("local_window")
    ):
        return float(knobs["window"])
    return None


def plot_recall_vs_distance(df: pd.DataFrame, path: str | Path) -> Path | None:
    """Recall test accuracy against key-to-query distance: a panel per (task, N), a line per variant
    (the same colour and marker in every panel, one legend for the figure); None if no recall record
    has per-distance accuracies.

    Bins are pooled over seeds weighted by their query counts; a dashed grey line marks the panel's
    context-only floor (:func:`context_floors`, mean over its records); a dotted line marks a local_window
    model's window: a query farther from its key than that cannot see it in one hop. (Stacked layers
    could relay up to layers x window, but a relay token cannot know which pair a later query
    will ask for, so in practice recall stops at the window.) Lines that coincide (exact variants at
    100%, say) take turns in dashes of their colours (:func:`~experiments.report.plots.coinciding_styles`).
    """
    sub = task_rows(df)
    sub = sub[(sub["task_name"] == "recall") & (sub["status"] == "ok")] if len(sub) else sub
    if not len(sub) or "acc_by_distance" not in sub:
        return None
    plt = _plt()
    from .plots import COINCIDE_SPAN, coinciding_handle, coinciding_styles  # matplotlib: only to draw

    facets = sorted({(str(t), int(n)) for t, n in zip(sub["task_label"], sub["seq_len"], strict=True)})
    cols = min(3, len(facets))
    rows = -(-len(facets) // cols)
    names = sorted(sub["variant_label"].astype(str).unique())
    # room on the right for the legend, and as tall as its entries (about 0.2 inch each) need
    size = (4.4 * cols + 3.6, max(3.2 * rows + 0.5, 0.2 * len(names) + 1.0))
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False, sharey=True, layout="constrained")
    # a colour and a marker per variant, the same in every panel: 20 colours, so no two lines look alike
    colours, markers = plt.get_cmap("tab20").colors, "osD^v<>pPX*h"
    style = {v: {"color": colours[i % 20], "marker": markers[i % len(markers)]} for i, v in enumerate(names)}
    ylim = (-2, 102)  # linear: lines within a line's width of each other are one line there
    drawn: set[str] = set()
    merged = False  # some panel's lines coincide somewhere (the legend says how they are drawn)
    several_n = sub["seq_len"].nunique() > 1
    for ax, (t, n) in zip(axes.flat, facets, strict=False):
        here = sub[(sub["task_label"].astype(str) == t) & (sub["seq_len"] == n)]
        floor = context_floors(here).mean()  # the same at every distance: the guess ignores the key
        if math.isfinite(floor):
            draw_floor(ax, floor)
        lines = [(v, g, *_recall_curve(g)) for v, g in here.groupby(here["variant_label"].astype(str))]
        lines = [line for line in lines if line[2]]
        atol = COINCIDE_SPAN * (ylim[1] - ylim[0])
        turns = coinciding_styles([(xs, ys) for _, _, xs, ys in lines], rtol=0.0, atol=atol)
        merged |= any(turn != "-" for turn in turns)
        for (v, g, xs, ys), turn in zip(lines, turns, strict=True):
            ax.plot(xs, ys, label=v, markersize=5, linestyle=turn, **style[v])
            drawn.add(v)
            window = _window_size(g.iloc[0])
            if window is not None and window < n:  # a window past the sequence blinds nothing
                ax.axvline(window, color=style[v]["color"], linestyle=":", linewidth=1)
        ax.set_title(f"{t}, N={n}" if several_n else t, fontsize=9)
        ax.set_xlabel("key-to-query distance (tokens, upper edge of bin)", fontsize=8)
        ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (%)")
    for ax in axes.flat[len(facets) :]:
        ax.set_visible(False)
    if not drawn:
        plt.close(fig)
        return None
    # the legend's lines solid, whatever a panel drew them as
    handles = [plt.Line2D([], [], markersize=5, label=v, **style[v]) for v in names if v in drawn]
    if merged:
        handles.append(coinciding_handle(lw=1.5))
    fig.legend(
        handles=handles,
        fontsize=8,
        loc="outside right center",
        frameon=False,
        title="variant",
    )
    fig.suptitle(
        "Associative recall: accuracy vs distance (dotted: local window size; dashed grey: "
        + FLOOR_LABEL
        + ")"
    )
    return save_figure(fig, path)


def _recall_curve(g: pd.DataFrame) -> tuple[list[int], list[float]]:
    """One variant's recall accuracy (%) per distance bin over the records ``g`` (its seeds): each
    bin's accuracies pooled, weighted by their query counts (a record without counts weighs 1 per
    bin). Bins sorted by distance; empty lists when no record has per-distance accuracies."""
    hits: dict[int, float] = {}
    counts: dict[int, float] = {}
    for _, r in g.iterrows():
        acc = obj(r["acc_by_distance"]) or {}
        cnt = obj(r.get("n_by_distance")) or {}
        for k, a in acc.items():
            c = float(cnt.get(k, 1))
            hits[int(k)] = hits.get(int(k), 0.0) + a * c
            counts[int(k)] = counts.get(int(k), 0.0) + c
    xs = sorted(hits)
    return xs, [100 * hits[x] / counts[x] for x in xs]


def _distinct_maps(one: pd.DataFrame, min_corr: float = 0.98) -> pd.DataFrame:
    """``one`` without maps that repeat an earlier map of the same (task, N): variants computing the
    same function from the same seed (naive, sdpa, chunked) often train to the same weights, and
    then their maps are one picture. A repeat (correlation at least ``min_corr`` with an earlier map)
    is dropped and its variant named in the kept row's ``variant_label`` (``naive = sdpa``).
    ``O(maps^2)`` comparisons."""
    kept: list[tuple[Any, np.ndarray]] = []  # (index, flattened weights)
    labels: dict[Any, str] = {}
    for idx, r in one.iterrows():
        w = np.asarray(obj(r["attention"])["weights"], dtype=float).ravel()
        for k_idx, kw in kept:
            k = one.loc[k_idx]
            if (k["task_label"], k["seq_len"]) != (r["task_label"], r["seq_len"]) or kw.shape != w.shape:
                continue
            if kw.std() > 0 and w.std() > 0 and np.corrcoef(kw, w)[0, 1] >= min_corr:
                labels[k_idx] += f" = {r['variant_label']}"
                break
        else:
            kept.append((idx, w))
            labels[idx] = str(r["variant_label"])
    out = one.loc[[i for i, _ in kept]].copy()
    out["variant_label"] = [labels[i] for i in out.index]
    return out


def plot_trained_attention(
    df: pd.DataFrame, path: str | Path, *, tasks: list[str] | None = None, max_maps: int = 24
) -> Path | None:
    """Heatmaps of the attention maps stored in task records (one per (variant, task, N), lowest
    seed; repeated pictures once, see :func:`_distinct_maps`), at most ``max_maps``; ``tasks``
    limits the task names (default: all). None if none."""
    sub = task_rows(df)
    if not len(sub) or "attention" not in sub:
        return None
    sub = sub[(sub["status"] == "ok") & sub["attention"].map(lambda a: isinstance(obj(a), dict))]
    if tasks is not None:
        sub = sub[sub["task_name"].isin(tasks)]
    if not len(sub):
        return None
    # sequence-to-sequence maps first (the anti-diagonal of a reversal model is the one to look at);
    # every task gets an equal share of the maps, one per (variant, N) at its lowest seed
    sub = sub.assign(_s2s=(sub["task_name"] != "reverse")).sort_values(
        ["_s2s", "task_label", "variant_label", "seq_len", "seed"]
    )
    one = sub.groupby(["task_label", "variant_label", "seq_len"], sort=False).head(1)
    picks = _distinct_maps(one)
    share = max(1, max_maps // picks["task_label"].nunique())
    picks = picks.groupby("task_label", sort=False).head(share).head(max_maps)
    plt = _plt()
    cols = min(4, len(picks))
    rows = math.ceil(len(picks) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.6 * cols, 3.9 * rows), squeeze=False, layout="constrained"
    )
    for ax in axes.flat[len(picks) :]:
        ax.axis("off")
    for ax, (_, r) in zip(axes.flat, picks.iterrows(), strict=False):
        att = obj(r["attention"])
        w = att["weights"]
        nq, nk = att.get("shape", [len(w), len(w[0])])
        stride = att.get("stride", 1)
        # extent in original positions, so a pooled map keeps its axes in tokens
        ax.imshow(w, cmap="viridis", aspect="auto", interpolation="nearest", extent=(0, nk, nq, 0))
        acc = r.get("test_accuracy")
        # the map's own run's accuracy: the lowest seed's, not the table's mean over seeds
        seed = f"seed {r['seed']}" if pd.notna(r.get("seed")) else "its run"
        acc_txt = (
            f", {seed} acc {100 * acc:.0f}%" if isinstance(acc, (int, float)) and math.isfinite(acc) else ""
        )
        title = f"{r['variant_label']}\n{r['task_label']} N={r['seq_len']}{acc_txt}"
        ax.set_title("\n".join(textwrap.wrap(title, 52, replace_whitespace=False)), fontsize=8)
        where = att.get("module", "")
        pooled = f", pooled x{stride}" if stride > 1 else ""
        ax.set_xlabel(f"key position\n({where}{pooled})", fontsize=7)
        ax.set_ylabel("query position", fontsize=7)
        ax.tick_params(labelsize=7)
    fig.suptitle("Trained attention weights (mean over heads, first test example)", fontsize=9)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- files
def write_report(df: pd.DataFrame, out_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Write ``task_table.md``/``.csv`` and (``plots``) the two plots into ``out_dir``; returns the
    files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = task_table(df)
    written = []
    table.to_csv(out / "task_table.csv", index=False)
    written.append(out / "task_table.csv")
    note = (
        "Test accuracy: exact match per answer token on the held-out split, mean ± std over seeds "
        "(std needs 2+ seeds). Floor: the accuracy of predicting, at every answer, the example's most "
        "frequent candidate answer in its input (recall: the modal value among its pairs; copy and "
        "reversal: the modal symbol, and EOS where reversal scores it), on the same test sets: a model "
        "at or below it has learnt no lookup (1 / vocabulary is not the floor: every value is in the "
        "context). fwd/fwd+bwd ms and peak MiB: the same variant's kernel timing records "
        "at that N, where the task ran, when the store has them for one call shape (batch, heads, head "
        "size...; of several, the Speed table shows each)."
    )
    combined = (
        "## Cost and quality\n\nTest accuracy per task (mean ± std over seeds, %; the mean steps "
        "in brackets when the time cap stopped training early) beside the kernel's time and memory "
        f"at that N; the last row per N is each task's {FLOOR_LABEL}.\n\n" + combined_markdown(table)
    )
    (out / "task_table.md").write_text(f"## Task accuracy\n\n{note}\n\n{markdown(table)}\n\n{combined}\n")
    written.append(out / "task_table.md")
    if plots:
        for p in (
            plot_recall_vs_distance(df, out / "recall_vs_distance.png"),
            plot_trained_attention(df, out / "trained_attention.png"),
        ):
            if p is not None:
                written.append(p)
    return written
