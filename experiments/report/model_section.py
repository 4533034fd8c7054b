"""The model jobs' section: a transformers model end to end with each variant as its attention."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from ..measure.model_job import MODEL_FIELDS, ModelSettings
from ..records.store import newest_mask
from .format import Section, num, obj
from .grouping import machine_marks, status_cell, varying_text


def _mix_label(m: dict) -> str:
    """What a model's layers and cache are beyond the plain Llama, in a few words (empty for it): the
    local/global mix (``3 sliding (513 keys) + 1 full (sdpa)``) and the rolling cache."""
    parts = []
    if m.get("sliding_window"):
        layers, every = int(m.get("layers") or 0), m.get("full_every")
        full = layers // every if every else 0
        on = f" ({m['full_variant']})" if m.get("full_variant") else ""
        parts.append(f"{layers - full} sliding ({m['sliding_window']} keys) + {full} full{on}")
    if m.get("rolling_cache"):
        parts.append("rolling cache")
    return ", ".join(parts)


def _iqr(steps: object) -> float:
    """Interquartile range of a record's per-step decode times (``decode_ms_steps``; NaN without)."""
    xs = obj(steps)
    if not isinstance(xs, list) or len(xs) < 2:
        return float("nan")
    q1, q3 = pd.Series(xs, dtype=float).quantile([0.25, 0.75])
    return float(q3 - q1)


def _model_title(row: pd.Series) -> str:
    """The table title of a model job: device, dtype, the model's shape and what was timed (its layer
    mix and cache are in the row's label: the models of one shape share a table)."""
    m = json.loads(row["model"])
    return (
        f"{row['device']} · {row['dtype']} · Llama-style, {m.get('layers')} layers, width {m.get('hidden')}, "
        f"{m.get('heads')} heads / {m.get('kv_heads')} K/V heads, batch {m.get('batch')}: "
        f"prefill {m.get('prefill_len')} tokens, then {m.get('new_tokens')} decoded"
    )


#: what else tells model jobs of one model apart: the host, the threads, the seed, a run's tags
_WHERE = ["env_host", "threads", "seed", "extra"]
#: the model settings a table's title (:func:`_model_title`) or a row's label (:func:`_mix_label`)
#: names; any other (the vocabulary) is named in the title where the models differ in it
_MIX = {"sliding_window", "full_every", "full_variant", "rolling_cache"}  # what _mix_label names
_NAMED = {"layers", "hidden", "heads", "kv_heads", "batch", "prefill_len", "new_tokens"} | _MIX
#: a setting a record lacks had its default (it was written before the setting existed)
_MODEL_DEFAULTS = asdict(ModelSettings())


def _other_settings(rows: pd.DataFrame) -> pd.Series:
    """Per row, `` · vocab=2048`` and the like: the model settings neither the title nor the row label
    names that take more than one value among ``rows`` (empty text where none do)."""
    models = pd.DataFrame(
        [{**_MODEL_DEFAULTS, **json.loads(v)} for v in rows["model"]], index=rows.index, dtype=object
    )
    return varying_text(models, [f for f in MODEL_FIELDS if f not in _NAMED])


def _row_label(row: pd.Series) -> str:
    """A model job's row: the variant, and the model's layer mix and cache when it has them."""
    mix = _mix_label(json.loads(row["model"]))
    return f"{row['variant']} · {mix}" if mix else str(row["variant"])


#: the model table's time columns: those that carry the machine's marks
_TIMES = ("prefill_ms", "decode_ms_per_token")


