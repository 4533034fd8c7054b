"""The pretrained jobs' section: what each variant keeps of a pretrained encoder, beside its cost.

- :func:`fidelity_table`: one table per (device, dtype, encoder, N): kept pairs, the model's attention
  mass inside the pattern, embedding cosine (mean, 5th percentile), retrieval agreement, time per batch
  and peak memory; a length beyond what the model was trained on says so in the table's title. The
  floors of ``<store>/floor.json`` (``scripts/pretrained_floor.py``: attention removed, uniform
  weights) on the same texts are rows too, and a dashed line in the frontier plot.
- :func:`ablation_table`: variants with a global block (sparse's ``global_blocks``) beside the same
  layout without it.
- :func:`plot_frontier`: the cost-quality frontier per length (mean cosine against time per batch, and
  against the share of pairs kept), the points on the frontier filled.
- :func:`plot_token_mass`: per layer, the unmodified model's attention mass on the first token and
  on the diagonal band, per length, and inside each pattern at the longest length.

:func:`write_report` writes ``pretrained.md``, ``pretrained.csv`` (the tables' floor rows too, named
in its column ``floor``) and the plots (the report, :mod:`experiments.report.report`, calls it when
the store has pretrained records). ``O(records)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.path import Path as MarkerPath  # noqa: E402

from ..measure.pretrained.fidelity import reweights  # noqa: E402
from ..measure.pretrained.job import DEFAULTS as ENCODER_DEFAULTS  # noqa: E402
from ..measure.spec import Kind  # noqa: E402
from ..records.store import is_true, newest_mask, of_kind  # noqa: E402
from .format import markdown, num, obj  # noqa: E402
from .grouping import machine_marks, varying_text  # noqa: E402
from .plots import COINCIDE_SPAN, coinciding_handle, coinciding_styles, palette  # noqa: E402

DPI = 110
# one measurement: the same values here are the same configuration (the newest one is shown)
_IDENT = ["env_host", "device", "dtype", "threads", "seed", "extra", "pretrained", "variant_key", "seq_len"]
# one table, one frontier: records that may be compared with each other
GROUP = ["env_host", "device", "dtype", "_encoder", "_corpus", "threads", "seed", "extra"]
# named in a set's title only where the store has more than one value
_NAMED_IF_SEVERAL = ("threads", "seed", "extra")
# columns the figures of a pretrained record fill (absent when no job of the store got that far)
_FIGURES = [
    "kept_pairs", "kept_pairs_layers", "mass_inside_mean", "mass_inside", "mass_first_token", "mass_band",
    "band", "cosine_mean",
    "cosine_p5", "cosine_min", "top1_agreement", "top5_agreement", "retrieval_top1", "retrieval_top1_ref",
    "batch_ms_median", "batch_ms_iqr", "batch_ms_unstable", "batch_ms_runs", "batch_texts", "tokens_per_s",
    "peak_mib",
    "texts", "texts_available", "subsampled", "beyond_trained", "trained_len", "corpus_sha256",
    "corpus_sentences", "corpus_recipe", "texts_sha256", "python", "threads",
]  # fmt: skip


def _full_layers(v: object) -> list[int]:
    """The ``full_layers`` of a record's encoder settings (``pretrained``, as JSON text): [] for none."""
    return list((obj(v) or {}).get("full_layers") or [])


def _mix_suffix(v: object) -> str:
    """What a row's label adds for a local/global layer mix: `` + sdpa on layers 0,5``; empty without."""
    full = _full_layers(v)
    return f" + sdpa on layers {','.join(str(i) for i in full)}" if full else ""


def _encoder_text(rows: pd.DataFrame) -> pd.Series:
    """Per row, the encoder's name and the encoder settings that take more than one value among
    ``rows`` (``minilm · batch=32``), ``full_layers`` left to the row labels. ``O(rows)``."""
    # a setting a record lacks had its default (it was written before the setting existed)
    enc = pd.DataFrame(
        [{**ENCODER_DEFAULTS, **(obj(v) or {})} for v in rows["pretrained"]], index=rows.index, dtype=object
    )
    settings = [c for c in enc if c not in ("name", "full_layers")]
    return enc["name"].astype(str) + varying_text(enc.map(_hashable), settings)


def _hashable(v: object) -> object:
    """A setting's value as a table cell can hold and compare it (a list as its JSON text)."""
    return json.dumps(v) if isinstance(v, (list, tuple, dict)) else v


