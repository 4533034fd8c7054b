"""Formatting shared by every section: numbers as text, a frame as a Markdown table, a section (its
tables and the numbers behind them) as Markdown, and a record cell read back as an object."""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

#: Markdown columns aligned left besides the index: text, not figures
LEFT_COLUMNS = ("status", "N", "reason", "task")


@dataclass
class Section:
    """One kind of table: formatted tables per group (Markdown) and the numbers behind them (CSV)."""

    name: str
    title: str
    note: str = ""
    parts: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    data: pd.DataFrame = field(default_factory=pd.DataFrame)


def rate_prefix(value: float) -> tuple[str, float]:
    """``("T", 1e12)`` where a rate (per second) is a thousand G or more (a GPU's GEMM, 6.8e+05
    GFLOP/s), else ``("G", 1e9)``."""
    return ("T", 1e12) if value >= 1e12 else ("G", 1e9)


def rate(rates: pd.Series, unit: str) -> str:
    """The median of ``rates`` (per second) at three digits: ``92.5 GFLOP/s``, ``682 TFLOP/s``."""
    median = rates.median()
    prefix, scale = rate_prefix(median)
    return f"{median / scale:.3g} {prefix}{unit}"


def num(x: float) -> str:
    """About three significant digits without exponents for ordinary magnitudes (12.3, 0.0512, 1234)."""
    if x is None or not math.isfinite(x):
        return "n/a"
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}" if a >= 1e-3 or a == 0 else f"{x:.2e}"


def sci(x: float) -> str:
    """Scientific notation for errors (``7.4e-07``)."""
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.1e}"


def markdown(table: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table of ``table`` (index levels become the first columns).

    Index columns and text columns (status, reason, lists of N) are left-aligned, figures right.
    """
    flat = table.reset_index()
    head = [str(c) for c in flat.columns]
    rows = [
        ["" if pd.isna(v) else str(v).replace("|", "\\|") for v in r] for r in flat.itertuples(index=False)
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    n_idx = table.index.nlevels
    left = [i < n_idx or h in LEFT_COLUMNS for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if lf else c.rjust(w) for c, w, lf in zip(cells, widths, left, strict=True))
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|" + "|".join("-" * (w + 1) + ("-" if lf else ":") for w, lf in zip(widths, left, strict=True)) + "|"
    )
    return "\n".join([line(head), rule, *(line(r) for r in rows)])


def render(sec: Section) -> str:
    """A section as Markdown: its title, note and each table under a bold heading."""
    out = [f"## {sec.title}", ""]
    if sec.note:
        out += [sec.note, ""]
    for heading, tab in sec.parts:
        if tab.empty:
            continue
        out += [f"**{heading}**", "", markdown(tab), ""]
    return "\n".join(out)


def obj(v: Any) -> Any:
    """A dict or list cell as an object (a CSV round trip leaves JSON or a Python repr)."""
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            try:
                return ast.literal_eval(v)
            except (ValueError, SyntaxError):
                return None
    return v
