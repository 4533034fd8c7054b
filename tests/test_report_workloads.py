"""The report never shows one workload's figure as another's: records that differ in any workload
field (cross-attention, a given batch beside a token budget, the query length of a decode sweep) or
in where they ran (host, device, dtype, threads) stay apart in every table and plot, and a comparison
of a store with itself finds nothing changed."""

from __future__ import annotations

import pandas as pd
import pytest

from experiments.records import store
from experiments.records.records import config_hash
from experiments.report import plots
from experiments.report.compare import baseline_table
from experiments.report.efficiency_section import efficiency_table
from experiments.report.grouping import group_keys
from experiments.report.kernel_tables import scaling_fits, speed_table
from experiments.report.model_section import model_table, plot_context
from experiments.report.task_section import task_table


def kernel(n: int, ms: float, hour: int = 10, variant: str = "naive", **config) -> dict:
    """An ok fwd record of ``variant`` at N=``n`` taking ``ms``, started at ``hour`` o'clock, with
    ``config`` over the defaults (B=1, H=8, D=64, cpu, float32, one thread)."""
    target = {"naive": "variants.naive.NaiveAttention", "sdpa": "variants.sdpa.SDPAAttention"}[variant]
    cfg = {
        "variant": {"_target_": target},
        **{"device": "cpu", "dtype": "float32", "mode": "fwd", "batch": 1, "heads": 8, "head_dim": 64},
        **{"seq_len": n, "seed": 0, "threads": 1, "round": 0},
        **config,
    }
    s = ms / 1e3
    figures = {"fwd_median_s": s, "fwd_q1_s": s, "fwd_q3_s": s, "valid": True, "peak_mib": ms}
    return {
        "variant_name": variant,
        "label": f"{variant} N={n}",
        "status": "ok",
        "reason": None,
        "config": cfg,
        "config_hash": config_hash(cfg),
        "figures": figures,
        "env": {"host": "vm", "code_version": "c1"},
        "started_at": f"2026-11-23T{hour:02d}:00:00+00:00",
        "finished_at": f"2026-11-23T{hour:02d}:00:30+00:00",
        "_path": f"{variant}-{n}-{ms}-{hour}.json",
    }


def speed_cells(df: pd.DataFrame) -> dict[str, dict[str, str]]:
    """The speed table's time groups: ``{group title: {"<variant> N=<n>": cell}}``."""
    out = {}
    for title, tab in speed_table(store.select(df)).parts:
        if title.endswith(": median time, ms (IQR)"):
            cells = {f"{v} {c}": str(tab.loc[v, c]) for v in tab.index for c in tab.columns}
            out[title.removesuffix(": median time, ms (IQR)")] = cells
    return out


def test_cross_attention_is_a_workload_of_its_own():
    """The same shape as self- and as cross-attention: two rows, neither hides the other, and the
    group says which is cross."""
    df = store.to_frame([kernel(256, 2.0, hour=9), kernel(256, 20.0, hour=10, cross=True)])
    assert df["newest"].tolist() == [True, True]
    cells = speed_cells(df)
    (self_title,) = [t for t in cells if "cross=False" in t]
    (cross_title,) = [t for t in cells if "cross=True" in t]
    assert any(c.startswith("2.0") for c in cells[self_title].values())
    assert any(c.startswith("20.0") for c in cells[cross_title].values())
    # a store of cross-attention alone says so in its workload line, one of self-attention does not
    from experiments.report.grouping import workload_line

    assert "cross=True" in workload_line(store.to_frame([kernel(256, 20.0, cross=True)]))
    assert "cross" not in workload_line(store.to_frame([kernel(256, 2.0)]))
    # a record from before cross-attention existed is self-attention
    old = kernel(256, 2.0)
    assert store.to_frame([old])["cross"].tolist() == [False]