def pretrained_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The pretrained records, the newest measurement of each (host, device, dtype, encoder settings,
    variant and knobs, N), with every figure column present (NaN where a job did not get that far),
    the label ``variant`` naming a layer mix's full layers, and the grouping columns ``_encoder`` (the
    encoder's name, and its settings where the records differ in them: two settings are two tables)
    and ``_corpus`` (the corpus hash, short)."""
    rows = of_kind(df, Kind.pretrained)
    rows = rows[newest_mask(rows, _IDENT)] if len(rows) else rows
    rows = rows.reindex(columns=[*rows.columns, *(c for c in _FIGURES if c not in rows.columns)])
    return rows.assign(
        variant=rows["variant"].astype(str) + rows["pretrained"].map(_mix_suffix),
        _encoder=_encoder_text(rows) if len(rows) else "",
        # a job that did not run has no hash: it joins the table of the corpus its length was run on
        _corpus=rows["corpus_sha256"]
        .map(lambda h: str(h)[:12] if isinstance(h, str) else "")
        .replace("", np.nan)
        .groupby(rows["seq_len"])
        .transform(lambda s: s.ffill().bfill())
        .fillna("n/a"),
    )


def _groups(rows: pd.DataFrame) -> list[tuple[dict[str, Any], pd.DataFrame]]:
    """``(keys, rows)`` per comparable set (host, device, dtype, encoder, corpus, threads, seed, extra)."""
    rows = rows.assign(**{c: rows[c] if c in rows else None for c in GROUP})
    return [
        (dict(zip(GROUP, k, strict=True)), sub) for k, sub in rows.groupby(GROUP, sort=True, dropna=False)
    ]


def _several(rows: pd.DataFrame) -> set[str]:
    """The :data:`GROUP` fields that take more than one value in ``rows``: a set's title names them."""
    return {c for c in GROUP if c in rows and rows[c].astype(str).nunique(dropna=False) > 1}


def _group_title(keys: dict[str, Any], several: set[str]) -> str:
    parts = [str(keys["device"]), str(keys["dtype"]), str(keys["_encoder"])]
    if "env_host" in several:
        parts.insert(0, str(keys["env_host"]))
    if "_corpus" in several:
        parts.append(f"corpus {keys['_corpus']}")
    parts += [f"{c}={keys[c]}" for c in _NAMED_IF_SEVERAL if c in several]
    return " · ".join(parts)


def _beyond(sub: pd.DataFrame) -> int | None:
    """The trained length when ``sub``'s length is beyond it, else None."""
    ok = sub[sub["status"] == "ok"]
    if len(ok) and bool(ok["beyond_trained"].fillna(False).astype(bool).any()):
        return int(pd.to_numeric(ok["trained_len"], errors="coerce").max())
    return None


def _pct(x: object, digits: int = 0) -> str:  # a share in [0, 1] as a percentage
    v = pd.to_numeric(x, errors="coerce")
    return "n/a" if pd.isna(v) else f"{100 * v:.{digits}f}"


def _dec(x: object, digits: int) -> str:
    v = pd.to_numeric(x, errors="coerce")
    return "n/a" if pd.isna(v) else f"{v:.{digits}f}"


def _time_text(row: pd.Series) -> str:
    """``median (IQR)``; ``(IQR n/a)`` from one timed batch (no spread was measured), `` unstable``
    where the record says its batches never settled, `` *`` and `` ~`` where its job ran beside other
    work or while the machine ran slow (:func:`~.grouping.machine_marks`), as the kernel tables mark a
    time."""
    med, iqr = (pd.to_numeric(row.get(k), errors="coerce") for k in ("batch_ms_median", "batch_ms_iqr"))
    if pd.isna(med):
        return "n/a"
    runs = row.get("batch_ms_runs")
    spread = "IQR n/a" if isinstance(runs, list | tuple | np.ndarray) and len(runs) < 2 else num(iqr)
    unstable = " unstable" if is_true(row.get("batch_ms_unstable")) else ""
    return f"{num(med)} ({spread})" + machine_marks(row) + unstable


