"""Comparison with a baseline (another commit, machine or library version): speedup and memory ratio
per cell, each speedup with a verdict on whether it is outside the two runs' noise."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from ..measure.canary import SLOW_RATIO
from ..measure.spec import Kind
from ..records.rounds import numeric as _col
from ..records.store import CELL_KEYS, RECORD_IDENTITY, is_false, newest_mask, of_kind
from .format import Section
from .grouping import group_keys, groups, mode_times, pivot_cells, status_cell, usable

#: what a baseline row is matched on (and the host, where both sides have it): not the
#: free-form ``extra`` tags (``+extra.run=before`` and ``after`` label the two sides of a comparison)
MATCH_KEYS = [k for k in CELL_KEYS if k not in ("env_host", "extra")]


#: a speedup within this fraction of 1 is within noise whatever the two runs' spreads say: their
#: quartiles describe the calls of one process, and the same job run again later on this project's
#: 2-core VM moved by more than that (README, "Repeatable CPU timings")
NOISE_FLOOR = 0.05


def noise_verdict(row: pd.Series) -> str:
    """Whether a compared cell's difference is outside the two runs' own noise: ``slow machine`` when
    either run's canary says its machine ran slow (``machine_slowdown`` above ``SLOW_RATIO``: the
    difference may be the machine's), ``within noise`` when the two runs' quartile ranges of the time
    overlap or the speedup is within :data:`NOISE_FLOOR` of 1, else ``faster`` or ``slower``."""
    slow = [pd.to_numeric(row.get(c), errors="coerce") for c in ("machine_slowdown", "machine_slowdown_base")]
    if any(s > SLOW_RATIO for s in slow):
        return "slow machine"
    q1, q3, q1b, q3b = (
        pd.to_numeric(row.get(c), errors="coerce") for c in ("q1_s", "q3_s", "q1_s_base", "q3_s_base")
    )
    overlap = pd.notna(q1) and pd.notna(q1b) and max(q1, q1b) <= min(q3, q3b)
    if overlap or abs(row["speedup"] - 1) <= NOISE_FLOOR:
        return "within noise"
    return "faster" if row["speedup"] > 1 else "slower"


#: the mark a speedup cell carries for each :func:`noise_verdict`
VERDICT_MARK = {"within noise": " ≈", "slow machine": " ~", "faster": "", "slower": ""}


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


def nothing_to_compare(cur: pd.DataFrame, base: pd.DataFrame) -> str | None:
    """Why a comparison of the kernel records ``cur`` against ``base`` would compare nothing (one
    line naming what differs), or None when at least one configuration is on both sides."""
    cur, base = of_kind(cur, Kind.kernel), of_kind(base, Kind.kernel)
    if cur.empty or base.empty:
        side = "these records" if cur.empty else "the baseline"
        return f"the comparison is of kernel jobs' times and {side} hold none"
    keys = [k for k in MATCH_KEYS if k in cur and k in base]

    def key(df: pd.DataFrame) -> pd.Series:  # one text per configuration
        return df[keys].apply(lambda col: col.map(_token)).agg("|".join, axis=1)

    if key(cur).isin(set(key(base))).any():
        return None
    differ = [k for k in keys if not set(cur[k].map(_token)) & set(base[k].map(_token))]
    return "no configuration was measured on both sides" + (
        f": none of their values of {', '.join(differ)} is shared" if differ else ""
    )


def baseline_table(cur: pd.DataFrame, base: pd.DataFrame) -> Section:
    """Speedup (baseline time / this time) and memory ratio (this / baseline) per variant x N, each
    speedup with its :func:`noise_verdict`, and a count of the verdicts in the note.

    Rows are matched on the workload, the variant and N, and on the host where both sides hold one
    (else across machines: comparing them is the point); each side uses its newest measurement.
    ``>1x`` speedup means this set is faster.
    """
    sec = Section(
        "baseline",
        "Against the baseline",
        "speedup = baseline time / this time (>1: faster now); memory = this peak / baseline peak "
        "(<1: less now). `≈`: within the two runs' noise (their time quartiles overlap, or within "
        f"{NOISE_FLOOR:.0%}); `~`: one of the two ran while its machine was slow (its canary), not "
        "compared. " + env_diff(cur, base),
    )
    # each side's shown rows (a sweep run in rounds: its median round's), then the newest of them per
    # workload, variant and N: host to host where the two sides share a machine (a code change
    # measured on each of them: a cell of one host against another's would mix the machines into
    # it), else across machines (the comparison of two machines); every host of this set keeps its rows
    cur = cur[cur["newest"]] if "newest" in cur else cur
    base = base[base["newest"]] if "newest" in base else base
    shared = sorted(set(cur["env_host"].astype(str)) & set(base["env_host"].astype(str)))
    match = [*MATCH_KEYS, "env_host"] if shared else MATCH_KEYS
    cur, base = cur[newest_mask(cur, [*MATCH_KEYS, "env_host"])], base[newest_mask(base, match)]
    cols = [
        "status",
        "valid",
        "time_s",
        "q1_s",
        "q3_s",
        "machine_slowdown",
        "peak_mib",
        "variant",
        "env_host",
        "record_id",
    ]

    def with_times(df: pd.DataFrame) -> pd.DataFrame:
        t = mode_times(df)
        # one record's identity: a sweep that reused its records (resume) hands the same one to both sides
        ident = df[RECORD_IDENTITY].astype(str).agg("|".join, axis=1)
        return df.assign(
            time_s=t["time_s"], q1_s=t["q1_s"], q3_s=t["q3_s"], peak_mib=_col(df, "peak_mib"),
            machine_slowdown=_col(df, "machine_slowdown"), record_id=ident,
        )  # fmt: skip

    cur, base = with_times(cur), with_times(base)
    # matched as text (_token): records and a store read back from CSV hold the same values in
    # different types (1 and 1.0, None and NaN), which a merge on the columns themselves refuses
    tok = {f"_match_{k}": k for k in match}

    def keyed(df: pd.DataFrame) -> pd.DataFrame:
        return df.assign(**{t: df[k].map(_token) for t, k in tok.items()})

    m = (
        keyed(cur)[[*tok, *MATCH_KEYS, *cols]]
        .merge(keyed(base)[[*tok, *cols]], on=list(tok), how="left", suffixes=("", "_base"), indicator=True)
        .drop(columns=list(tok))
    )
    m["started_at"] = pd.NaT
    ok_now = usable(m)
    ok_base = (m["status_base"] == "ok") & ~m["valid_base"].map(is_false).astype(bool)
    both = ok_now & ok_base
    m["speedup"] = (m["time_s_base"] / m["time_s"]).where(both)
    m["memory_ratio"] = (m["peak_mib"] / m["peak_mib_base"]).where(both)
    same = m["record_id"] == m["record_id_base"]
    m["verdict"] = m.apply(lambda r: noise_verdict(r) if pd.notna(r["speedup"]) else None, axis=1)
    m.loc[same, "verdict"] = "same record"

    def ratio_cell(col: str) -> Callable[[pd.Series], str]:
        def cell(row: pd.Series) -> str:
            if row["_merge"] == "left_only":
                return "no baseline"
            if row["verdict"] == "same record":
                return "same record"
            now = status_cell(row)
            if now:
                return now
            if row["status_base"] != "ok":
                return f"{row['status_base']} (baseline)"
            if is_false(row["valid_base"]):
                return "invalid (baseline)"
            if pd.isna(row[col]):
                return "n/a"
            mark = VERDICT_MARK.get(row["verdict"], "") if col == "speedup" else ""
            return f"{row[col]:.2f}x{mark}"

        return cell

    keys = group_keys(m)
    unmatched = []
    for title, sub in groups(m, keys):
        if (sub["_merge"] == "left_only").all():  # a whole table of "no baseline" says nothing
            unmatched.append(title)
            continue
        sec.parts.append((f"{title}: speedup vs baseline", pivot_cells(sub, ratio_cell("speedup"))))
        sec.parts.append((f"{title}: memory vs baseline", pivot_cells(sub, ratio_cell("memory_ratio"))))
    if unmatched:
        labels = ", ".join(sorted(base["variant"].astype(str).unique()))
        sec.note += (
            f" No baseline record of the same workload, variant (with its knobs) and N for: "
            f"{'; '.join(unmatched)} (the baseline's variants: {labels})."
        )
    if shared:
        sec.note += f" Matched host to host (on both sides: {', '.join(shared)})."
    sec.note = f"{verdict_summary(m['verdict'])}. " + sec.note
    sec.data = m.drop(columns=["_merge", "started_at"])
    return sec


def verdict_summary(verdicts: pd.Series) -> str:
    """``3 faster, 1 slower, 5 within noise, 2 on a slow machine (of 11 compared)``, and how many cells
    hold the same record on both sides (not compared)."""
    n = verdicts.value_counts()
    parts = [
        f"{n.get('faster', 0)} faster",
        f"{n.get('slower', 0)} slower",
        f"{n.get('within noise', 0)} within noise",
    ]
    if n.get("slow machine", 0):
        parts.append(f"{n['slow machine']} on a slow machine")
    text = ", ".join(parts) + f" (of {int(n.sum() - n.get('same record', 0))} compared)"
    if n.get("same record", 0):  # not a comparison: resume handed both sides the same measurement
        text += (
            f"; {n['same record']} cell(s) are the same record on both sides (a sweep that reused its "
            "records: resume=false measures them again)"
        )
    return text


def env_diff(cur: pd.DataFrame, base: pd.DataFrame) -> str:
    """What differs between two sets' environments (host, CPU, GPU, torch, commit), as one sentence."""
    fields = [
        "env_host", "env_cpu_model", "env_cpu_capability", "env_gpu_name", "env_torch", "env_cuda",
        "env_git_commit",
    ]  # fmt: skip
    diffs = []
    for f in fields:
        a = sorted(cur[f].dropna().astype(str).unique()) if f in cur else []
        b = sorted(base[f].dropna().astype(str).unique()) if f in base else []
        if a != b:
            diffs.append(
                f"{f.removeprefix('env_')}: {', '.join(a) or '?'} (this) vs {', '.join(b) or '?'} (baseline)"
            )
    return (
        ("Differences: " + "; ".join(diffs) + ".") if diffs else "The two sets report the same environment."
    )
