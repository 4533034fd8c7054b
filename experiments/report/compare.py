"""Comparison with a baseline (another commit, machine or library version): speedup and memory ratio
per cell, each speedup with a verdict on whether it is outside the two runs' noise (or why it is not
compared: a time the speed table marks), and the cells that now fail or that only the baseline has."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from ..measure.canary import SLOW_RATIO, machine_keys
from ..measure.spec import Kind
from ..records.rounds import numeric as _col
from ..records.store import CELL_KEYS, RECORD_IDENTITY, is_false, newest_mask, of_kind
from .added_knobs import fill_added_knobs
from .format import Section
from .grouping import group_keys, groups, length_axis, marks, mode_times, pivot_cells, status_cell, usable
from .machine_state import machine_changes

#: what a baseline row is matched on (and the host, where both sides have it): not the
#: free-form ``extra`` tags (``+extra.run=before`` and ``after`` label the two sides of a comparison)
MATCH_KEYS = [k for k in CELL_KEYS if k not in ("env_host", "extra")]


#: a speedup within this fraction of 1 is within noise whatever the two runs' spreads say: their
#: quartiles describe the calls of one process, and the same job run again later on this project's
#: 2-core VM moved by more than that (README, "Repeatable CPU timings")
NOISE_FLOOR = 0.05


#: the figures a time's marks in the speed table are read from (:func:`~.grouping.beside_work`,
#: :func:`~.grouping.slow_machine`, ``unstable``), on each side of a compared row
QUALITY = [
    "machine_slowdown",
    "others_cpu_cores",
    "concurrent_jobs",
    "cpu_per_wall",
    "fig_threads",
    "unstable",
]


def _side(row: pd.Series, suffix: str) -> pd.Series:
    """One side's figures of a compared row under the names the speed table's marks read (``suffix``
    ``""``: this set, ``"_base"``: the baseline); device and threads are matched on, so shared."""
    return pd.Series(
        {
            "device": row.get("device"),
            "threads": row.get("threads"),
            **{c: row.get(c + suffix) for c in QUALITY},
        }
    )


def quality_marks(row: pd.Series) -> str:
    """The marks the speed table gives either side's time (:func:`~.grouping.marks`): `` *`` measured
    beside other work, `` ~`` while its machine ran slow, `` unstable``; empty text for none."""
    found = marks(_side(row, "")) + marks(_side(row, "_base"))
    return "".join(m for m in (" *", " ~", " unstable") if m in found)


def noise_verdict(row: pd.Series) -> str:
    """Whether a compared cell's difference is outside the two runs' own noise. A time either side's
    speed table marks (:func:`quality_marks`) is not compared, its difference may be the machine's:
    ``slow machine`` (its canary: ``machine_slowdown`` above ``SLOW_RATIO``), ``beside other work``
    (``*``), ``unstable``; ``machine changed`` when the host's ceilings or canary moved between the
    two runs (its ``machine_changed``, :func:`~.machine_state.machine_changes`). Else ``within
    noise`` when the two runs' quartile ranges of the time overlap or the speedup is within
    :data:`NOISE_FLOOR` of 1, else ``faster`` or ``slower``."""
    marks = quality_marks(row)
    for mark, verdict in (("~", "slow machine"), ("*", "beside other work"), ("unstable", "unstable")):
        if mark in marks:
            return verdict
    if row.get("machine_changed") is True:
        return "machine changed"
    q1, q3, q1b, q3b = (
        pd.to_numeric(row.get(c), errors="coerce") for c in ("q1_s", "q3_s", "q1_s_base", "q3_s_base")
    )
    overlap = pd.notna(q1) and pd.notna(q1b) and max(q1, q1b) <= min(q3, q3b)
    if overlap or abs(row["speedup"] - 1) <= NOISE_FLOOR:
        return "within noise"
    return "faster" if row["speedup"] > 1 else "slower"


#: the mark a speedup cell carries for each :func:`noise_verdict` (a marked time: all its marks)
VERDICT_MARK = {
    "within noise": " ≈", "slow machine": " ~", "beside other work": " *", "unstable": " unstable",
    "machine changed": " ≠", "faster": "", "slower": "",
}  # fmt: skip
#: the verdicts of cells that are not a comparison of two times, which the summary names
NOW_FAILING, BASELINE_ONLY = "now failing", "baseline only"


def _token(v: object) -> str:
    """A cell as comparable text: every missing value (None, NaN, NA) one token, a whole float as an
    integer (a store read back from CSV holds 1.0 where records hold 1)."""
    try:
        if pd.isna(v):
            return "NA"
    except (TypeError, ValueError):  # a list or array: not a missing value
        pass
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _key(df: pd.DataFrame, keys: list[str]) -> pd.Series:
    """One text per row: its ``keys`` as :func:`_token` s, joined."""
    if df.empty:
        return pd.Series("", index=df.index, dtype=object)
    return df[keys].apply(lambda col: col.map(_token)).agg("|".join, axis=1)


def _baseline_for(cur: pd.DataFrame, base: pd.DataFrame, shared: list[str]) -> pd.DataFrame:
    """The baseline rows each host of ``cur`` is compared against, that host in ``_for_host``. Where
    the two sides share hosts, each shared host's own rows. Else, per table row (every match key but
    the lengths: the workload and variant), the rows of one baseline host: the one holding most of the
    configurations this host measured, then most configurations, then the newest record."""
    if shared:
        return base[base["env_host"].astype(str).isin(shared)].assign(_for_host=base["env_host"])
    row_keys = [k for k in MATCH_KEYS if k not in ("seq_len", "kv_len")]
    b = base.assign(
        _cfg=_key(base, MATCH_KEYS), _row=_key(base, row_keys), _host=base["env_host"].map(_token)
    )
    out = [base.iloc[:0].assign(_for_host=None)]
    for _, mine in cur.groupby(cur["env_host"].map(_token)):
        score = (
            b.assign(_here=b["_cfg"].isin(set(_key(mine, MATCH_KEYS))))
            .groupby(["_row", "_host"])
            .agg(here=("_here", "sum"), cells=("_cfg", "size"), newest=("started_at", "max"))
            .reset_index()
            .sort_values(["here", "cells", "newest", "_host"], ascending=[False, False, False, True])
        )
        best = score.drop_duplicates("_row")[["_row", "_host"]]
        chosen = b.merge(best, on=["_row", "_host"]).drop(columns=["_cfg", "_row", "_host"])
        out.append(chosen.assign(_for_host=mine["env_host"].iloc[0]))
    return pd.concat(out, ignore_index=True)


def nothing_to_compare(cur: pd.DataFrame, base: pd.DataFrame) -> str | None:
    """Why a comparison of the kernel records ``cur`` against ``base`` would compare nothing (one
    line naming what differs), or None when at least one configuration is on both sides."""
    cur, base = of_kind(cur, Kind.kernel), of_kind(base, Kind.kernel)
    if cur.empty or base.empty:
        side = "these records" if cur.empty else "the baseline"
        return f"the comparison is of kernel jobs' times and {side} hold none"
    cur, base, _ = fill_added_knobs(cur, base)
    keys = [k for k in MATCH_KEYS if k in cur and k in base]
    if _key(cur, keys).isin(set(_key(base, keys))).any():
        return None
    differ = [k for k in keys if not set(cur[k].map(_token)) & set(base[k].map(_token))]
    return "no configuration was measured on both sides" + (
        f": none of their values of {', '.join(differ)} is shared" if differ else ""
    )


def baseline_table(cur: pd.DataFrame, base: pd.DataFrame) -> Section:
    """Speedup (baseline time / this time) and memory ratio (this / baseline) per variant x N, each
    speedup with its :func:`noise_verdict`, and a count of the verdicts in the note, which names the
    configurations that now fail (ok in the baseline) and those only the baseline measured.

    Rows are matched on the workload, the variant and N, host to host where both sides share hosts,
    else each table row against one baseline host (:func:`_baseline_for`, named in the note); each
    side uses its newest measurement. ``>1x`` speedup means this set is faster.
    """
    sec = Section(
        "baseline",
        "Against the baseline",
        "speedup = baseline time / this time (>1: faster now); memory = this peak / baseline peak "
        "(<1: less now). `≈`: within the two runs' noise (their time quartiles overlap, or within "
        f"{NOISE_FLOOR:.0%}); `~`, `*`, `unstable`: the speed table's marks of either run (its machine "
        "ran slow, it was measured beside other work, its time never settled), not compared; "
        "`≠`: the host's ceilings (GEMM rate, copy or read bandwidth) or its canary moved more than "
        f"{SLOW_RATIO - 1:.0%} between the runs, so the machine's state, not only the code, differs: not "
        "compared; `<status> (was ok)`: fails now, ok in the baseline; `baseline only`: measured in "
        "the baseline, no record now. " + env_diff(cur, base),
    )
    # each side's shown rows (a sweep run in rounds: its median round's), then the newest of them per
    # workload, variant, N and host; host to host where the two sides share a machine (a code change
    # measured on each of them: a cell of one host against another's would mix the machines into
    # it), else across machines (the comparison of two machines) but one baseline machine per row: the
    # newest per cell could take another machine at one N (a slower host re-run there read as 3x)
    cur, base = of_kind(cur, Kind.kernel), of_kind(base, Kind.kernel)
    cur, base, filled = fill_added_knobs(cur, base)
    # two sets measured in alternating rounds (side_by_side: their times overlap, over every round)
    # met the same phases of the machine: their ceilings' difference is each one's noise, not a state
    alternating = _overlap(cur, base)
    cur = cur[cur["newest"]] if "newest" in cur else cur
    base = base[base["newest"]] if "newest" in base else base
    shared = sorted(set(cur["env_host"].astype(str)) & set(base["env_host"].astype(str)))
    cur = cur[newest_mask(cur, [*MATCH_KEYS, "env_host"])]
    base = base[newest_mask(base, [*MATCH_KEYS, "env_host"])]
    cols = [
        "status",
        "valid",
        "time_s",
        "q1_s",
        "q3_s",
        "peak_mib",
        "variant",
        "env_host",
        "record_id",
        "machine_threads",
        *QUALITY,
    ]

    def with_times(df: pd.DataFrame) -> pd.DataFrame:
        t = mode_times(df)
        # one record's identity: a sweep that reused its records (resume) hands the same one to both sides
        ident = df[RECORD_IDENTITY].astype(str).agg("|".join, axis=1)
        return df.assign(
            time_s=t["time_s"], q1_s=t["q1_s"], q3_s=t["q3_s"], peak_mib=_col(df, "peak_mib"),
            record_id=ident, machine_threads=machine_keys(df)[1],
            cpu_per_wall=t["cpu_per_wall"], unstable=t["unstable"],
            **{c: _col(df, c) for c in QUALITY if c not in ("cpu_per_wall", "unstable")},
        )  # fmt: skip

    cur, base = with_times(cur), with_times(base)
    # matched as text (_token): records and a store read back from CSV hold the same values in
    # different types (1 and 1.0, None and NaN), which a merge on the columns themselves refuses
    tok = {f"_match_{k}": k for k in MATCH_KEYS}

    def keyed(df: pd.DataFrame, host: str) -> pd.DataFrame:
        return df.assign(**{t: df[k].map(_token) for t, k in tok.items()}, _match_host=df[host].map(_token))

    on = [*tok, "_match_host"]
    m = keyed(cur, "env_host")[[*on, *MATCH_KEYS, *cols]].merge(
        keyed(_baseline_for(cur, base, shared), "_for_host")[[*on, *MATCH_KEYS, *cols, "_for_host"]],
        on=on,
        how="outer",
        suffixes=("", "_base"),
        indicator=True,
    )
    # a configuration only the baseline has: its row and column are the baseline's, under this set's
    # label of the variant (labels are made per store) and in the tables of the host it is compared for
    only_base = m["_merge"] == "right_only"
    for k in MATCH_KEYS:
        m.loc[only_base, k] = m.loc[only_base, f"{k}_base"]
    label_of = cur.drop_duplicates("variant_key").set_index("variant_key")["variant"]
    m.loc[only_base, "variant"] = m.loc[only_base, "variant_key"].map(label_of).fillna(m["variant_base"])
    m.loc[only_base, "env_host"] = m.loc[only_base, "_for_host"]
    m = m.drop(columns=[*on, *(f"{k}_base" for k in MATCH_KEYS), "_for_host"])
    m["started_at"] = pd.NaT
    ok_now = usable(m)
    ok_base = (m["status_base"] == "ok") & ~m["valid_base"].map(is_false).astype(bool)
    both = ok_now & ok_base
    m["speedup"] = (m["time_s_base"] / m["time_s"]).where(both)
    m["memory_ratio"] = (m["peak_mib"] / m["peak_mib_base"]).where(both)
    same = m["record_id"] == m["record_id_base"]
    # one host in another state in the two runs (its memory at half the speed): the difference may be
    # the machine's; only host to host, a comparison of two machines is of their states as well
    changes = machine_changes(cur, base) if shared and not alternating else {}
    threads = m["machine_threads"].fillna(m["machine_threads_base"])  # the measured count, as the canary's
    m["machine_changed"] = [(str(h), t) in changes for h, t in zip(m["env_host"], threads, strict=True)]
    m["marks"] = m.apply(lambda r: quality_marks(r) if pd.notna(r["speedup"]) else "", axis=1)
    m["verdict"] = m.apply(lambda r: noise_verdict(r) if pd.notna(r["speedup"]) else None, axis=1)
    m.loc[(m["_merge"] == "both") & ~ok_now & ok_base, "verdict"] = NOW_FAILING
    m.loc[only_base, "verdict"] = BASELINE_ONLY
    m.loc[same, "verdict"] = "same record"

    def ratio_cell(col: str) -> Callable[[pd.Series], str]:
        def cell(row: pd.Series) -> str:
            if row["_merge"] == "left_only":
                return "no baseline"
            if row["verdict"] in ("same record", BASELINE_ONLY):
                return row["verdict"]
            now = status_cell(row)
            if now:
                return f"{now} (was ok)" if row["verdict"] == NOW_FAILING else now
            if row["status_base"] != "ok":
                return f"{row['status_base']} (baseline)"
            if is_false(row["valid_base"]):
                return "invalid (baseline)"
            if pd.isna(row[col]):
                return "n/a"
            mark = (row["marks"] or VERDICT_MARK.get(row["verdict"], "")) if col == "speedup" else ""
            return f"{row[col]:.2f}x{mark}"

        return cell

    keys = group_keys(m)
    axis = "Nk" if length_axis(m) == "kv_len" else "N"
    parts = groups(m, keys)
    unmatched, only_in_base = [], []
    named: dict[str, list[str]] = {NOW_FAILING: [], BASELINE_ONLY: []}  # the cells the summary names
    used: dict[str, list[str]] = {}  # baseline host -> the rows compared against it
    for title, sub in parts:
        where = f" in {title}" if len(parts) > 1 else ""
        if (sub["_merge"] == "left_only").all():  # a whole table of "no baseline" says nothing
            unmatched.append(title)
            continue
        if (sub["_merge"] == "right_only").all():  # nor one of "baseline only": named in the summary
            only_in_base.append(title)
            named[BASELINE_ONLY].append(f"all {len(sub)} of {title}")
            continue
        # the cell's column: N, or Nk (a row without a key length of its own sits at its N)
        n = sub["seq_len"] if axis == "N" else sub["kv_len"].astype("Int64").fillna(sub["seq_len"])
        for verdict, cells in named.items():
            rows = sub.assign(_n=n)[sub["verdict"] == verdict].sort_values(["variant", "_n"])
            cells += [f"{r['variant']} {axis}={r['_n']}{where}" for _, r in rows.iterrows()]
        for host, rows in sub[sub["_merge"] == "both"].groupby(sub["env_host_base"].astype(str)):
            used.setdefault(host, []).extend(f"{v}{where}" for v in sorted(rows["variant"].unique()))
        sec.parts.append((f"{title}: speedup vs baseline", pivot_cells(sub, ratio_cell("speedup"))))
        sec.parts.append((f"{title}: memory vs baseline", pivot_cells(sub, ratio_cell("memory_ratio"))))
    if unmatched:
        labels = ", ".join(sorted(base["variant"].astype(str).unique()))
        sec.note += (
            f" No baseline record of the same workload, variant (with its knobs) and N for: "
            f"{'; '.join(unmatched)} (the baseline's variants: {labels})."
        )
    if only_in_base:
        sec.note += f" Only in the baseline (no record now): {'; '.join(only_in_base)}."
    if shared:
        sec.note += f" Matched host to host (on both sides: {', '.join(shared)})."
    elif used:
        # which machine each row was compared against: a machine comparison says which machines
        rows = "; ".join(f"{h} ({', '.join(dict.fromkeys(v))})" for h, v in sorted(used.items()))
        unused = sorted(set(base["env_host"].astype(str)) - set(used))
        sec.note += (
            f" No host on both sides: each row against one baseline host, the one holding most of its "
            f"configurations: {rows if len(used) > 1 else next(iter(used))}"
            + (f" (not compared against: {', '.join(unused)})" if unused else "")
            + "."
        )
    if filled:
        sec.note += f" Knobs added since: {'; '.join(filled)}."
    for (host, n), figures in sorted(changes.items()):
        sec.note += (
            f" The machine {host} ({n} thread(s)) was in another state in the two runs: {figures} "
            "(each side's median); its cells are not compared (`≠`): to compare two commits, measure them "
            "side by side (python -m experiments.sweep.side_by_side)."
        )
    if alternating:
        sec.note += (
            " The two sets were measured in alternating rounds (their times overlap): a change of the "
            "machine's state fell on both, so their ceilings are not compared."
        )
    sec.note = f"{verdict_summary(m['verdict'], named)}. " + sec.note
    sec.data = m.drop(columns=["_merge", "started_at"])
    return sec


def _overlap(cur: pd.DataFrame, base: pd.DataFrame) -> bool:
    """Whether the two sets' measuring times overlap (from the first job's start to the last one's
    end): rounds of the two taken in turn, as side_by_side runs them. False where a side lacks times."""
    spans = []
    for df in (cur, base):
        start = pd.to_datetime(df.get("started_at"), utc=True, errors="coerce")
        end = pd.to_datetime(df.get("finished_at"), utc=True, errors="coerce")
        if start is None or end is None or start.isna().all() or end.isna().all():
            return False
        spans.append((start.min(), end.max()))
    (a0, a1), (b0, b1) = spans
    return bool(a0 < b1 and b0 < a1)


def verdict_summary(verdicts: pd.Series, named: dict[str, list[str]] | None = None) -> str:
    """``3 faster, 1 slower, 5 within noise (of 9 compared); not compared: 2 on a slow machine`` (and
    those beside other work or unstable, where any), how many cells hold the same record on both sides
    (not compared), and the cells that now fail (ok in the baseline) or only the baseline has, with the
    first few of them ``named`` (verdict -> cell names)."""
    n = verdicts.value_counts()
    parts = [
        f"{n.get('faster', 0)} faster",
        f"{n.get('slower', 0)} slower",
        f"{n.get('within noise', 0)} within noise",
    ]
    compared = sum(n.get(v, 0) for v in ("faster", "slower", "within noise"))
    text = ", ".join(parts) + f" (of {int(compared)} compared)"
    marked = [  # a marked time's difference may be the machine's: counted, not compared
        f"{n[verdict]} {words}"
        for verdict, words in (
            ("slow machine", "on a slow machine"),
            ("beside other work", "beside other work"),
            ("unstable", "unstable"),
            ("machine changed", "on a machine in another state"),
        )
        if n.get(verdict, 0)
    ]
    if marked:
        text += "; not compared: " + ", ".join(marked)
    for verdict, what in ((NOW_FAILING, "ok in the baseline"), (BASELINE_ONLY, "no record now")):
        if n.get(verdict, 0):
            names = (named or {}).get(verdict, [])
            listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            text += f"; {n[verdict]} {verdict} ({what}{': ' + listed if listed else ''})"
    if n.get("same record", 0):  # not a comparison: resume handed both sides the same measurement
        text += (
            f"; {n['same record']} cell(s) are the same record on both sides (a sweep that reused its "
            "records: resume=false measures them again)"
        )
    return text


def env_diff(cur: pd.DataFrame, base: pd.DataFrame) -> str:
    """What differs between two sets' environments (host, CPU, GPU, torch, commit, the environment
    variables that change speed: ``env.speed_settings``) and which variants ran other code
    (:func:`variant_code_diff`), as one sentence."""
    # field -> (its name in the sentence, what an absent value reads as): a record without speed
    # settings had none set (or predates the field), where any other field's absence is unknown
    fields = {
        "env_host": ("host", "?"), "env_cpu_model": ("cpu_model", "?"),
        "env_cpu_capability": ("cpu_capability", "?"), "env_gpu_name": ("gpu_name", "?"),
        "env_torch": ("torch", "?"), "env_cuda": ("cuda", "?"), "env_git_commit": ("git_commit", "?"),
        "env_speed_settings": ("speed settings", "none"),
    }  # fmt: skip
    diffs = []
    for f, (name, absent) in fields.items():
        a, b = _values(cur, f), _values(base, f)
        if a != b:  # distinct values joined by " | ": a speed settings value is itself "A=1; B=2"
            diffs.append(f"{name}: {' | '.join(a) or absent} (this) vs {' | '.join(b) or absent} (baseline)")
    if code := variant_code_diff(cur, base):
        diffs.append(code)
    return (
        ("Differences: " + "; ".join(diffs) + ".") if diffs else "The two sets report the same environment."
    )


def variant_code_diff(cur: pd.DataFrame, base: pd.DataFrame) -> str:
    """``variant code: dilated (dilated-attn 0.2.0 (this) vs dilated-attn 0.1.0 (baseline)), sparse``:
    the variants on both sides whose source files' hash (``env_variant_code``) differs, each with its
    plugin package's versions where they differ too; empty when none does (a side whose records lack
    the hash says nothing of it). Why: a plugin's new version runs
    under the same commit of this repository, which alone would read as "the same environment".
    O(rows)."""
    if "variant_name" not in cur or "variant_name" not in base:
        return ""
    changed = []
    for name in sorted(set(cur["variant_name"].dropna()) & set(base["variant_name"].dropna())):
        a, b = cur[cur["variant_name"] == name], base[base["variant_name"] == name]
        code_a, code_b = _values(a, "env_variant_code"), _values(b, "env_variant_code")
        if not code_a or not code_b or code_a == code_b:
            continue
        pa, pb = _values(a, "env_variant_package"), _values(b, "env_variant_package")
        versions = f" ({', '.join(pa) or 'built in'} (this) vs {', '.join(pb) or 'built in'} (baseline))"
        changed.append(str(name).rsplit(".", 1)[-1] + (versions if pa != pb else ""))
    return f"variant code: {', '.join(changed)}" if changed else ""


def _values(df: pd.DataFrame, column: str) -> list[str]:
    """``column``'s distinct values in ``df`` as sorted text, without the missing ones."""
    return sorted(df[column].dropna().astype(str).unique()) if column in df else []
