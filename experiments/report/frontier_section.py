"""The recall-versus-state frontier (``experiment=recall_frontier``): what a layer keeps to decode
against what the model recalls, after Zoology (Arora et al. 2023) and Based (2024).

Every recall task record carries ``state_bytes``, the bytes one sequence keeps per attention layer
to decode after ``N`` tokens (exact attention's K/V cache, a window's cache, a recurrence's fixed
state; :func:`experiments.measure.tasks.train.layer_state_bytes`). One point of the frontier is a
model configuration (variant and its knobs, width and heads) at one sequence length N and one number
of key-value pairs (a cache grows with N and the task changes with it: lengths are never pooled):

- :func:`frontier_table`: one row per configuration, N and number of pairs: state, test accuracy
  (mean and std over seeds), the context-only floor of the same test sets (what a model binding no
  key scores by answering each example's most frequent pair value), training step time and
  inference time per token (medians over seeds).
- :func:`frontier_markdown`: the same with the pair counts side by side, a row per configuration and
  N, and a floor row per N.
- :func:`plot_frontier`: accuracy against state, one panel per N and number of pairs, one line per
  variant through its configurations in order of state, error bars one std over seeds, each seed a
  faint dot, the floor a dashed grey line.

Drawn when the store's recall records with ``state_bytes`` cover at least two variants.
``O(records)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from .format import markdown as markdown_table
from .format import obj
from .task_section import (
    _TRAINING_KEYS,
    FLOOR_LABEL,
    _plt,
    context_floors,
    draw_floor,
    newest_runs,
    save_figure,
    task_rows,
)

COLS = [
    "variant",
    "variant_name",
    "N",
    "pairs",
    "d_model",
    "heads",
    "state_bytes",
    "seeds",
    "acc_mean",
    "acc_std",
    "floor",
    "accs",
    "step_ms",
    "infer_us_per_token",
    "status",
]


def _recall_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The newest recall record per (variant, task config, N, seed) with ``pairs``, ``d_model`` and
    ``heads`` columns, only those that carry ``state_bytes`` (or failed before measuring it)."""
    sub = task_rows(df)
    if not len(sub) or "state_bytes" not in sub:
        return sub.iloc[0:0]
    sub = sub[sub["task_name"] == "recall"]
    sub = sub[newest_runs(sub)].copy()
    task = sub["_task_json"].map(obj)
    sub["pairs"] = task.map(lambda t: t.get("num_pairs", 16))  # Recall's default when unset
    sub["d_model"] = task.map(lambda t: t["d_model"])
    sub["heads"] = task.map(lambda t: t["heads"])
    # another training setting (steps, lr, ...) is another configuration: its label names it
    shown = {"num_pairs", "d_model", "heads", "name", "causal", *_TRAINING_KEYS}
    keys = sorted({k for t in task for k in t if k not in shown})
    vary = [k for k in keys if len({json.dumps(t.get(k), sort_keys=True) for t in task}) > 1]
    sub["variant_label"] += task.map(lambda t: "".join(f" · {k}={t.get(k)}" for k in vary))
    measured = pd.to_numeric(sub["state_bytes"], errors="coerce").notna()
    sub = sub[measured | (sub["status"] != "ok")]
    return sub.assign(_floor=context_floors(sub))


