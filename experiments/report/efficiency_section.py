"""Training cost in the manner of Long Range Arena's Table 2 (``experiment=lra_efficiency``).

From task records that measured a training step's peak memory (``step_peak_mib``, set by the task
setting ``peak_memory``): per variant, task and N, training steps per second (from the median step
after the first, ``step_ms_median``) and the peak memory of one step, each also as a ratio to exact
attention (``sdpa``) of the same model (the same task config: ``task_label``) at the same N (a causal
model's rows against causal sdpa's), as LRA reports its models against the vanilla Transformer.
LRA's own published rows follow in a table of their own, marked as theirs: they come from other
hardware, another model and batch.

``O(records)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from ..records.store import variant_labels
from .format import markdown as markdown_table
from .task_section import newest_runs, task_rows

REFERENCE = "sdpa"  # the exact attention every row is compared with

#: Long Range Arena (Tay et al., ICLR 2021), Table 2, as printed: training steps per second (in
#: brackets there: the speed-up over their vanilla Transformer) and memory per TPU device in GB at
#: N = 1K, 2K, 3K, 4K; byte-level text classification, batch 32, 4x4 TPU v3 chips. Only the rows
#: this suite has a counterpart of: (their model, ours, steps/s, printed speed-up, GB).
LRA_TABLE2: tuple[tuple[str, str, tuple[float, ...], tuple[float, ...], tuple[float, ...]], ...] = (
    ("Transformer", "sdpa", (8.1, 4.9, 2.3, 1.4), (1.0, 1.0, 1.0, 1.0), (0.85, 2.65, 5.51, 9.48)),
    ("Local Attention", "local_window", (9.2, 8.4, 7.4, 7.4), (1.1, 1.7, 3.2, 5.3), (0.42, 0.76, 1.06, 1.37)),
    ("BigBird", "sparse", (7.4, 3.9, 2.7, 1.5), (0.9, 0.8, 1.2, 1.1), (0.77, 1.49, 2.18, 2.88)),
    ("Linformer", "linformer", (9.3, 9.1, 8.5, 7.7), (1.2, 1.9, 3.7, 5.5), (0.37, 0.55, 0.99, 0.99)),
    ("Linear Trans.", "linear", (9.1, 9.3, 8.6, 7.8), (1.1, 1.9, 3.7, 5.6), (0.37, 0.57, 0.80, 1.03)),
    ("Performer", "performer", (9.5, 9.4, 8.7, 8.0), (1.2, 1.9, 3.8, 5.7), (0.37, 0.59, 0.82, 1.06)),
)
LRA_NS = (1024, 2048, 3072, 4096)

COLS = ["variant", "task", "N", "runs", "steps_per_s", "speedup", "peak_mib", "memory_ratio", "status"]


def efficiency_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (variant, task, N) of the task records with ``step_peak_mib`` (failed ones
    included when they are all a cell has): steps per second, peak MiB and both against those of sdpa
    on the same task (``task_label``: a model of another width is another task) at the same N."""
    sub = task_rows(df)
    if not len(sub) or "step_peak_mib" not in sub:
        return pd.DataFrame(columns=COLS)
    sub = sub[sub["_task_json"].map(lambda j: bool(json.loads(j).get("peak_memory")))]
    if not len(sub):
        return pd.DataFrame(columns=COLS)
    sub = sub[newest_runs(sub)].copy()
    if "knobs" in sub and "variant_target" in sub:
        sub["variant_label"] = _labels_without_length(sub)
    rows = []
    # a task of other settings (d_model, layers, ...) is another model: its figures are never pooled
    for (v, t, n), g in sub.groupby(["variant_label", "task_label", "seq_len"], sort=True):
        ok = g[g["status"] == "ok"]
        step = pd.to_numeric(ok.get("step_ms_median"), errors="coerce").median() if len(ok) else math.nan
        peak = pd.to_numeric(ok.get("step_peak_mib"), errors="coerce").median() if len(ok) else math.nan
        last = g.iloc[-1]
        reason = last.get("reason")
        status = (
            "ok" if len(ok) else f"{last['status']}: {reason}" if isinstance(reason, str) else last["status"]
        )
        rows.append(
            {
                "variant": v,
                "task": t,
                "N": int(n),
                "runs": len(ok),
                "steps_per_s": 1e3 / step if step and math.isfinite(step) else math.nan,
                "peak_mib": peak,
                "status": status,
            }
        )
    out = pd.DataFrame(rows, columns=[c for c in COLS if c not in ("speedup", "memory_ratio")])
    # the reference of a row: sdpa in the same model (the same task, two-way or causal: "sdpa
    # (causal)"), run in the same place ("sdpa · threads=2", task_rows)
    where = out["variant"].map(dict(zip(sub["variant_label"], sub["_where"], strict=True)))
    causal = out["variant"].str.endswith(" (causal)")
    ref_label = REFERENCE + where + causal.map({True: " (causal)", False: ""})
    ref = out.set_index(["variant", "task", "N"])
    pick = list(zip(ref_label, out["task"], out["N"], strict=True))
    ref_speed = [ref["steps_per_s"].get(k, math.nan) for k in pick]
    ref_peak = [ref["peak_mib"].get(k, math.nan) for k in pick]
    out["speedup"] = out["steps_per_s"] / pd.Series(ref_speed, index=out.index)
    out["memory_ratio"] = out["peak_mib"] / pd.Series(ref_peak, index=out.index)
    return out[COLS]


