"""The model jobs' section: a transformers model end to end with each variant as its attention."""

from __future__ import annotations

import json

import pandas as pd

from ..records.store import newest_mask
from .format import Section, num
from .grouping import status_cell


def _model_title(row: pd.Series) -> str:
    """The table title of a model job: device, dtype, the model's shape and what was timed."""
    m = json.loads(row["model"])
    return (
        f"{row['device']} · {row['dtype']} · Llama-style, {m.get('layers')} layers, width {m.get('hidden')}, "
        f"{m.get('heads')} heads / {m.get('kv_heads')} K/V heads, batch {m.get('batch')}: "
        f"prefill {m.get('prefill_len')} tokens, then {m.get('new_tokens')} decoded"
    )


def model_table(rows: pd.DataFrame) -> Section:
    """Prefill time, time per decoded token and peak memory per variant, per model, of ``rows``: the
    model jobs' rows of the store (:func:`~experiments.records.store.of_kind`)."""
    sec = Section(
        "model",
        "A transformers model end to end",
        "Each variant as the attention of a random-weight Llama-style model (Hugging Face transformers, "
        "through attn_implementation='attnbench_<name>'). Prefill: median of 3 forwards of the prompt "
        "into an empty cache; decode: median time of one greedy step (one token against the cache). "
        "Peak: CUDA allocator peak, or on the CPU the process high-water mark during the run (weights, "
        "cache and allocator slack included: an upper bound).",
    )
    if rows.empty:
        return sec
    rows = rows.assign(_title=rows.apply(_model_title, axis=1))
    cols = {"prefill ms": "prefill_ms", "ms / decoded token": "decode_ms_per_token", "peak MiB": "peak_mib"}
    for title, sub in rows.groupby("_title", sort=True):
        sub = sub[newest_mask(sub, ["variant"])].set_index("variant").sort_index()
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
