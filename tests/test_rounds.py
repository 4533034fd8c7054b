"""A sweep run in rounds: tables show each configuration's median round, with the range across rounds."""

from __future__ import annotations

import pytest

from experiments.records import store
from experiments.records.records import config_hash
from experiments.records.store import select
from experiments.report.kernel_tables import LEGEND, speed_table


def record(
    round_: int,
    fwd_bwd_s: float,
    fwd_s: float,
    hour: int,
    code: str = "c1",
    status: str = "ok",
    canary_ms: float | None = None,
) -> dict:
    """A fwd_bwd record of naive at N=256 measured in ``round_`` at ``hour`` o'clock with code ``code``
    (and a canary of ``canary_ms`` before and after it, if given)."""
    cfg = {
        "variant": {"_target_": "variants.naive.NaiveAttention"},
        "device": "cpu",
        "dtype": "float32",
        "mode": "fwd_bwd",
        "batch": 1,
        "heads": 8,
        "head_dim": 64,
        "seq_len": 256,
        "seed": 0,
        "threads": 1,
        "round": round_,
    }
    figures = {"fwd_median_s": fwd_s, "fwd_bwd_median_s": fwd_bwd_s, "bwd_median_s": fwd_bwd_s - fwd_s}
    figures.update(
        {f"{p}_{q}_s": figures[f"{p}_median_s"] for p in ("fwd", "bwd", "fwd_bwd") for q in ("q1", "q3")}
    )
    figures["valid"] = True
    if canary_ms is not None:
        figures["canary_before_ms"] = figures["canary_after_ms"] = canary_ms
    return {
        "variant_name": "naive",
        "label": f"naive round {round_}",
        "status": status,
        "reason": None if status == "ok" else "child ended by SIGKILL",
        "config": cfg,
        "config_hash": config_hash(cfg),
        "figures": figures if status == "ok" else {},
        "env": {"host": "vm", "code_version": code},
        "started_at": f"2026-11-23T{hour:02d}:00:00+00:00",
        "finished_at": f"2026-11-23T{hour:02d}:00:30+00:00",
        "_path": f"r{round_}-{hour}.json",
    }


def shown(records: list[dict]):
    df = store.to_frame(records)
    return df, df[df["newest"]]


def test_the_median_round_is_shown_with_the_range_of_every_timing_figure():
    # fwd+bwd 30, 20, 10 ms: round 1 is the median one (not the newest); the forward is its own
    # median round's (1, 9, 3 ms: round 2's), with that round's quartiles
    df, rows = shown([record(0, 0.030, 0.001, 10), record(1, 0.020, 0.009, 11), record(2, 0.010, 0.003, 12)])
    assert len(rows) == 1
    row = rows.iloc[0]
    assert (row["round"], row["fwd_bwd_median_s"], row["fwd_median_s"], row["fwd_q1_s"]) == (
        1,
        0.020,
        0.003,
        0.003,
    )
    assert row["bwd_median_s"] == pytest.approx(0.011)  # bwd 29, 11, 7 ms: round 1's
    assert row["rounds"] == 3
    assert (row["fwd_bwd_rounds_min_s"], row["fwd_bwd_rounds_max_s"]) == (0.010, 0.030)
    assert (row["fwd_rounds_min_s"], row["fwd_rounds_max_s"]) == (0.001, 0.009)
    speed = speed_table(select(df))
    assert speed.data["time_ms"].tolist() == pytest.approx([20.0])
    assert speed.data[["rounds_min_ms", "rounds_max_ms"]].iloc[0].tolist() == pytest.approx([10.0, 30.0])
    assert "median time" in speed.parts[0][0] and speed.parts[0][1].iloc[0, 0].startswith("20")


