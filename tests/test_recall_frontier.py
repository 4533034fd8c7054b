"""The recall-versus-state frontier: ``experiment=recall_frontier`` run for real at a tiny size, the
state each record keeps checked against an analytic count, and the report's frontier (table and plot)
against the records it was made from."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.records.records import read_records

from .helpers import sweep_overrides

ROOT = Path(__file__).resolve().parents[1]
N, D = 32, 16


def _state(name: str, heads: int, window: int = 0) -> int:
    """Bytes one sequence keeps per layer after N tokens, fp32, written from each core's definition:
    exact attention keeps every key and value; a window the last ``window``; linear attention a
    ``(D/H) x (D/H + 1)`` matrix per head (values and the normaliser); the hybrid a window and that."""
    d = D // heads
    return {
        "sdpa": heads * N * 2 * d * 4,
        "local_window": heads * window * 2 * d * 4,
        "linear": heads * d * (d + 1) * 4,
        "window_linear": heads * window * 2 * d * 4 + window + heads * d * (d + 1) * 4,
    }[name]


def test_the_frontier_experiment_runs_and_its_report_matches_the_records(tmp_path):
    cmd = [
        sys.executable,
        "run.py",
        "-m",
        "experiment=recall_frontier",
        "variant=sdpa,linear,frontier/local_window_w16,frontier/window_linear_w16",
        "task.num_pairs=2,4",
        "task.heads=2",
        "seed=0",
        f"seq_len={N}",
        f"task.d_model={D}",
        "task.steps=3",
        "task.warmup=1",
        "task.batch_size=4",
        "task.test_size=16",
        "task.num_queries=4",
        f"records_dir={tmp_path / 'records'}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(sweep_overrides(*cmd), cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    recs = read_records(tmp_path / "records")
    assert len(recs) == 8 and p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    for r in recs:
        assert r["status"] == "ok", r["reason"]
        f = r["figures"]
        window = (r["variant"]["knobs"] or {}).get("window", 0)
        assert f["state_bytes"] == _state(r["variant_name"], f["model_heads"], window), r["label"]
        assert f["infer_us_per_token"] > 0 and f["step_ms"] > 0
        assert r["config"]["task"]["causal"] is True

    from experiments.records.store import load
    from experiments.report.frontier_section import frontier_table

    table = frontier_table(load([tmp_path / "records"], verbose=False))
    assert len(table) == 4 * 2  # variants x pairs, one seed each
    for r in recs:
        f = r["figures"]
        hit = table[
            (table["variant_name"] == r["variant_name"]) & (table["pairs"] == f["task_knobs"]["num_pairs"])
        ]
        assert len(hit) == 1 and hit.iloc[0]["seeds"] == 1
        assert hit.iloc[0]["acc_mean"] == pytest.approx(f["test_accuracy"])
        assert hit.iloc[0]["state_bytes"] == f["state_bytes"]
        assert math.isnan(hit.iloc[0]["acc_std"])  # one seed has no spread
    # written at the end of the sweep: the table and the plot
    out = tmp_path / "sweep" / "report"
    for name in ("recall_frontier.md", "recall_frontier.csv", "recall_frontier.png"):
        assert (out / name).stat().st_size > 0, name
    text = (out / "recall_frontier.md").read_text()
    assert "2 pairs" in text and "4 pairs" in text and "window_linear" in text


def test_a_store_of_one_variant_draws_no_frontier():
    import pandas as pd

    from experiments.report.frontier_section import frontier_table

    task = '{"name": "recall", "causal": true, "d_model": 16, "heads": 1, "num_pairs": 4}'
    df = pd.DataFrame(
        [
            {
                "kind": "task",
                "variant": "sdpa",
                "variant_name": "sdpa",
                "task": task,
                "seq_len": 32,
                "seed": s,
                "status": "ok",
                "state_bytes": 4096,
                "test_accuracy": 1.0,
                "started_at": pd.Timestamp("2026-11-25", tz="UTC"),
            }
            for s in (0, 1)
        ]
    )
    assert frontier_table(df).empty


def test_the_training_cost_table_compares_each_row_with_sdpa_in_the_same_model():
    """experiment=lra_efficiency's table: steps per second from the median step, and both ratios
    against sdpa of the same model (two-way rows against two-way sdpa, causal against causal)."""
    import json

    import pandas as pd

    from experiments.report.efficiency_section import efficiency_table

    def rec(variant: str, causal: bool, n: int, step_ms: float, peak: float, status: str = "ok") -> dict:
        task = {"name": "copy", "causal": causal, "peak_memory": True}
        return {
            "kind": "task",
            "variant": variant,
            "variant_name": variant,
            "task": json.dumps(task),
            "seq_len": n,
            "seed": 0,
            "status": status,
            "step_ms_median": step_ms,
            "step_peak_mib": peak,
            "started_at": pd.Timestamp("2026-11-25", tz="UTC"),
        }

    df = pd.DataFrame(
        [
            rec("sdpa", False, 1024, 500.0, 40.0),
            rec("linear", False, 1024, 250.0, 10.0),
            rec("sdpa", True, 1024, 400.0, 30.0),
            rec("ssd", True, 1024, 800.0, 60.0),
            rec("naive", False, 1024, math.nan, math.nan, status="oom"),
            {**rec("sdpa", False, 1024, 1.0, 1.0), "task": json.dumps({"name": "copy"})},  # no peak: not here
        ]
    )
    t = efficiency_table(df).set_index("variant")
    assert t.loc["linear", "steps_per_s"] == pytest.approx(4.0)
    assert t.loc["linear", "speedup"] == pytest.approx(2.0) and t.loc[
        "linear", "memory_ratio"
    ] == pytest.approx(0.25)
    assert t.loc["ssd (causal)", "speedup"] == pytest.approx(0.5)  # against causal sdpa's 400 ms
    assert t.loc["ssd (causal)", "memory_ratio"] == pytest.approx(2.0)
    assert t.loc["sdpa", "steps_per_s"] == pytest.approx(2.0)  # the record without peak_memory is not in it
    assert t.loc["naive", "runs"] == 0 and t.loc["naive", "status"].startswith("oom")


def _recall_frame(pairs: tuple[int, ...] = (4, 8), seeds: tuple[int, ...] = (0, 1)):
    """Recall task rows of sdpa and linear, as the store holds them (no floor in the records)."""
    import pandas as pd

    rows = []
    for v in ("sdpa", "linear"):
        for p in pairs:
            task = {"name": "recall", "causal": True, "d_model": 16, "heads": 1, "num_pairs": p}
            task |= {"test_size": 48, "num_queries": 4}
            for s in seeds:
                rows.append(
                    {"kind": "task", "variant": v, "variant_name": v, "task": json.dumps(task)}
                    | {"seq_len": 32, "seed": s, "status": "ok", "state_bytes": 4096, "test_accuracy": 0.5}
                    | {"started_at": pd.Timestamp("2026-11-25", tz="UTC")}
                )
    return pd.DataFrame(rows)


def _floor_of(pairs: int, seeds: tuple[int, ...]) -> float:
    """The floor on the test sets a job at each seed draws (measure_task: generator 2 * seed + 1)."""
    import torch

    from experiments.measure.tasks.data import context_floor, draw, make_task

    task = make_task("recall", 32, num_pairs=pairs, num_queries=4)
    sets = [draw(task, 48, torch.Generator().manual_seed(2 * s + 1), "test") for s in seeds]
    return sum(context_floor(task, b) for b in sets) / len(sets)


def test_the_frontier_shows_the_floor_of_its_test_sets_in_table_markdown_and_plot(tmp_path, monkeypatch):
    """The records carry no floor: the report computes it from their task settings and seeds, puts it
    in the table, adds a floor row per N to the Markdown and a dashed line per panel to the plot."""
    from experiments.report import frontier_section as fs

    table = fs.frontier_table(_recall_frame())
    for p in (4, 8):
        want = _floor_of(p, (0, 1))
        assert 0.2 < want < 0.9  # far above 1 / num_values = 1/16
        assert list(table.loc[table["pairs"] == p, "floor"]) == pytest.approx([want, want]), p
    last = fs.frontier_markdown(table).strip().splitlines()[-1]
    cells = [c.strip() for c in last.strip("|").split("|")]
    assert cells[0] == fs.FLOOR_LABEL and cells[2] == "32"
    assert cells[4:6] == [f"{100 * _floor_of(4, (0, 1)):.1f}", f"{100 * _floor_of(8, (0, 1)):.1f}"]

    figs = []
    monkeypatch.setattr(fs, "save_figure", lambda fig, path: figs.append(fig) or Path(path))
    fs.plot_frontier(table, tmp_path / "f.png")
    for ax, p in zip(figs[0].axes, (4, 8), strict=False):
        assert _floor_lines(ax) == pytest.approx([100 * _floor_of(p, (0, 1))]), p
    assert fs.FLOOR_LABEL in figs[0]._suptitle.get_text()  # the legend's lines are the variants'


def _floor_lines(ax) -> list[float]:
    """The heights (%) of the dashed horizontal lines across ``ax`` (line collections)."""
    from matplotlib.collections import LineCollection

    out = []
    for c in ax.collections:
        if isinstance(c, LineCollection) and c.get_linestyle()[0][1] is not None:  # dashed
            out += [float(seg[0][1]) for seg in c.get_segments() if seg[0][1] == seg[1][1]]
    return out