def _labels_without_length(sub: pd.DataFrame) -> pd.Series:
    """Variant labels with the knobs that equal the row's N left out (linformer's ``max_len`` follows
    the length in experiment=lra_efficiency: it is the length, not a setting), a causal model's rows
    and the place where records ran in several marked as :func:`task_rows` marks them."""

    def knobs(row: pd.Series) -> str:
        kn = json.loads(row["knobs"]) if isinstance(row["knobs"], str) else {}
        return json.dumps({k: v for k, v in kn.items() if v != row["seq_len"]}, sort_keys=True)

    labels = variant_labels(sub.assign(knobs=sub.apply(knobs, axis=1))) + sub["_where"]
    causal = sub["variant_label"].str.endswith(" (causal)")
    return labels.where(~causal, labels + " (causal)")


def efficiency_markdown(table: pd.DataFrame) -> str:
    """Steps per second (speed-up over sdpa) and peak MiB (ratio to sdpa's) per N, a row per variant
    and task (the task named where the table has several); a cell without a run says why."""
    if not len(table):
        return ""
    ns = sorted(table["N"].unique())
    index = ["variant", "task"] if table["task"].nunique() > 1 else ["variant"]
    out = []
    for (v, t), g in table.groupby(["variant", "task"], sort=False):
        row = {"variant": v, "task": t}
        for n in ns:
            r = g[g["N"] == n]
            if not len(r):
                row[f"steps/s {n}"] = row[f"MiB {n}"] = ""
                continue
            r = r.iloc[0]
            if not r["runs"]:
                row[f"steps/s {n}"] = str(r["status"]).split(":")[0]
                row[f"MiB {n}"] = ""
                continue
            sp = "" if pd.isna(r["speedup"]) else f" ({r['speedup']:.2g}x)"
            mr = "" if pd.isna(r["memory_ratio"]) else f" ({r['memory_ratio']:.2g}x)"
            row[f"steps/s {n}"] = f"{r['steps_per_s']:.3g}{sp}"
            row[f"MiB {n}"] = f"{r['peak_mib']:.3g}{mr}"
        out.append(row)
    cols = index + [f"steps/s {n}" for n in ns] + [f"MiB {n}" for n in ns]
    return markdown_table(pd.DataFrame(out)[cols].set_index(index))


def reference_markdown() -> str:
    """LRA's published rows (theirs, not measured here) as a Markdown table: steps per second with
    the speed-up over their Transformer, and GB per device."""
    rows = []
    for model, ours, speed, ratio, mem in LRA_TABLE2:
        row = {"LRA model (theirs)": model, "counterpart here": ours}
        for n, sp, r in zip(LRA_NS, speed, ratio, strict=True):
            row[f"steps/s {n // 1024}K"] = f"{sp:g} ({r:g}x)"
        for n, gb in zip(LRA_NS, mem, strict=True):
            row[f"GB {n // 1024}K"] = f"{gb:g}"
        rows.append(row)
    return markdown_table(pd.DataFrame(rows).set_index("LRA model (theirs)"))


def write_report(df: pd.DataFrame, out_dir: str | Path) -> list[Path]:
    """``lra_efficiency.md``/``.csv`` in ``out_dir`` when the store has such records; the files."""
    table = efficiency_table(df)
    if not len(table):
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "lra_efficiency.csv", index=False)
    note = (
        "Training steps per second (the median step after the first; in brackets the speed-up over "
        "sdpa in the same model at the same N) and one training step's peak memory (MiB above what "
        "was held before it; in brackets the ratio to sdpa's). Measured here, on this machine."
    )
    text = f"## Training cost (after Long Range Arena's Table 2)\n\n{note}\n\n{efficiency_markdown(table)}\n"
    text += (
        "\n### Published by Long Range Arena (theirs, not measured here)\n\nTay et al. 2021, Table 2: "
        "training steps per second (the speed-up over their vanilla Transformer) and memory per "
        "device, byte-level text classification, batch 32, 4x4 TPU v3 chips; their models, "
        "hardware and batch, beside the variant here that computes the same kind of attention.\n\n"
        f"{reference_markdown()}\n"
    )
    (out / "lra_efficiency.md").write_text(text)
    return [out / "lra_efficiency.csv", out / "lra_efficiency.md"]