def test_rounds_of_older_code_and_replaced_rounds_are_left_out():
    recs = [
        record(0, 0.010, 0.001, 9),  # replaced by the round 0 of 12:00
        record(1, 0.001, 0.001, 9, code="c0"),  # older code: not a round of this measurement
        record(0, 0.050, 0.001, 12),
        record(2, 0.040, 0.001, 13),
        record(3, 0.060, 0.001, 13),
    ]
    _, rows = shown(recs)
    # rounds 40, 50, 60 ms (the 10 and 1 ms rows are out): median 50 (round 0 of 12:00); the lower
    # middle of an even count is tested by leaving out round 3 below
    assert rows["fwd_bwd_median_s"].tolist() == [0.050] and rows["rounds"].tolist() == [3]
    assert rows["fwd_bwd_rounds_min_s"].tolist() == [0.040]
    _, rows = shown(recs[:4])
    assert rows["fwd_bwd_median_s"].tolist() == [0.040] and rows["rounds"].tolist() == [2]


def test_a_failed_round_is_not_ranked_and_a_single_measurement_is_shown_as_before():
    _, rows = shown(
        [record(0, 0.020, 0.001, 10), record(1, 0.0, 0.0, 11, status="killed"), record(2, 0.030, 0.001, 12)]
    )
    assert rows["fwd_bwd_median_s"].tolist() == [0.020] and rows["rounds"].tolist() == [
        2
    ]  # lower middle of 2
    _, rows = shown([record(0, 0.030, 0.001, 10)])
    assert rows["fwd_bwd_median_s"].tolist() == [0.030] and "rounds" not in rows
    _, rows = shown([record(0, 0.030, 0.001, 10), record(0, 0.070, 0.001, 11)])  # measured again: the newest
    assert rows["fwd_bwd_median_s"].tolist() == [0.070]


def test_round_enters_the_hash_only_when_not_zero():
    r = record(0, 0.01, 0.001, 10)
    without = {k: v for k, v in r["config"].items() if k != "round"}
    assert config_hash(r["config"]) == config_hash(without)  # records from before rounds still resume
    assert config_hash({**r["config"], "round": 1}) != config_hash(r["config"])


def test_records_from_before_rounds_load_as_round_zero():
    old = record(0, 0.030, 0.001, 10)
    del old["config"]["round"]  # written before the knob existed
    _, rows = shown([old])
    assert rows["round"].tolist() == [0] and rows["fwd_bwd_median_s"].tolist() == [0.030]


def test_rounds_measured_while_the_machine_ran_slow_are_left_out_and_marked():
    # canaries 20, 30 (1.5x: slow), 21 ms: the median of the usual rounds (10 and 40 ms fwd+bwd) is the
    # lower one, 10 ms, not the slow round's 25 ms, which the median of all three would have shown
    recs = [
        record(0, 0.040, 0.001, 10, canary_ms=20.0),
        record(1, 0.025, 0.001, 11, canary_ms=30.0),
        record(2, 0.010, 0.001, 12, canary_ms=21.0),
    ]
    df, rows = shown(recs)
    assert rows["fwd_bwd_median_s"].tolist() == [0.010] and rows["rounds"].tolist() == [2]
    assert rows["fwd_bwd_rounds_max_s"].tolist() == [0.040]
    assert df["machine_slowdown"].tolist() == pytest.approx([1.0, 1.5, 1.05])
    speed = speed_table(select(df))
    assert speed.parts[0][1].iloc[0, 0] == "10.0 (n/a)" and "`~`" in LEGEND
    assert speed.data["machine_slowdown"].tolist() == pytest.approx([1.05])
    # one usual round: shown as it is; every round slow (against a faster canary of another
    # configuration): the median of all, marked
    _, rows = shown(recs[:2])
    assert rows["fwd_bwd_median_s"].tolist() == [0.040] and "rounds" not in rows
    other = record(0, 0.5, 0.001, 9, canary_ms=10.0)
    other["config"]["seq_len"] = 1024
    other["config_hash"] = "other"
    df, _ = shown([other, *recs])
    speed = speed_table(select(df))
    cells = speed.parts[0][1]
    assert cells.loc[cells.index[0], "N=256"] == "25.0 (n/a) ~"  # 40, 25, 10 ms: 25; canaries 2-3x
    assert not cells.loc[cells.index[0], "N=1024"].endswith("~")
