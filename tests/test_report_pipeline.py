"""The one report CLI regenerates every committed report under ``results/`` with the same tables.

Each store folder with ``records/`` and ``report/`` was reported by
``python -m experiments.report.report <store>/records --out <store>/report``; the same command into a
temporary folder must give the same Markdown (but for the line that says when it was generated) and
the same CSV numbers. Plots are left out: they are pictures of the same numbers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import pytest

from experiments.report.report import main

ROOT = Path(__file__).resolve().parent.parent
STORES = sorted(
    p.parent.relative_to(ROOT).as_posix()
    for p in ROOT.glob("results/**/report")
    if (p.parent / "records").is_dir() and any(p.glob("*.md"))
)
# a number's last binary digits may differ between machines (numpy's least squares in scaling.csv)
RTOL = 1e-9


def _md_lines(path: Path) -> list[str]:
    """The lines of a report's Markdown that do not depend on when it was made, with runs of spaces
    as one (a table's padding); a zero printed as ``-0.00`` (a fit's slope of -1e-17) counts as
    ``0.00``."""
    lines = [" ".join(line.split()) for line in path.read_text().splitlines()]
    return [
        re.sub(r"(?<![\w.])-(0\.0+)(?!\d)", r"\1", line)
        for line in lines
        if not line.startswith("Generated ")
    ]


def _same_cell(a: object, b: object) -> bool:
    """Two CSV cells agree: both empty, equal, or numbers within :data:`RTOL`."""
    if pd.isna(a) and pd.isna(b):
        return True
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-12)
    return a == b


def test_the_committed_stores_are_found():
    assert {"results/cpu/quick", "results/cpu/tasks", "results/cpu/pretrained", "results/cpu/llama"} <= set(
        STORES
    )


@pytest.mark.parametrize("store", STORES)
def test_one_cli_regenerates_the_committed_report(store, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the paths in the reports are as given on the command line
    committed = ROOT / store / "report"
    assert main([f"{store}/records", "--out", str(tmp_path), "--no-plots"]) == 0
    for md in sorted(committed.glob("*.md")):
        assert _md_lines(tmp_path / md.name) == _md_lines(md), md.name
    for csv in sorted(committed.glob("*.csv")):
        old, new = pd.read_csv(csv), pd.read_csv(tmp_path / csv.name)
        assert list(new.columns) == list(old.columns), csv.name
        assert len(new) == len(old), csv.name
        for col in old.columns:
            bad = [i for i, (a, b) in enumerate(zip(old[col], new[col], strict=True)) if not _same_cell(a, b)]
            assert not bad, f"{csv.name} column {col}: rows {bad[:5]} differ"
    made = {p.name for p in tmp_path.iterdir() if p.suffix in (".md", ".csv")}
    assert made == {p.name for p in committed.iterdir() if p.suffix in (".md", ".csv")}