def model_table(rows: pd.DataFrame) -> Section:
    """Prefill time, time per decoded token and peak memory per variant, per model, of ``rows``: the
    model jobs' rows of the store (:func:`~experiments.records.store.of_kind`)."""
    sec = Section(
        "model",
        "A transformers model end to end",
        "Each variant as the attention of a random-weight Llama-style model (Hugging Face transformers, "
        "through attn_implementation='attnbench_<name>'). Prefill: median of 3 forwards of the prompt "
        "into an empty cache; decode: median time of one greedy step (one token against the cache), "
        "IQR: the interquartile range of the steps. "
        "K/V kept: the bytes one sequence's cache holds after decoding (every layer); K/V read: the "
        "bytes of it the layers' variants read in one step (a window reads its window, exact attention "
        "every key). Peak: CUDA allocator peak, or on the CPU the process high-water mark during the run "
        "(weights, cache and allocator slack included: an upper bound). A time marked `*` or `~`: "
        "measured beside other work or while the machine ran slow, as in the speed tables.",
    )
    if rows.empty:
        return sec
    rows = rows.assign(
        # two models that differ in a setting the title does not name would share a row: it names it
        _title=rows.apply(_model_title, axis=1) + _other_settings(rows) + varying_text(rows, _WHERE),
        _row=rows.apply(_row_label, axis=1),
        _len=rows["model"].map(lambda v: int(json.loads(v).get("prefill_len") or 0)),
        kv_mib_kept=pd.to_numeric(rows.get("kv_bytes_kept"), errors="coerce") / 2**20,
        kv_mib_read=pd.to_numeric(rows.get("kv_bytes_read_per_step"), errors="coerce") / 2**20,
        decode_iqr_ms=rows["decode_ms_steps"].map(_iqr) if "decode_ms_steps" in rows else float("nan"),
    )
    cols = {
        "prefill ms": "prefill_ms",
        "ms / decoded token": "decode_ms_per_token",
        "IQR": "decode_iqr_ms",
        "K/V MiB kept": "kv_mib_kept",
        "K/V MiB read / step": "kv_mib_read",
        "peak MiB": "peak_mib",
    }
    # tables by prompt length (as a number), then title; rows: plain models first, then by label
    for (_, title), sub in rows.groupby(["_len", "_title"], sort=True):
        sub = sub[newest_mask(sub, ["_row"])]
        sub = sub.assign(_mixed=sub["_row"] != sub["variant"]).sort_values(["_mixed", "_row"])
        sub = sub.set_index("_row").rename_axis("variant")
        tab = pd.DataFrame(index=sub.index)
        for name, col in cols.items():
            if col.startswith(("kv_", "decode_iqr")) and sub[col].isna().all():
                continue  # figures a record may lack (K/V bytes came with issue 33): no empty column
            # a time says what the job's load and canary said of the machine, as the kernel tables do
            mark = machine_marks if col in _TIMES else lambda r: ""
            tab[name] = [
                status_cell(r) or num(pd.to_numeric(r.get(col), errors="coerce")) + mark(r)
                for _, r in sub.iterrows()
            ]
        sec.parts.append((title, tab))
    keep = ["device", "dtype", "model", "variant", "status", "reason", *cols.values(), "config_hash", "path"]
    sec.data = rows.drop(columns="variant").rename(columns={"_row": "variant"}).reindex(columns=keep)
    sec.data = sec.data.reset_index(drop=True)
    return sec


