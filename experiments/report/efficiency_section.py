"""Training cost in the manner of Long Range Arena's Table 2 (``experiment=lra_efficiency``).

From task records that measured a training step's peak memory (``step_peak_mib``, set by the task
setting ``peak_memory``): per variant and N, training steps per second (from the median step after
the first, ``step_ms_median``) and the peak memory of one step, each also as a ratio to exact
attention (``sdpa``) of the same model at the same N (a causal model's rows against causal sdpa's),
as LRA reports its models against the vanilla Transformer. LRA's own published rows follow in a
table of their own, marked as theirs: they come from other hardware, another model and batch.

``O(records)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from ..records.store import newest_mask
from .format import markdown as markdown_table
from .task_section import task_rows

REFERENCE = "sdpa"  # the exact attention every row is compared with

#: Long Range Arena (Tay et al., ICLR 2021), Table 2: speed-up of training steps per second over
#: the vanilla Transformer at N = 1K, 2K, 3K, 4K (their byte-level text classification model,
#: batch 32, TPU v3), as published. Only the rows this suite has a counterpart of.
LRA_SPEEDUPS: dict[str, tuple[str, dict[int, float]]] = {}

COLS = ["variant", "N", "runs", "steps_per_s", "speedup", "peak_mib", "memory_ratio", "status"]


def efficiency_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (variant, N) of the task records with ``step_peak_mib`` (failed ones included
    when they are all a cell has): steps per second, peak MiB and both against sdpa's."""
    sub = task_rows(df)
    if not len(sub) or "step_peak_mib" not in sub:
        return pd.DataFrame(columns=COLS)
    sub = sub[sub["_task_json"].map(lambda j: bool(json.loads(j).get("peak_memory")))]
    if not len(sub):
        return pd.DataFrame(columns=COLS)
    key = "variant_key" if "variant_key" in sub else "variant_label"
    sub = sub[newest_mask(sub, [key, "_task_json", "seq_len", "seed"])]
    rows = []
    for (v, n), g in sub.groupby(["variant_label", "seq_len"], sort=True):
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
                "N": int(n),
                "runs": len(ok),
                "steps_per_s": 1e3 / step if step and math.isfinite(step) else math.nan,
                "peak_mib": peak,
                "status": status,
            }
        )
    out = pd.DataFrame(rows, columns=[c for c in COLS if c not in ("speedup", "memory_ratio")])
    # the reference of a row: sdpa in the same model (two-way, or causal: "sdpa (causal)")
    ref_label = out["variant"].map(lambda v: REFERENCE + (" (causal)" if v.endswith(" (causal)") else ""))
    ref = out.set_index(["variant", "N"])
    pick = list(zip(ref_label, out["N"], strict=True))
    ref_speed = [ref["steps_per_s"].get(k, math.nan) for k in pick]
    ref_peak = [ref["peak_mib"].get(k, math.nan) for k in pick]
    out["speedup"] = out["steps_per_s"] / pd.Series(ref_speed, index=out.index)
    out["memory_ratio"] = out["peak_mib"] / pd.Series(ref_peak, index=out.index)
    return out[COLS]


def efficiency_markdown(table: pd.DataFrame) -> str:
    """Steps per second (speed-up over sdpa) and peak MiB (ratio to sdpa's) per N, a row per variant;
    a cell without a run says why."""
    if not len(table):
        return ""
    ns = sorted(table["N"].unique())
    out = []
    for v, g in table.groupby("variant", sort=False):
        row = {"variant": v}
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
    cols = ["variant"] + [f"steps/s {n}" for n in ns] + [f"MiB {n}" for n in ns]
    return markdown_table(pd.DataFrame(out)[cols].set_index("variant"))


def reference_markdown() -> str:
    """LRA's published speed-ups (theirs, not measured here) as a Markdown table."""
    if not LRA_SPEEDUPS:
        return ""
    ns = sorted({n for _, by_n in LRA_SPEEDUPS.values() for n in by_n})
    rows = [
        {
            "LRA model (theirs)": model,
            "ours": ours,
            **{f"{n // 1024}K": f"{by_n[n]:.1f}x" if n in by_n else "" for n in ns},
        }
        for model, (ours, by_n) in LRA_SPEEDUPS.items()
    ]
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
    ref = reference_markdown()
    if ref:
        text += (
            "\n### Published by Long Range Arena (theirs, not measured here)\n\nSpeed-up of training "
            "steps per second over their vanilla Transformer (Tay et al. 2021, Table 2: byte-level text "
            "classification, batch 32, TPU v3), beside the variant here that computes the same kind "
            f"of attention.\n\n{ref}\n"
        )
    (out / "lra_efficiency.md").write_text(text)
    return [out / "lra_efficiency.csv", out / "lra_efficiency.md"]