def test_a_given_batch_stays_a_group_key_beside_a_token_budget():
    """Explicit batches 1 and 4 and a token budget (batch = tokens // N) in one store: the two batches
    are two groups, and the budget's rows one group over its lengths, titled with an integer."""
    recs = [kernel(256, 2.0), kernel(256, 8.0, batch=4)]
    recs += [kernel(n, n / 100, variant="sdpa", tokens=1024, batch=1024 // n) for n in (256, 512)]
    df = store.to_frame(recs)
    assert "batch" in group_keys(df)
    cells = speed_cells(df)
    by_batch = {t: v for t, v in cells.items() if "tokens=null" in t}
    assert len(by_batch) == 2, cells
    assert {next(iter(v.values()))[:3] for v in by_batch.values()} == {"2.0", "8.0"}
    (budget,) = [t for t in cells if "tokens=1024" in t]
    assert "tokens=1024.0" not in budget and "batch=tokens/N" in budget
    assert len(cells[budget]) == 2  # N=256 and 512 in one group, though their batches differ
    fits = scaling_fits(df)  # the budget's two lengths are one fit
    assert (fits["time_points"] == 2).sum() == 1


def test_a_store_compared_with_itself_finds_every_cell_the_same_record():
    """A sweep run in rounds shows its median round; the baseline side must take the same one, not
    the last round, or a store against itself shows speedups."""
    recs = []
    for n in (256, 512):
        for rnd, ms in enumerate((10.0, 12.0, 20.0)):  # median: 12 ms (round 1); the last: 20
            recs.append(kernel(n, ms, hour=10 + rnd, round=rnd))
    df = store.to_frame(recs)
    sec = baseline_table(df, df)
    assert sec.data["speedup"].tolist() == pytest.approx([1.0, 1.0])
    assert "2 cell(s) are the same record" in sec.note


def test_the_scaling_plot_keeps_each_query_length_of_a_decode_sweep_apart(monkeypatch, tmp_path):
    """Decode sweeps fit against Nk, one fit per query length: the plot's facets are those of the
    tables (its fits have no kv_len of their own), and a store where Nk takes two values while N
    takes more is drawn, not lost to a KeyError."""
    drawn = []
    real = plots.sns.catplot

    def spy(*args, data, **kw):
        drawn.append(data)
        return real(*args, data=data, **kw)

    monkeypatch.setattr(plots.sns, "catplot", spy)
    decode = [kernel(q, nk / 1e3 * q, kv_len=nk, causal=True) for q in (1, 16) for nk in (1024, 4096, 16384)]
    df = store.select(store.to_frame(decode))
    assert plots.plot_scaling(df, tmp_path) is not None
    assert sorted(drawn[-1]["_row"].unique()) == ["cpu · float32 · seq_len=1", "cpu · float32 · seq_len=16"]
    two_nk = [kernel(n, n / 100, kv_len=nk) for n in (256, 512, 1024) for nk in (2048, 4096)]
    df = store.select(store.to_frame(two_nk))
    assert plots.plot_scaling(df, tmp_path) is not None


def model(threads: int, decode_ms: float, hour: int, prefill_len: int = 64) -> dict:
    """An ok model-job record of sdpa on a small Llama at ``threads`` threads."""
    m = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "batch": 1, "prefill_len": prefill_len}
    cfg = {"variant": {"_target_": "variants.sdpa.SDPAAttention"}, "model": m, "seq_len": prefill_len}
    cfg.update(device="cpu", dtype="float32", threads=threads, seed=0)
    figures = {
        "decode_ms_per_token": decode_ms,
        "prefill_ms": 10 * decode_ms,
        "decode_ms_steps": [decode_ms] * 3,
    }
    figures.update(kv_bytes_kept=prefill_len * 1024, kv_bytes_read_per_step=prefill_len * 1024)
    return {
        "variant_name": "sdpa",
        "kind": "model",
        "status": "ok",
        "config": cfg,
        "config_hash": config_hash(cfg),
        "figures": figures,
        "env": {"host": "vm"},
        "started_at": f"2026-11-23T{hour:02d}:00:00+00:00",
        "_path": f"m{threads}-{prefill_len}-{hour}.json",
    }


def test_model_jobs_at_other_thread_counts_are_both_shown(tmp_path, monkeypatch):
    df = store.select(store.to_frame([model(2, 7.0, 9), model(1, 14.0, 10)]))
    sec = model_table(df)
    titles = [t for t, _ in sec.parts]
    assert len(titles) == 2 and {"threads=1", "threads=2"} == {t.split(" · ")[-1] for t in titles}
    cells = sorted(str(tab.iloc[0]["ms / decoded token"]) for _, tab in sec.parts)
    assert [c[:2] for c in cells] == ["14", "7."]
    # the context plot: a line per thread count, not one line through both
    lines = [
        model(t, ms * n / 64, 9 + i, prefill_len=n)
        for t, ms in ((1, 14.0), (2, 7.0))
        for i, n in enumerate((64, 128))
    ]
    rows = store.select(store.to_frame(lines))
    from matplotlib.axes import Axes

    labels, real = [], Axes.errorbar
    monkeypatch.setattr(
        Axes, "errorbar", lambda ax, *a, **kw: labels.append(kw["label"]) or real(ax, *a, **kw)
    )
    assert plot_context(rows, tmp_path / "context.png") is not None
    assert sorted(labels) == ["sdpa · Llama · threads=1", "sdpa · Llama · threads=2"]


def task(
    variant: str,
    device: str,
    accuracy: float,
    seed: int = 0,
    threads: int = 1,
    step_ms: float = 10.0,
    settings: dict | None = None,
    seq_len: int = 128,
) -> dict:
    """An ok task record of ``variant`` on ``device`` with its test accuracy: the copy task at N=128
    with its step's peak memory measured, or ``settings`` (a recall model, say) at ``seq_len``."""
    target = {"sdpa": "variants.sdpa.SDPAAttention", "linear": "variants.linear.LinearAttention"}[variant]
    t = settings or {"name": "copy", "causal": False, "peak_memory": True}
    cfg = {"variant": {"_target_": target}, "task": t, "seq_len": seq_len, "seed": seed}
    cfg.update(device=device, dtype="float32", threads=threads)
    figures = {"test_accuracy": accuracy, "step_ms_median": step_ms, "step_peak_mib": step_ms}
    return {
        "variant_name": variant,
        "kind": "task",
        "status": "ok",
        "config": cfg,
        "config_hash": config_hash(cfg),
        "figures": {**figures, "state_bytes": 4096, "step_ms": step_ms},
        "env": {"host": "vm"},
        "started_at": f"2026-11-23T1{seed}:00:{threads}0+00:00",
        "_path": f"t-{config_hash(cfg)}.json",
    }


def test_a_task_run_on_another_device_is_its_own_row_with_its_own_kernel_speed():
    recs = [task("sdpa", "cpu", 1.0, seed) for seed in (0, 1)]
    recs += [task("sdpa", "cuda", 0.5, seed) for seed in (0, 1)]
    # kernel timings beside it: float32 on each device, and a bfloat16 one the tasks did not run
    recs += [kernel(128, 4.0, variant="sdpa"), kernel(128, 40.0, variant="sdpa", dtype="bfloat16")]
    recs += [kernel(128, 1.0, variant="sdpa", device="cuda")]
    table = task_table(store.to_frame(recs)).set_index("variant")
    assert table.loc["sdpa · device=cpu", "acc_mean"] == pytest.approx(1.0)
    assert table.loc["sdpa · device=cuda", "acc_mean"] == pytest.approx(0.5)
    assert table.loc["sdpa · device=cpu", "fwd_ms"] == pytest.approx(4.0)  # not the median with bf16's
    assert table.loc["sdpa · device=cuda", "fwd_ms"] == pytest.approx(1.0)


def test_the_kernel_speed_beside_a_task_is_one_call_shape_s_and_survives_an_unset_thread_count():
    """Kernel records of two shapes at the task's N were one median (4.24 ms, no call's time); records
    of an unset thread count (the default) left the columns blank."""
    recs = [task("sdpa", "cpu", 1.0, threads=None), kernel(128, 4.0, variant="sdpa", threads=None)]
    table = task_table(store.to_frame(recs))
    assert table["fwd_ms"].tolist() == [pytest.approx(4.0)]
    recs.append(kernel(128, 40.0, variant="sdpa", threads=None, heads=16))  # another call's time
    table = task_table(store.to_frame(recs))
    assert table["fwd_ms"].isna().all() and table["peak_mib"].isna().all()


def test_the_training_cost_table_compares_with_sdpa_run_at_the_same_thread_count():
    recs = [task("sdpa", "cpu", 1.0, step_ms=500.0), task("linear", "cpu", 1.0, step_ms=250.0)]
    recs += [
        task("sdpa", "cpu", 1.0, threads=2, step_ms=250.0),
        task("linear", "cpu", 1.0, threads=2, step_ms=125.0),
    ]
    t = efficiency_table(store.to_frame(recs)).set_index("variant")
    assert len(t) == 4
    assert t.loc["linear · threads=1", "speedup"] == pytest.approx(2.0)
    assert t.loc["linear · threads=2", "speedup"] == pytest.approx(2.0)
    assert t.loc["sdpa · threads=2", "steps_per_s"] == pytest.approx(4.0)


def test_a_pretrained_encoder_run_at_another_thread_count_is_its_own_table():
    from experiments.report.pretrained_section import fidelity_table

    def rec(threads: int, ms: float) -> dict:
        cfg = {"variant": {"_target_": "variants.sdpa.SDPAAttention"}, "pretrained": {"name": "minilm"}}
        cfg.update(seq_len=128, device="cpu", dtype="float32", threads=threads, seed=0)
        figures = {"cosine_mean": 1.0, "corpus_sha256": "c" * 64, "batch_ms_median": ms, "batch_ms_iqr": 0.1}
        return {
            "config": cfg,
            "status": "ok",
            "kind": "pretrained",
            "config_hash": config_hash(cfg),
            "_path": f"p{threads}",
            "started_at": f"2026-01-01T00:00:0{threads}+00:00",
            "env": {"host": "h"},
            "figures": figures,
        }

    tables = dict(fidelity_table(store.to_frame([rec(1, 20.0), rec(2, 10.0)])))
    assert sorted(tables) == [
        "cpu · float32 · minilm · threads=1 · N=128",
        "cpu · float32 · minilm · threads=2 · N=128",
    ]
    assert tables["cpu · float32 · minilm · threads=2 · N=128"].iloc[0]["ms / batch (IQR)"].startswith("10")


def test_the_recall_frontier_keeps_configurations_trained_differently_apart():
    """Recall models that differ in a training setting (steps) are two points of the frontier, each
    with its own seeds, not one point with their seeds pooled."""
    from experiments.report.frontier_section import frontier_table

    def rec(variant: str, steps: int, seed: int, accuracy: float) -> dict:
        t = {"name": "recall", "num_pairs": 8, "d_model": 64, "heads": 4, "steps": steps}
        return task(variant, "cpu", accuracy, seed, settings=t, seq_len=64)

    recs = [rec("sdpa", steps, seed, acc) for steps, acc in ((100, 0.2), (1000, 0.9)) for seed in (0, 1)]
    recs += [rec("linear", 1000, 0, 0.5)]
    table = frontier_table(store.to_frame(recs)).set_index("variant")
    assert table.loc["sdpa · steps=100", "acc_mean"] == pytest.approx(0.2)
    assert table.loc["sdpa · steps=1000", "acc_mean"] == pytest.approx(0.9)
    assert table.loc["sdpa · steps=100", "seeds"] == 2