def _mass_text(row: pd.Series) -> str:
    """The mass inside the pattern, ``n/a`` where the variant weighs every pair its own way
    (:func:`~..measure.pretrained.fidelity.reweights`; a name not registered shows its figure)."""
    import variants

    try:
        if reweights(variants.get(str(row.get("variant_name")))):
            return "n/a"
    except variants.UnknownVariant:
        pass
    return _pct(row.get("mass_inside_mean"))


COLUMNS = {
    "pairs kept %": lambda r: _pct(r.get("kept_pairs")),
    "attn mass inside %": _mass_text,
    "cosine mean": lambda r: _dec(r.get("cosine_mean"), 5),
    "cosine p5": lambda r: _dec(r.get("cosine_p5"), 4),
    "top-1 agree %": lambda r: _pct(r.get("top1_agreement")),
    "top-5 agree %": lambda r: _pct(r.get("top5_agreement")),
    "retrieval top-1 %": lambda r: _pct(r.get("retrieval_top1")),
    "ms / batch (IQR)": _time_text,
    "peak MiB": lambda r: num(pd.to_numeric(r.get("peak_mib"), errors="coerce")),
}


#: the floor file (``scripts/pretrained_floor.py``): next to a records folder, ``<store>/floor.json``
FLOOR_FILE = "floor.json"


def load_floors(df: pd.DataFrame) -> list[dict[str, Any]]:
    """The floor files of the store's records: ``<store>/floor.json`` beside each folder ``<store>/<x>/``
    that holds records (``path``), each read once, in path order. ``O(record folders)``."""
    if "path" not in df:
        return []
    stores = sorted({Path(str(p)).parent.parent for p in df["path"].dropna().unique()})
    # each file keeps where it was read (``_path``): the CSV's floor rows name it as a record's path
    return [
        {**json.loads((d / FLOOR_FILE).read_text()), "_path": str(d / FLOOR_FILE)}
        for d in stores
        if (d / FLOOR_FILE).is_file()
    ]


def _matching_floors(
    floors: list[dict[str, Any]], sub: pd.DataFrame
) -> list[tuple[dict[str, Any], dict[str, Any], str]]:
    """``(floor file, its entry at sub's N, floor name)`` of the main floors (attention removed,
    uniform) measured on the very texts of ``sub``'s ok records (one N, one comparable set): the same
    texts' SHA-256, the same encoder package and dtype; none when no floor file matches (another
    corpus, N or encoder)."""
    ok = sub[sub["status"] == "ok"]
    hashes = set(ok["texts_sha256"].dropna().astype(str))
    if len(hashes) != 1 or len(ok) == 0:
        return []
    r = ok.iloc[0]
    n, package = int(r["seq_len"]), (obj(r["pretrained"]) or {}).get("package", ENCODER_DEFAULTS["package"])
    out = []
    for floor in floors:
        at = floor.get("lengths", {}).get(str(n))
        settings = floor.get("settings", {})
        if at is None or at.get("texts_sha256") not in hashes:
            continue
        if settings.get("package") != package or settings.get("dtype") != r["dtype"]:
            continue
        out += [(floor, at, k) for k in floor.get("main", [])]
    return out


def floor_label(floor: dict[str, Any], name: str) -> str:
    """How the tables (and the CSV's ``variant``) name floor ``name`` of a floor file."""
    return f"floor: {floor['names'][name]}"


def floor_rows(floors: list[dict[str, Any]], sub: pd.DataFrame) -> list[tuple[str, dict[str, Any]]]:
    """``(label, figures)`` of the floors of :func:`_matching_floors`: what the tables show."""
    return [(floor_label(f, k), at["floors"][k]) for f, at, k in _matching_floors(floors, sub)]


