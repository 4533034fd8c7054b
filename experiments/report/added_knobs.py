"""Knobs a variant gained between two runs: a record written before a knob existed holds no value for
it, so its configuration matched none of the newer records' and a comparison across the change read
"baseline only" for the old cells and "no baseline" for the new (sparse gained ``global_rows`` and
``cuda_tile``: all ten sparse cells of the scaling store). The knob is taken at the class's default
today, which is what the older code ran whenever the default kept its behaviour; the comparison
says which knobs it filled and with what.
"""

from __future__ import annotations

import inspect
import json

import pandas as pd
from hydra.utils import get_class

from variants.registry import knob_defaults

from ..records.store import variant_labels


def _defaults(target: str) -> dict[str, object]:
    """The knobs and defaults of the class at import path ``target`` (``module.Class``); empty when it
    cannot be imported (a third party's class not installed here): nothing is filled then."""
    try:
        cls = get_class(target)  # as the sweep resolves a variant's _target_ (experiments/sweep/checks.py)
        return {k: v for k, v in knob_defaults(cls).items() if v is not inspect.Parameter.empty}
    except (ImportError, AttributeError, ValueError, TypeError):
        return {}


def fill_added_knobs(cur: pd.DataFrame, base: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """``cur`` and ``base`` with each row's missing knobs filled in at today's default, for the knobs
    another row of the same class (on either side) holds; ``knobs`` and ``variant_key`` rewritten.
    A side's labels (``variant``) are made again where a knob was filled. Also a text per class and
    side filled, e.g. ``sparse: the baseline's records lack cuda_tile, global_rows, taken at their
    defaults (auto, auto)``. O(rows x knobs)."""
    if "knobs" not in cur or "knobs" not in base:  # a side without records
        return cur, base, []
    sides = {"these": cur.copy(), "the baseline's": base.copy()}
    said: list[str] = []
    changed: set[str] = set()
    for df in sides.values():
        df["variant_target"] = df["variant_target"].astype(str)
    targets = set(sides["these"]["variant_target"]) | set(sides["the baseline's"]["variant_target"])
    for target in sorted(targets):
        held = {  # side -> row -> its knobs
            side: {i: json.loads(k) for i, k in df.loc[df["variant_target"] == target, "knobs"].items()}
            for side, df in sides.items()
        }
        names = {k for rows in held.values() for knobs in rows.values() for k in knobs}
        if all(set(knobs) == names for rows in held.values() for knobs in rows.values()):
            continue  # every record holds every knob: nothing to fill
        defaults = _defaults(target)
        for side, df in sides.items():
            filled: set[str] = set()
            for i, knobs in held[side].items():
                missing = sorted(k for k in names - set(knobs) if k in defaults)
                if missing:
                    knobs.update({k: defaults[k] for k in missing})
                    df.loc[i, "knobs"] = json.dumps(dict(sorted(knobs.items())), sort_keys=True, default=str)
                    filled.update(missing)
            if filled:
                changed.add(side)
                variant = df.loc[list(held[side]), "variant_name"].astype(str).iloc[0]
                values = ", ".join(str(defaults[k]) for k in sorted(filled))
                said.append(
                    f"{variant}: {side} records lack {', '.join(sorted(filled))}, taken at their "
                    f"defaults ({values})"
                )
    for side in changed:  # as the store makes them (experiments.records.store.finish)
        df = sides[side]
        df["variant_key"] = df["variant_target"] + df["knobs"].astype(str)
        df["variant"] = variant_labels(df).astype(str)
    return sides["these"], sides["the baseline's"], said