def plot_context(rows: pd.DataFrame, path: Path) -> Path | None:
    """Time per decoded token (median, IQR bars) and the K/V MiB one sequence's cache keeps (solid)
    and a step reads (dashed) against the prompt length, one line per model setting and variant
    measured at two lengths or more; lines that coincide in a panel (the same cache in two variants)
    take turns in dashes of their colours (:func:`~experiments.report.plots.coinciding_styles`).
    ``rows``: the model jobs' shown rows. None when no line has two points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import COINCIDE_SPAN, coinciding_handle, coinciding_styles

    ok = rows[(rows["status"] == "ok")] if len(rows) else rows
    if ok.empty or "kv_bytes_kept" not in ok:
        return None
    ok = ok.assign(
        _m=ok["model"].map(lambda v: {k: x for k, x in json.loads(v).items() if k != "prefill_len"}),
        _n=ok["model"].map(lambda v: int(json.loads(v)["prefill_len"])),
    )
    # a line per variant and model (every setting but the prompt length) and where it ran; its label
    # names the model's mix and whatever of the rest differs between lines
    # (a setting a record lacks had its default; the mix's own settings are in its label already)
    shapes = pd.DataFrame([{**_MODEL_DEFAULTS, **m} for m in ok["_m"]], index=ok.index, dtype=object)
    differ = [c for c in shapes if c not in _MIX and shapes[c].astype(str).nunique(dropna=False) > 1]
    base = ok["variant"].astype(str) + " · " + ok["_m"].map(lambda m: _mix_label(m) or "Llama")
    extra = shapes.apply(lambda r: "".join(f" · {c}={r[c]}" for c in differ), axis=1) if differ else ""
    ok = ok.assign(_line=base + extra + varying_text(ok, ["device", "dtype", *_WHERE]))
    ok = ok[ok.groupby("_line")["_n"].transform("nunique") >= 2]
    if ok.empty:
        return None
    lines = sorted(ok["_line"].unique())
    colors = dict(zip(lines, plt.get_cmap("tab10").colors * 3, strict=False))
    markers = dict(zip(lines, "osD^vP*Xh<>p" * 3, strict=False))  # overlapping lines stay visible
    fig, (ax_t, ax_kept, ax_read) = plt.subplots(1, 3, figsize=(15, 4.6))
    style = {line: dict(marker=markers[line], color=colors[line], mfc="none", ms=7) for line in lines}
    subs = [ok[ok["_line"] == line].sort_values("_n") for line in lines]
    kept = [(sub["_n"], sub["kv_bytes_kept"].astype(float) / 2**20) for sub in subs]
    read = [(sub["_n"], sub["kv_bytes_read_per_step"].astype(float) / 2**20) for sub in subs]
    timed = []
    for line, sub in zip(lines, subs, strict=True):
        n = sub["_n"].to_numpy()
        med = pd.to_numeric(sub["decode_ms_per_token"], errors="coerce").to_numpy()
        steps = [pd.Series(obj(v), dtype=float) for v in sub["decode_ms_steps"]]
        lo = med - [s.quantile(0.25) for s in steps]
        hi = [s.quantile(0.75) for s in steps] - med
        timed.append(ax_t.errorbar(n, med, yerr=[lo, hi], capsize=3, label=line, **style[line]).lines[0])
    # lines that coincide take turns in dashes of their colours: the K/V panels' on their log axes, the
    # time panel's within a line's width of its linear axis (known once every line is drawn)
    bottom, top = ax_t.get_ylim()
    turns = coinciding_styles([ln.get_data() for ln in timed], rtol=0.0, atol=COINCIDE_SPAN * (top - bottom))
    for ln, turn in zip(timed, turns, strict=True):
        ln.set_linestyle(turn)
    merged = any(turn != "-" for turn in turns)
    for ax, series in ((ax_kept, kept), (ax_read, read)):
        turns = coinciding_styles(series)
        merged |= any(turn != "-" for turn in turns)
        for line, (n, mib), turn in zip(lines, series, turns, strict=True):
            ax.plot(n, mib, ls=turn, **style[line])
    ns = sorted(ok["_n"].unique())
    for ax in (ax_t, ax_kept, ax_read):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(x) for x in ns])
        ax.minorticks_off()
        ax.set_xlabel("prompt tokens (the context of each step)")
        ax.grid(alpha=0.3)
    for ax in (ax_kept, ax_read):
        ax.set_yscale("log")
    ax_t.set_title("ms per decoded token (median, IQR)", fontsize=10)
    ax_kept.set_title("K/V MiB the cache keeps (one sequence)", fontsize=10)
    ax_read.set_title("K/V MiB a decoding step reads", fontsize=10)
    # below the panels, kept whole in the file by bbox_inches="tight"; a line solid whatever a panel
    # drew it as
    handles = [plt.Line2D([], [], label=line, **style[line]) for line in lines]
    if merged:
        handles.append(coinciding_handle(lw=1.5))
    fig.legend(
        handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=2, frameon=False
    )
    first = ok.iloc[0]
    fig.suptitle(
        f"Decoding cost and K/V cache against the context ({first['device']}, {first['dtype']}, batch "
        f"{first['_m'].get('batch')}, {first['_m'].get('new_tokens')} tokens decoded after the prompt)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