def fidelity_table(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """``(title, table)`` per comparable set and N, rows by variant (best mean cosine first; jobs that
    did not run show their status); a length beyond the model's training says so in its title. The
    floors of :func:`load_floors` measured on the same texts (:func:`floor_rows`) are rows too, ranked
    by their cosine among the variants, their pairs, mass, time and memory ``n/a``."""
    rows = pretrained_rows(df)
    if rows.empty:
        return []
    floors = load_floors(df)
    several = _several(rows)
    out = []
    for keys, grp in _groups(rows):
        for n, sub in grp.groupby("seq_len", sort=True):
            # ranked by the cosine as shown (5 decimals), so exact variants tie and list by name
            entries = [
                (
                    r["cosine_mean"],
                    r["variant"],
                    [fmt(r) if r["status"] == "ok" else str(r["status"]) for fmt in COLUMNS.values()],
                )
                for _, r in sub.iterrows()
            ]
            entries += [
                (f["cosine_mean"], label, [fmt(f) for fmt in COLUMNS.values()])
                for label, f in floor_rows(floors, sub)
            ]
            order = [pd.to_numeric(e[0], errors="coerce") for e in entries]
            order = [-1.0 if pd.isna(v) else round(float(v), 5) for v in order]
            ranked = sorted(zip(order, entries, strict=True), key=lambda oe: (-oe[0], oe[1][1]))
            tab = pd.DataFrame(
                [e[2] for _, e in ranked],
                index=pd.Index([e[1] for _, e in ranked], name="variant"),
                columns=list(COLUMNS),
            )
            title = f"{_group_title(keys, several)} · N={int(n)}"
            trained = _beyond(sub)
            if trained is not None:
                title += f" · BEYOND the {trained} tokens the model was trained on"
            out.append((title, tab))
    return out


#: the ablations the report pairs up: title -> (where the setting lives, its name). A record with the
#: setting on is shown beside the record that differs only by the setting off (0, or no layers)
ABLATIONS = {
    "the global block": ("knob", "global_blocks"),
    "the sink tokens": ("knob", "sink_tokens"),
    "full-attention layers": ("pretrained", "full_layers"),
}


def _without(r: pd.Series, where: str, key: str) -> tuple[str, str] | None:
    """``(knobs, pretrained)`` JSON of the record that is ``r`` with the setting off; None when ``r``
    has it off already."""
    knobs, enc = json.loads(r["knobs"]), obj(r["pretrained"]) or {}
    if where == "knob":
        if not knobs.get(key):
            return None
        knobs = {**knobs, key: 0}
    else:
        if not enc.get(key):
            return None
        enc = {**enc, key: []}
    return json.dumps(knobs, sort_keys=True), json.dumps(enc, sort_keys=True, default=str)


def ablation_table(df: pd.DataFrame, setting: str = "the global block") -> pd.DataFrame:
    """Each ok record with ``setting`` on (:data:`ABLATIONS`: sparse's ``global_blocks``,
    local_window's ``sink_tokens``, the encoder's ``full_layers``) beside the record with the same
    variant, knobs, encoder settings, N and workload but the setting off: cosine, top-1 agreement,
    attention mass inside and pairs kept, with and without. Empty when the store has no such pair."""
    where, key = ABLATIONS[setting]
    rows = pretrained_rows(df)
    rows = rows[rows["status"] == "ok"]
    enc_json = rows["pretrained"].map(lambda v: json.dumps(obj(v) or {}, sort_keys=True, default=str))
    found = []
    for _, r in rows.iterrows():
        off = _without(r, where, key)
        if off is None:
            continue
        match = rows[
            (rows["knobs"] == off[0])
            & (enc_json == off[1])
            & (rows["variant_name"] == r["variant_name"])
            & (rows["seq_len"] == r["seq_len"])
            & (rows["device"] == r["device"])
            & (rows["dtype"] == r["dtype"])
            & (rows["env_host"] == r["env_host"])
            & (rows["_corpus"] == r["_corpus"])
        ]
        if match.empty:
            continue
        m = match.iloc[-1]
        beyond = bool(r["beyond_trained"]) if pd.notna(r["beyond_trained"]) else False
        value = (
            json.loads(r["knobs"])[key]
            if where == "knob"
            else ",".join(map(str, _full_layers(r["pretrained"])))
        )
        found.append(
            {
                "variant": r["variant"],
                "N": f"{int(r['seq_len'])}" + (" (beyond training)" if beyond else ""),
                "_n": int(r["seq_len"]),
                key.replace("_", " "): value,
                "cosine with / without": f"{_dec(r['cosine_mean'], 4)} / {_dec(m['cosine_mean'], 4)}",
                "top-1 agree % with / without": f"{_pct(r['top1_agreement'])} / {_pct(m['top1_agreement'])}",
                "attn mass inside % with / without": (
                    f"{_pct(r['mass_inside_mean'])} / {_pct(m['mass_inside_mean'])}"
                ),
                "pairs kept % with / without": f"{_pct(r['kept_pairs'])} / {_pct(m['kept_pairs'])}",
            }
        )
    if not found:
        return pd.DataFrame()
    return pd.DataFrame(found).sort_values(["variant", "_n", key.replace("_", " ")]).drop(columns="_n")


def _floor_csv_rows(df: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """The floor rows of the tables (:func:`floor_rows`) as CSV rows: one per comparable set, N and
    main floor, the set's host, device, dtype and encoder, ``variant`` the tables' label, ``floor`` the
    floor's name in ``floor.json`` (``zeros``, ``uniform``), the floor's figures, its texts and
    corpus, and ``path`` the floor file; no status (it is no job). Empty without a matching floor."""
    floors = load_floors(df)
    found: list[dict[str, Any]] = []
    for _, grp in _groups(rows) if floors else []:
        for n, sub in grp.groupby("seq_len", sort=True):
            first = sub.iloc[0]
            for floor, at, name in _matching_floors(floors, sub):
                settings = floor.get("settings", {})
                found.append(
                    {
                        **{c: first[c] for c in ("env_host", "device", "dtype", "_encoder")},
                        "variant": floor_label(floor, name),
                        "floor": name,
                        "seq_len": int(n),
                        **at["floors"][name],
                        "texts": at.get("texts"),
                        "texts_sha256": at.get("texts_sha256"),
                        "trained_len": settings.get("trained_len"),
                        "corpus_sha256": settings.get("corpus_sha256"),
                        "python": floor.get("python"),
                        "path": floor["_path"],
                    }
                )
    return pd.DataFrame(found)


def _csv_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The numbers behind the tables, one row per (variant, N), and the tables' floor rows
    (:func:`_floor_csv_rows`), which a column ``floor`` names (empty for a variant's row)."""
    rows = pretrained_rows(df)
    cols = ["env_host", "device", "dtype", "_encoder", "variant", "floor", "seq_len", "status", "reason"]
    cols += [c for c in _FIGURES if c != "corpus_recipe"] + ["config_hash", "path"]
    floors = _floor_csv_rows(df, rows)
    out = rows.assign(floor=None)
    if len(floors):  # no concat with an empty frame: it would change no row but warns
        # whole-number columns stay whole (``8``, not ``8.0``) where the floor rows leave them empty
        whole = {c: "Int64" for c in out.select_dtypes("integer").columns}
        out = pd.concat([out.astype(whole), floors], ignore_index=True)
    out = out.reindex(columns=cols).rename(columns={"_encoder": "encoder"})
    return out.sort_values(["env_host", "device", "dtype", "seq_len", "variant"])


# ---------------------------------------------------------------------------------------------- plots
def _pareto(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Mask of the points no other point beats: lower or equal ``x`` (cost) and higher or equal ``y``
    (fidelity), one of them strictly. ``O(P^2)``."""
    keep = np.ones(len(x), dtype=bool)
    for i in range(len(x)):
        better = (x <= x[i]) & (y >= y[i]) & ((x < x[i]) | (y > y[i]))
        keep[i] = not better.any()
    return keep


def _suffix(keys: dict[str, Any], sets: int, several: set[str]) -> str:
    """File-name suffix of a comparable set's plot: none when the store has only ``sets`` = 1."""
    if sets < 2:
        return ""
    named = [c for c in GROUP if c not in _NAMED_IF_SEVERAL or c in several]
    bits = [keys[c] for c in named]
    return "_" + "_".join("".join(c if c.isalnum() else "-" for c in str(b)) for b in bits)


def _same_place(x: np.ndarray, y: np.ndarray, x_span: float, y_span: float) -> list[list[int]]:
    """The points ``(x[i], y[i])`` grouped by place: a point joins the first group whose first point lies
    within :data:`~experiments.report.plots.COINCIDE_SPAN` of the axes' spans on both axes (a marker
    there would hide it), else starts its own; groups in order of their first point. ``O(P^2)``."""
    groups: list[list[int]] = []
    for i in range(len(x)):
        for g in groups:
            dx, dy = abs(x[i] - x[g[0]]), abs(y[i] - y[g[0]])
            if dx <= COINCIDE_SPAN * x_span and dy <= COINCIDE_SPAN * y_span:
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


def _sector(k: int, j: int) -> MarkerPath:
    """A marker: the ``j``-th of ``k`` equal sectors of a circle (the first from 12 o'clock, then
    counterclockwise), its apex on the point: ``k`` points at one place draw one circle of ``k``
    colours."""
    return MarkerPath.wedge(90 + 360 * j / k, 90 + 360 * (j + 1) / k)


#: scatter marker area (pt^2) of a point alone, and of a circle shared by points at one place (larger:
#: each colour's sector must still show)
_POINT_S, _SHARED_S = 42, 90


def floor_by_n(floors: list[dict[str, Any]], rows: pd.DataFrame) -> dict[int, float]:
    """Per N of ``rows`` (one comparable set), the highest mean cosine among its matching floors
    (:func:`floor_rows`): the line a variant must clear; Ns with no floor are left out."""
    out = {}
    for n, sub in rows.groupby("seq_len"):
        found = [f["cosine_mean"] for _, f in floor_rows(floors, sub)]
        if found:
            out[int(n)] = max(found)
    return out


def plot_frontier(
    rows: pd.DataFrame, title: str, path: Path, floor: dict[int, float] | None = None
) -> Path | None:
    """Mean cosine against time per batch (top) and against the share of pairs kept (bottom), one
    column per length, one point per variant and knobs; the cost-fidelity frontier (points nothing
    beats on both axes) filled and joined. Points at one place (:func:`_same_place`: exact variants
    at cosine 1 keeping every pair, say) share one circle, a sector each in its colour, instead of the
    last drawn hiding the others. ``floor``: per N, the cosine of attention that never reads q or k
    (:func:`floor_by_n`), drawn as a dashed line. ``rows``: one comparable set (:func:`pretrained_rows`).
    None when no record is usable."""
    rows = rows[rows["status"] == "ok"]
    floor = floor or {}
    if rows.empty:
        return None
    ns = sorted(int(n) for n in rows["seq_len"].unique())
    cosine = pd.to_numeric(rows["cosine_mean"], errors="coerce")
    y_span = float(cosine.max() - cosine.min())  # one y axis for every panel (sharey)
    shared = False  # some panel has points at one place (the legend says how they are drawn)
    names = sorted(rows["variant"].unique())
    colors = palette(names)
    # room for the legend: about 0.062 inch per character of the longest label at font size 8 (a
    # layer mix's label is long), at least the 2.2 inches a plain variant's needs
    legend_in = max(2.2, 0.062 * max(len(n) for n in names) + 0.5)
    fig, axes = plt.subplots(
        2, len(ns), figsize=(3.4 * len(ns) + legend_in + 0.2, 6.6), squeeze=False, sharey=True
    )
    axes_x = [("batch_ms_median", "ms per batch (whole model)"), ("kept_pairs", "share of pairs kept")]
    for col, n in enumerate(ns):
        sub = rows[rows["seq_len"] == n]
        beyond = _beyond(sub) is not None
        for r, (xcol, xlabel) in enumerate(axes_x):
            ax = axes[r, col]
            x = pd.to_numeric(sub[xcol], errors="coerce").to_numpy(float)
            y = pd.to_numeric(sub["cosine_mean"], errors="coerce").to_numpy(float)
            front = _pareto(x, y)
            order = np.argsort(x[front])
            ax.plot(x[front][order], y[front][order], color="0.6", lw=1, zorder=1, drawstyle="steps-post")
            x_span = 1.05 if xcol == "kept_pairs" else float(np.nanmax(x) - np.nanmin(x))
            variants = sub["variant"].to_numpy()
            for group in _same_place(x, y, x_span, y_span):
                shared |= len(group) > 1
                for j, i in enumerate(group):
                    c = colors[variants[i]]
                    look = (
                        {"s": _POINT_S}
                        if len(group) == 1
                        else {"s": _SHARED_S, "marker": _sector(len(group), j)}
                    )
                    face = c if front[i] else "white"
                    ax.scatter(x[i], y[i], color=face, edgecolor=c, lw=1.5, zorder=2, **look)
            if n in floor:
                ax.axhline(floor[n], color="0.35", ls="--", lw=1, zorder=0)
            ax.set_xlabel(xlabel)
            if xcol == "kept_pairs":
                ax.set_xlim(0, 1.05)
            if r == 0:
                ax.set_title(f"N={n}" + (" (beyond training length)" if beyond else ""), fontsize=9)
            if col == 0:
                ax.set_ylabel("mean cosine to the unmodified model")
            ax.grid(alpha=0.3)
    handles: list = [plt.Line2D([], [], ls="", marker="o", color=colors[nm]) for nm in names]
    handles.append(plt.Line2D([], [], ls="", marker="o", mfc="white", mec="0.3"))
    labels = [*names, "not on the frontier"]
    if floor:
        handles.append(plt.Line2D([], [], color="0.35", ls="--", lw=1))
        labels.append("no attention (floor.json:\nbest of output 0, uniform)")
    if shared:  # a circle of three gray sectors, as such a point is drawn
        grays = ("0.25", "0.5", "0.75")
        handles.append(
            tuple(plt.Line2D([], [], ls="", marker=_sector(3, j), ms=9, color=g) for j, g in enumerate(grays))
        )
        labels.append("sectors of one circle:\nvariants at one point")
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.suptitle(
        f"{title}: fidelity against cost (filled: on the frontier, nothing is both cheaper and closer)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1 - legend_in / fig.get_figwidth(), 0.95))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


#: the y axis of the attention-mass panels (a share, linear)
_MASS_YLIM = (0.0, 1.02)


def _mass_lines(ax: plt.Axes, lines: list[tuple[str, list[float], object]]) -> list[plt.Line2D]:
    """Draw ``lines`` (label, a value per layer, colour) on ``ax``, lines that coincide taking turns in
    dashes of their colours (:func:`~experiments.report.plots.coinciding_styles`, within a line's width
    of the linear axis); returns the legend's handles: a solid line each, and the dashes' entry where
    some coincide."""
    atol = COINCIDE_SPAN * (_MASS_YLIM[1] - _MASS_YLIM[0])
    layers = [np.arange(len(vals)) for _, vals, _ in lines]  # from 0, as pretrained.full_layers counts
    turns = coinciding_styles([(x, vals) for x, (_, vals, _) in zip(layers, lines, strict=True)], 0.0, atol)
    for x, (label, vals, color), turn in zip(layers, lines, turns, strict=True):
        ax.plot(x, vals, marker="o", color=color, ls=turn, label=label)
    handles = [plt.Line2D([], [], marker="o", color=color, label=label) for label, _, color in lines]
    return handles + ([coinciding_handle(lw=1.5)] if any(t != "-" for t in turns) else [])


def plot_token_mass(rows: pd.DataFrame, title: str, path: Path) -> Path | None:
    """Per layer: the unmodified model's attention mass on the first token and on the band
    ``|i - j| <= band`` (one line per length), and inside each variant's pattern at the longest
    length. ``rows``: one comparable set. None when no record is usable."""
    rows = rows[(rows["status"] == "ok") & rows["mass_first_token"].notna()]
    if rows.empty:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15.5, 4.0))
    ns = sorted(int(n) for n in rows["seq_len"].unique())
    shades = dict(zip(ns, sns.color_palette("viridis", len(ns)), strict=True))
    band = int(pd.to_numeric(rows["band"], errors="coerce").dropna().iloc[0])
    # the reference's figures: the same in every job of a length
    first = [rows[rows["seq_len"] == n].iloc[0] for n in ns]
    legends = [
        _mass_lines(ax, [(f"N={n}", obj(r[col]), shades[n]) for n, r in zip(ns, first, strict=True)])
        for ax, col in zip(axes[:2], ("mass_first_token", "mass_band"), strict=True)
    ]
    axes[0].set_title("mass on the first token ([CLS])", fontsize=10)
    axes[1].set_title(f"mass on the diagonal band |i-j| <= {band}", fontsize=10)
    longest = rows[rows["seq_len"] == ns[-1]].sort_values("variant")
    # variants that keep every pair sit at 1.0 on every layer: one line would hide the others' legend
    full = longest["kept_pairs"].astype(float) >= 1.0
    longest = longest[~full]
    colors = palette(longest["variant"].tolist())
    inside = [(r["variant"], obj(r["mass_inside"]), colors[r["variant"]]) for _, r in longest.iterrows()]
    handles = _mass_lines(axes[2], inside)
    axes[2].set_title(f"mass inside each pattern, N={ns[-1]} (full attention: 1)", fontsize=10)
    for ax in axes:
        ax.set_xlabel("layer (from 0, as pretrained.full_layers counts)")
        ax.set_ylim(*_MASS_YLIM)
        ax.grid(alpha=0.3)
    axes[0].legend(handles=legends[0], fontsize=7)
    axes[1].legend(handles=legends[1], fontsize=7)
    if len(longest):
        axes[2].legend(
            handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False
        )
    axes[0].set_ylabel("share of the unmodified model's attention")
    fig.suptitle(
        f"{title}: where the unmodified model attends (mean over heads, queries, texts)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- report
NOTE = (
    "Each variant replaces the attention of the pretrained encoder in every layer, with no training "
    "(a label ending `+ sdpa on layers i,j`: a local/global mix, those layers keep full attention). "
    "cosine: of each text's mean-pooled embedding to the unmodified model's (mean and 5th percentile "
    "over the texts); top-1 / top-5 agree: retrieval (a sentence of each text as the query, the texts "
    "as the collection), share of queries whose nearest text is the same as the unmodified model's, "
    "and the mean overlap of the five nearest; retrieval top-1: share of queries whose nearest text "
    "is their own; pairs kept: (query, key) pairs the pattern lets interact; attn mass inside: share of "
    "the unmodified model's attention weights (mean over layers, heads, queries, texts) that falls on "
    "those pairs; ms / batch: one forward pass of the whole model over a batch of texts, median (IQR) "
    "over the batches (`*`, `~`: measured beside other work, or while the machine ran slow, as in the "
    "speed tables); peak MiB: allocator peak of one batch above the weights and inputs. A title "
    "marked BEYOND is a length longer than the inputs the model was fine-tuned on."
)


FLOOR_NOTE = (
    "Rows `floor: ...` (`floor.json` beside the records, from `scripts/pretrained_floor.py` on the same "
    "texts): every layer's attention replaced by a function that never reads q or k, attention removed "
    "(output 0) or uniform weights (the mean of v). A variant's cosine says it keeps something of the "
    "model only above them. Top-1 agreement and retrieval top-1 do not separate a variant from no "
    "attention on this corpus: each query is a sentence copied from its text, so embeddings that keep "
    "only which word pieces a text holds still find it."
)


def report_markdown(df: pd.DataFrame) -> str:
    """The whole report as Markdown: the note, one table per length, the ablation, the corpus."""
    parts = ["## Fidelity inside a pretrained model", "", NOTE, ""]
    tables = fidelity_table(df)
    for title, tab in tables:
        parts += [f"**{title}**", "", markdown(tab), ""]
    if any(str(i).startswith("floor: ") for _, tab in tables for i in tab.index):
        parts += [FLOOR_NOTE, ""]
    for setting in ABLATIONS:
        abl = ablation_table(df, setting)
        if len(abl):
            parts += [f"**Ablation: {setting}**", "", markdown(abl.set_index("variant")), ""]
    rows = pretrained_rows(df)
    ok = rows[rows["status"] == "ok"]
    for corpus_hash, sub in ok.groupby("corpus_sha256"):
        r = sub.iloc[0]
        counts = sub.groupby("seq_len")[["texts", "texts_available"]].first()
        used = ", ".join(f"N={n}: {int(t)} of {int(a)}" for n, (t, a) in counts.iterrows())
        parts += [
            f"Corpus `{str(corpus_hash)[:12]}` (SHA-256 of the recipe and sentences; Python {r['python']}): "
            f"{int(r['corpus_sentences'])} sentences; {r['corpus_recipe']}. Texts used of those available: "
            f"{used}.",
            "",
        ]
    if ok["corpus_sha256"].nunique() > 1:
        parts += ["Several corpora (other Python versions): their records are in separate tables.", ""]
    return "\n".join(parts)


def write_report(df: pd.DataFrame, out_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Write ``pretrained.md``/``.csv`` and (``plots``) a frontier and a token-mass plot per
    comparable set into ``out_dir``; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pretrained.md").write_text(report_markdown(df))
    _csv_frame(df).to_csv(out / "pretrained.csv", index=False)
    written = [out / "pretrained.md", out / "pretrained.csv"]
    if plots:
        rows = pretrained_rows(df)
        floors = load_floors(df)
        sets = _groups(rows)
        several = _several(rows)
        for keys, sub in sets:
            title, tag = _group_title(keys, several), _suffix(keys, len(sets), several)
            for p in (
                plot_frontier(sub, title, out / f"pretrained_frontier{tag}.png", floor_by_n(floors, sub)),
                plot_token_mass(sub, title, out / f"pretrained_token_mass{tag}.png"),
            ):
                if p is not None:
                    written.append(p)
    return written
