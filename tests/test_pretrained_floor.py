"""The pretrained report's CSV (``pretrained.csv``) carries the floor rows its tables show: the figures of
``<store>/floor.json`` as ``scripts/pretrained_floor.py`` wrote them for the committed stores (the
oracle: the file itself), marked by a column ``floor`` so that no reader takes them for a variant.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from experiments.records import store
from experiments.report import pretrained_section as ps

ROOT = Path(__file__).resolve().parents[1]
# the figures a floor.json holds per floor, each a column of the CSV under the same name
FIGURES = ["cosine_mean", "cosine_p5", "cosine_min", "top1_agreement", "top5_agreement", "retrieval_top1"]


def _store(tmp_path: Path, name: str, lengths: set[int], with_floor: bool) -> tuple[Path, dict]:
    """A copy of committed store ``results/cpu/<name>`` holding its records at ``lengths`` only and
    (``with_floor``) its floor.json; returns the copy's folder and the committed floor.json."""
    src = ROOT / "results" / "cpu" / name
    (tmp_path / "records").mkdir(parents=True)
    for path in sorted((src / "records").glob("*.json")):
        if json.loads(path.read_text())["config"]["seq_len"] in lengths:
            shutil.copy(path, tmp_path / "records")
    if with_floor:
        shutil.copy(src / "floor.json", tmp_path)
    return tmp_path, json.loads((src / "floor.json").read_text())


def _csv(folder: Path) -> pd.DataFrame:
    """pretrained.csv as the report writes it for the records in ``folder/records``, read back."""
    df = store.load([folder / "records"])
    ps.write_report(df, folder / "report", plots=False)
    return pd.read_csv(folder / "report" / "pretrained.csv")


@pytest.mark.parametrize("name, lengths", [("pretrained", {128, 512}), ("pretrained_mix", {128, 256})])
def test_the_csv_carries_the_floor_rows_with_the_floor_files_figures(tmp_path, name, lengths):
    folder, floor = _store(tmp_path, name, lengths, with_floor=True)
    csv = _csv(folder)
    records = len(list((folder / "records").glob("*.json")))
    variants, floors = csv[csv["floor"].isna()], csv[csv["floor"].notna()]
    assert len(variants) == records and variants["status"].eq("ok").all()
    # one row per length of the records (not floor.json's other lengths) and main floor
    want = {(n, k) for n in lengths for k in floor["main"]}
    got = list(zip(floors["seq_len"], floors["floor"], strict=True))
    assert sorted(got) == sorted(want) and floor["main"] == ["zeros", "uniform"]
    for _, row in floors.iterrows():
        at = floor["lengths"][str(row["seq_len"])]
        for fig in FIGURES:
            assert row[fig] == pytest.approx(at["floors"][row["floor"]][fig], rel=1e-12), (row["floor"], fig)
        assert row["variant"] == f"floor: {floor['names'][row['floor']]}"
        assert row["texts_sha256"] == at["texts_sha256"]
        assert pd.isna(row["status"]) and pd.isna(row["batch_ms_median"]) and pd.isna(row["kept_pairs"])
        assert row["path"] == str(folder / "floor.json")
    # the table of each length shows the same floors the CSV carries
    for title, tab in ps.fidelity_table(store.load([folder / "records"])):
        n = int(title.split("N=")[1].split()[0])
        shown = {i for i in tab.index if i.startswith("floor: ")}
        assert shown == set(floors.loc[floors["seq_len"] == n, "variant"]), title


def test_a_store_without_a_floor_file_or_with_other_texts_gets_no_floor_rows(tmp_path):
    folder, floor = _store(tmp_path / "none", "pretrained", {128, 512}, with_floor=False)
    csv = _csv(folder)
    assert "floor" in csv.columns and csv["floor"].isna().all()
    assert len(csv) == len(list((folder / "records").glob("*.json")))
    # a floor.json whose N=512 texts are not the records' gives floor rows at N=128 only
    floor["lengths"]["512"]["texts_sha256"] = "0" * 64
    (folder / "floor.json").write_text(json.dumps(floor))
    csv = _csv(folder)
    assert csv.loc[csv["floor"].notna(), "seq_len"].tolist() == [128, 128]
