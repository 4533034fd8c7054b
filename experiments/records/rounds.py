"""Rounds: a sweep run several times over (``round=0,1,2`` as its first sweep parameter), so that
each configuration is measured at several moments minutes apart; tables show the median round.

Why: on a shared machine the speed drifts over minutes. On this project's 2-core VM whole jobs of
the quick sweep ran 15-30% slower in one run than in the next while their own IQR stayed within
10%; no repetition inside one job can see that. Rounds interleave the repetitions with the rest of
the sweep, as airspeed velocity's ``rounds`` do, so a slow minute hits one round of a configuration,
not all of them.

A configuration's rounds are the newest record of each ``round`` measured with the same code as its
newest record (a resumed sweep keeps the rounds it had; rounds from older code are left out). Rounds
whose canary says the machine ran slow (``machine_slowdown`` above ``SLOW_RATIO``, see
:mod:`experiments.measure.canary`) are left out too, unless every round is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..measure.canary import SLOW_RATIO
from ..measure.timing import TIMING_FIELDS

#: timing figures that get their range across rounds (``<fig>_rounds_min_s``, ``_rounds_max_s``)
TIMED = ("fwd", "bwd", "fwd_bwd", "fwd_graph")


def numeric(df: pd.DataFrame, col: str) -> pd.Series:
    """Column ``col`` as numbers (NaN where missing or not a number; all NaN without such a column)."""
    return pd.to_numeric(df[col], errors="coerce") if col in df else pd.Series(np.nan, index=df.index)


def main_time(df: pd.DataFrame) -> pd.Series:
    """The time a round is ranked by: forward+backward for fwd_bwd jobs, else the forward."""
    return numeric(df, "fwd_bwd_median_s").where(df["mode"] == "fwd_bwd", numeric(df, "fwd_median_s"))


def shown_rows(
    df: pd.DataFrame, cell_keys: list[str], newest: pd.Series
) -> tuple[pd.Series, dict[str, dict[Any, Any]]]:
    """Which row tables show per configuration (``cell_keys``), and the values to set on it.

    ``newest``: the newest row per configuration and round. Of a configuration with several ``ok``
    rounds, the row shown is the one with the median :func:`main_time` (the lower middle for an even
    count), so its derived figures (FLOP/s, tokens/s) go with its time; every other timing figure
    (the forward and backward of a fwd_bwd job) is set to its own median round's value, with that
    round's quartiles and stability. Otherwise the newest row is shown as it is. Only the rounds
    measured at the machine's usual speed count when some were and some were not (one such round is
    shown as it is). Returns the mask and ``{column: {row index: value}}``: those figures, ``rounds``
    and each timing figure's min and max across the rounds counted (``<fig>_rounds_min_s``,
    ``<fig>_rounds_max_s``).
    """
    values: dict[str, dict[Any, Any]] = {}
    if not (df["round"] > 0).any():  # no sweep in rounds: one newest row per configuration
        return newest, values
    shown = pd.Series(False, index=df.index)
    latest = df[newest]
    order = latest.sort_values(["started_at", "finished_at", "path"], na_position="first")
    time = main_time(latest)
    for _, cell in order.groupby(cell_keys, dropna=False, sort=False):
        last = cell.index[-1]
        code = cell.get("env_code_version")
        if code is not None:  # only rounds measured with the newest record's code
            cell = cell[(code == code.loc[last]) | (code.isna() & pd.isna(code.loc[last]))]
        ok = cell[(cell["status"] == "ok") & time.loc[cell.index].notna()]
        # rounds measured while the machine ran at its usual speed, where there are any
        usual = ~numeric(ok, "machine_slowdown").gt(SLOW_RATIO)
        if usual.any() and not usual.all():
            ok = ok[usual]
            if len(ok) == 1:
                shown[ok.index[0]] = True
                continue
        if len(ok) < 2:
            shown[last] = True
            continue
        pick = _median_index(time.loc[ok.index])
        shown[pick] = True
        values.setdefault("rounds", {})[pick] = len(ok)
        for p in TIMED:
            vals = numeric(ok, f"{p}_median_s").dropna()
            if not len(vals):
                continue
            values.setdefault(f"{p}_rounds_min_s", {})[pick] = float(vals.min())
            values.setdefault(f"{p}_rounds_max_s", {})[pick] = float(vals.max())
            own = _median_index(vals)
            for field in TIMING_FIELDS:  # the fields that come with its median round
                if f"{p}_{field}" in df:
                    values.setdefault(f"{p}_{field}", {})[pick] = df.at[own, f"{p}_{field}"]
    return shown, values


def _median_index(s: pd.Series) -> Any:
    """The index of the median value of ``s`` (the lower middle for an even count)."""
    ranked = s.sort_values(kind="stable")
    return ranked.index[(len(ranked) - 1) // 2]