def frontier_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (variant, pairs, d_model, heads, N) of the recall records (see module doc)."""
    sub = _recall_rows(df)
    if not len(sub) or sub["variant_name"].nunique() < 2:
        return pd.DataFrame(columns=COLS)
    rows = []
    for (v, p, d, h, n), g in sub.groupby(["variant_label", "pairs", "d_model", "heads", "seq_len"]):
        ok = g[g["status"] == "ok"]

        def num(col: str, ok: pd.DataFrame = ok) -> pd.Series:
            return pd.to_numeric(ok[col], errors="coerce") if col in ok else pd.Series(dtype=float)

        acc = num("test_accuracy")
        rows.append(
            {
                "variant": v,
                "variant_name": g["variant_name"].iloc[0],
                "N": int(n),
                "pairs": int(p),
                "d_model": int(d),
                "heads": int(h),
                "state_bytes": num("state_bytes").median() if len(ok) else math.nan,
                "seeds": len(ok),
                "acc_mean": acc.mean() if len(ok) else math.nan,
                "acc_std": acc.std(ddof=1) if len(ok) > 1 else math.nan,
                # what binding no key scores on the same test sets (mean over the runs' seeds)
                "floor": num("_floor").mean() if len(ok) else math.nan,
                "accs": [float(a) for a in acc],  # each seed's, for the plot
                "step_ms": num("step_ms").median() if len(ok) else math.nan,
                "infer_us_per_token": num("infer_us_per_token").median() if len(ok) else math.nan,
                "status": "ok"
                if len(ok) == len(g)
                else f"{len(g) - len(ok)} of {len(g)} {g['status'].iloc[-1]}",
            }
        )
    out = pd.DataFrame(rows, columns=COLS)
    order = ["variant", "N", "state_bytes", "d_model", "heads", "pairs"]
    return out.sort_values(order).reset_index(drop=True)


def frontier_markdown(table: pd.DataFrame) -> str:
    """``table`` as Markdown: one row per configuration and N, test accuracy per number of pairs side
    by side (mean ± std over seeds, %), the state per layer, and the times (medians over every run of
    the configuration at that N); last, per N, the context-only floor per number of pairs
    (:data:`~experiments.report.task_section.FLOOR_LABEL`, mean over the table's rows)."""
    if not len(table):
        return ""
    pairs = sorted(table["pairs"].unique())
    out = []
    # a row per N too: the state after N tokens and the accuracy at N are one length's
    for (v, d, h, n), g in table.groupby(["variant", "d_model", "heads", "N"], sort=False):
        row: dict[str, Any] = {"variant": v, "model": f"{d} = {h} x {d // h}", "N": n}
        row["state KiB / layer"] = f"{g['state_bytes'].median() / 1024:.3g}"
        for p in pairs:
            r = g[g["pairs"] == p]
            if not len(r):
                row[f"{p} pairs"] = ""
                continue
            r = r.iloc[0]
            if not r["seeds"]:
                row[f"{p} pairs"] = str(r["status"])
                continue
            std = "" if pd.isna(r["acc_std"]) else f" ± {100 * r['acc_std']:.1f}"
            row[f"{p} pairs"] = f"{100 * r['acc_mean']:.1f}{std}"
        row["train step ms"] = f"{g['step_ms'].median():.3g}"
        row["inference µs / token"] = f"{g['infer_us_per_token'].median():.3g}"
        out.append(row)
    # a row per N: what a model that binds no key scores (the modal pair value of each example)
    for n, g in table.groupby("N", sort=True):
        floor = {p: g.loc[g["pairs"] == p, "floor"].dropna() for p in pairs}
        if any(len(f) for f in floor.values()):
            row = {"variant": FLOOR_LABEL, "model": "", "N": n, "state KiB / layer": ""}
            row |= {f"{p} pairs": f"{100 * f.mean():.1f}" if len(f) else "" for p, f in floor.items()}
            out.append(row | {"train step ms": "", "inference µs / token": ""})
    return markdown_table(pd.DataFrame(out).set_index("variant"))


def plot_frontier(table: pd.DataFrame, path: str | Path) -> Path | None:
    """Test accuracy against state bytes per layer (log scale), a panel per N (rows) and number of
    pairs (columns), a line per variant (its configurations in order of state, error bars one std over
    seeds; lines that coincide take turns in dashes of their colours,
    :func:`~experiments.report.plots.coinciding_styles`), and a dashed grey line at the panel's
    context-only floor (what binding no key scores; the title names it); None when the table is
    empty."""
    table = table[table["seeds"] > 0]
    if not len(table):
        return None
    plt = _plt()
    from .plots import COINCIDE_SPAN, coinciding_handle, coinciding_styles  # matplotlib: only to draw

    pairs = sorted(table["pairs"].unique())
    ns = sorted(table["N"].unique())
    fig, axes = plt.subplots(
        len(ns),
        len(pairs),
        figsize=(4.2 * len(pairs), 4.0 * len(ns)),
        sharey=True,
        squeeze=False,
        layout="constrained",  # a row's axis labels clear the next row's titles
    )
    colours = plt.get_cmap("tab10").colors
    markers = "osD^v<>pPX*h"
    names = sorted(table["variant_name"].unique())
    style = {
        name: {"color": colours[i % len(colours)], "marker": markers[i % len(markers)]}
        for i, name in enumerate(names)
    }
    ylim = (-2, 102)  # linear: lines within a line's width of each other are one line there
    merged = False  # some panel's lines coincide somewhere (the legend says how they are drawn)
    floored = False  # some panel has a floor line
    # a line joins one length's configurations: a point at another N is another state and task
    for ax, (n, p) in zip(axes.flat, [(n, p) for n in ns for p in pairs], strict=True):
        here = table[(table["N"] == n) & (table["pairs"] == p)]
        if not len(here):
            ax.set_title(f"{p} key-value pairs, N={n}: no run")
            ax.axis("off")
            continue
        floor = here["floor"].mean()  # the panel's floor: what binding no key scores
        if math.isfinite(floor):
            draw_floor(ax, floor)
            floored = True
        lines = [(name, here[here["variant_name"] == name]) for name in names]
        lines = [(name, g.sort_values(["state_bytes", "acc_mean"])) for name, g in lines if len(g)]
        atol = COINCIDE_SPAN * (ylim[1] - ylim[0])
        turns = coinciding_styles(
            [(g["state_bytes"] / 1024, 100 * g["acc_mean"]) for _, g in lines], rtol=0.0, atol=atol
        )
        merged |= any(turn != "-" for turn in turns)
        for (name, g), turn in zip(lines, turns, strict=True):
            ax.errorbar(
                g["state_bytes"] / 1024,
                100 * g["acc_mean"],
                yerr=100 * g["acc_std"].fillna(0.0),
                label=name,
                markersize=5,
                capsize=2,
                linewidth=1.2,
                linestyle=turn,
                **style[name],
            )
            # every seed as a faint dot: a spread can be one seed that learned and two that did not
            seeds = g.explode("accs").dropna(subset=["accs"])
            ax.scatter(
                seeds["state_bytes"] / 1024,
                100 * seeds["accs"].astype(float),
                **style[name],
                s=20,
                alpha=0.5,
                linewidths=0,
            )
        ax.set_xscale("log", base=2)
        ax.set_title(f"{p} key-value pairs, N={n}")
        ax.set_xlabel("state per layer (KiB, log scale)")
        ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("test accuracy (%)")
    most = int(table["seeds"].max())
    seq = ", ".join(str(x) for x in sorted({int(d) for d in table["d_model"]}))
    # the floor is named in the title, as the distance plot names its window lines: the legend's
    # lines are the variants' (solid) and the coinciding-dashes entry only
    floor_text = f"; dashed grey: {FLOOR_LABEL}" if floored else ""
    fig.suptitle(
        f"Associative recall against decoding state (width {seq}; mean ± std over up to {most} seeds"
        f"{floor_text})",
        fontsize=10,
    )
    # one legend for the figure: a variant missing from one panel is still named, its line solid
    # whatever a panel drew it as
    handles = [plt.Line2D([], [], markersize=5, lw=1.2, label=name, **style[name]) for name in names]
    if merged:
        handles.append(coinciding_handle(lw=1.2))
    axes[0][-1].legend(
        handles=handles,
        fontsize=8,
        loc="center left",
        bbox_to_anchor=(1.02, 0.5),
        frameon=False,
    )
    return save_figure(fig, path)


def write_report(df: pd.DataFrame, out_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """``recall_frontier.md``/``.csv`` and (``plots``) ``recall_frontier.png`` in ``out_dir`` when the
    store has a frontier; the files written."""
    table = frontier_table(df)
    if not len(table):
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "recall_frontier.csv", index=False)
    note = (
        "Multi-query associative recall: test accuracy (mean ± std over seeds, %) per number of "
        "key-value pairs, beside the bytes one sequence keeps per attention layer to decode after N "
        "tokens (`state_bytes`: the K/V cache of exact attention, the cache a window reads, the fixed "
        "state of a recurrence), the training step time and the trained model's inference time per "
        "token (medians over the configuration's runs; timings depend on the machine's load). "
        f"The last row per N, {FLOOR_LABEL}, is what a model that binds no key scores on the same "
        "test sets by predicting each example's most frequent pair value at every query: every value "
        "is in the context, so that, not 1 / num_values, is the floor, and it falls as the pairs grow."
    )
    (out / "recall_frontier.md").write_text(
        f"## Recall against state\n\n{note}\n\n{frontier_markdown(table)}\n"
    )
    written = [out / "recall_frontier.csv", out / "recall_frontier.md"]
    if plots and (p := plot_frontier(table, out / "recall_frontier.png")) is not None:
        written.append(p)
    return written
