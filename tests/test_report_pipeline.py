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


def _one_record(folder: Path) -> Path:
    """A folder holding one committed record of the quick sweep (a whole, valid record)."""
    import shutil

    folder.mkdir(parents=True)
    src = sorted((ROOT / "results/cpu/quick/records").glob("*.json"))[0]
    return Path(shutil.copy(src, folder))


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda r: r["config"].update(variant="sdpa"), "its config.variant is a str, not an object"),
        (lambda r: r.update(figures=[1]), "its figures is a list, not an object"),
        (lambda r: r["config"].update(seq_len="abc"), "its config.seq_len is 'abc', not a whole number"),
        (lambda r: r["figures"].update(fwd_median_s="x"), "its figures.fwd_median_s is 'x', not a number"),
    ],
)
def test_a_record_of_the_wrong_shape_is_listed_as_unreadable_and_left_out(tmp_path, capsys, edit, why):
    """Valid JSON with a record's keys but a part of the wrong type once broke the report midway with a
    traceback (AttributeError, IndexError); it is left out and named, as a record cut short is."""
    import json

    good = _one_record(tmp_path / "records")
    bad = json.loads(good.read_text())
    edit(bad)
    bad["started_at"] = "2000-01-01T00:00:00+00:00"  # another record, not a copy of the good one
    bad_path = tmp_path / "records" / "bad.json"
    bad_path.write_text(json.dumps(bad))
    assert main([str(tmp_path / "records"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "loaded 1 record(s) from 2 file(s)" in out and "1 unreadable file(s)" in out
    assert f"\n  unreadable: {bad_path}: {why}\n" in out


def test_a_report_folder_that_cannot_be_made_is_one_line(tmp_path, capsys, monkeypatch):
    """The default report folder inside a read-only records folder (a shared results folder) and an
    --out that cannot be made were tracebacks: os.access says yes to root on a read-only mount, so the
    check tries for real. Here a folder under ``locked`` cannot be made, as on a read-only mount."""
    records = tmp_path / "locked"
    _one_record(records)
    real_mkdir = Path.mkdir

    def read_only(self: Path, *args, **kwargs) -> None:
        if records in (self, *self.parents) and self != records:
            raise PermissionError(1, "Operation not permitted", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main([str(records), "--no-plots"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: the report's default folder {records / 'report'}: {records / 'report'} cannot be "
        "written: Operation not permitted; write it elsewhere with --out"
    )
    assert main([str(records), "--out", str(records / "x" / "y"), "--no-plots"]) == 1
    err = capsys.readouterr().err.strip()
    deep = records / "x" / "y"
    assert err == f"error: --out {deep}: {deep} cannot be written: Operation not permitted"
    # a folder that can be written is still taken, and no folder is left behind by the check
    assert main([str(records), "--out", str(tmp_path / "a" / "b"), "--no-plots"]) == 0
    assert (tmp_path / "a" / "b" / "tables.md").is_file()


def test_a_table_that_is_not_a_saved_store_names_each_missing_column_once(tmp_path):
    from experiments.records.store import read_store

    table = tmp_path / "speed.csv"
    table.write_text("variant,seq_len\nsdpa,64\n")
    with pytest.raises(ValueError) as exc:
        read_store(table)
    said = str(exc.value).split("no column ", 1)[1].split(", ")
    assert said == ["status", "config_hash", "env_host", "started_at", "finished_at"]


def test_every_report_option_is_documented(capsys):
    """``--help`` lists the report's options; a user reading README and docs/ should find each too."""
    with pytest.raises(SystemExit):
        main(["--help"])
    options = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", capsys.readouterr().out)) - {"--help"}
    assert {"--out", "--baseline", "--all-measurements", "--no-plots"} <= options
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    assert not [o for o in sorted(options) if not re.search(rf"(?<![\w-]){o}(?![\w-])", docs)]
