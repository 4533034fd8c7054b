"""The report sections never pool records of different models or lengths into one row, and never show
two rows that cannot be told apart: the training-cost table keeps task models apart (and compares
each with sdpa of the same model), the recall frontier keeps sequence lengths apart, the model table
names the vocabulary where it differs, the pretrained tables name the encoder settings that differ."""

from __future__ import annotations

import pytest

from experiments.records import store
from experiments.records.records import config_hash
from experiments.report.efficiency_section import efficiency_markdown, efficiency_table
from experiments.report.frontier_section import frontier_markdown, frontier_table, plot_frontier
from experiments.report.model_section import model_table
from experiments.report.pretrained_section import fidelity_table

TARGETS = {"sdpa": "variants.sdpa.SDPAAttention", "linear": "variants.linear.LinearAttention"}


def record(kind: str, variant: str, config: dict, figures: dict, seed: int = 0) -> dict:
    """An ok ``kind`` record of ``variant`` with ``config`` over the defaults (cpu, float32, one
    thread, seed ``seed``) and its ``figures``."""
    cfg = {"variant": {"_target_": TARGETS[variant]}, "device": "cpu", "dtype": "float32", "threads": 1}
    cfg.update(seed=seed, **config)
    return {
        "variant_name": variant,
        "kind": kind,
        "status": "ok",
        "config": cfg,
        "config_hash": config_hash(cfg),
        "figures": figures,
        "env": {"host": "vm"},
        "started_at": f"2026-11-23T10:00:0{seed}+00:00",
        "_path": f"{kind}-{config_hash(cfg)}.json",
    }


def test_the_training_cost_table_compares_each_task_model_with_its_own_sdpa():
    """Copy models of width 64 and 256: sdpa's steps were one median over both widths (1250 ms), so
    linear of width 64 showed 5x where sdpa of its own width is 2x slower."""

    def rec(variant: str, d_model: int, step_ms: float) -> dict:
        task = {"name": "copy", "causal": False, "peak_memory": True, "d_model": d_model}
        figures = {"test_accuracy": 0.5, "step_ms_median": step_ms, "step_peak_mib": step_ms / 10}
        return record("task", variant, {"task": task, "seq_len": 1024}, figures)

    recs = [rec("sdpa", 64, 500.0), rec("sdpa", 256, 2000.0), rec("linear", 64, 250.0)]
    table = efficiency_table(store.to_frame(recs))
    assert table.loc[table["variant"] == "linear", "speedup"].tolist() == [pytest.approx(2.0)]
    t = table.set_index(["variant", "task"])
    assert len(t) == 3
    assert t.loc[("linear", "copy(d_model=64)"), "speedup"] == pytest.approx(2.0)
    assert t.loc[("linear", "copy(d_model=64)"), "memory_ratio"] == pytest.approx(0.5)
    assert t.loc[("sdpa", "copy(d_model=256)"), "steps_per_s"] == pytest.approx(0.5)
    assert t.loc[("sdpa", "copy(d_model=256)"), "speedup"] == pytest.approx(1.0)
    md = efficiency_markdown(t.reset_index())
    assert "| task " in md and "copy(d_model=256)" in md and "(2x)" in md and "(5x)" not in md
    one = efficiency_markdown(efficiency_table(store.to_frame(recs[::2])))  # one model: no task column
    assert "| task " not in one and "copy" not in one


def recall(variant: str, n: int, seed: int, accuracy: float) -> dict:
    """A recall record of ``variant`` at N=``n``; sdpa's state (a K/V cache) grows with N."""
    task = {"name": "recall", "causal": True, "num_pairs": 8, "d_model": 32, "heads": 2}
    state = 256 * n if variant == "sdpa" else 4096
    figures = {"test_accuracy": accuracy, "state_bytes": state, "step_ms": 10.0, "infer_us_per_token": 2.0}
    return record("task", variant, {"task": task, "seq_len": n}, figures, seed)


def test_the_recall_frontier_keeps_each_sequence_length_apart(tmp_path, monkeypatch):
    """Runs at N=128 and N=512 were one row: the state a median of two lengths', the accuracy of one
    length (N=512's disappeared), and the plot joined the lengths in one line."""
    accs = {("sdpa", 128): 0.9, ("sdpa", 512): 0.3, ("linear", 128): 0.6, ("linear", 512): 0.1}
    recs = [recall(v, n, seed, a) for (v, n), a in accs.items() for seed in (0, 1)]
    table = frontier_table(store.to_frame(recs))
    md = frontier_markdown(table)
    assert len(md.splitlines()) == 2 + 4 + 2  # a row per variant and N, and a floor row per N
    assert len(table) == 4
    by = table.assign(variant=table["variant"].str.removesuffix(" (causal)")).set_index(["variant", "N"])
    for (v, n), a in accs.items():
        assert by.loc[(v, n), "acc_mean"] == pytest.approx(a)
        assert by.loc[(v, n), "seeds"] == 2
    assert by.loc[("sdpa", 512), "state_bytes"] == 256 * 512  # not the median of both lengths
    lines = [line for line in md.splitlines()[2:] if "floor" not in line]
    rows = {tuple(c.strip() for c in line.split("|")[1:4]) for line in lines}
    assert rows == {(f"{v} (causal)", "32 = 2 x 16", str(n)) for v, n in accs}
    floors = [line for line in md.splitlines()[2:] if "floor" in line]
    assert sorted(line.split("|")[3].strip() for line in floors) == ["128", "512"]  # one per N
    assert "| 30.0 ± 0.0 |" in md.replace("  ", " ")  # sdpa at N=512
    # the plot: a panel per N, each line through one length's points only
    from matplotlib.axes import Axes

    drawn, real = [], Axes.errorbar
    monkeypatch.setattr(
        Axes, "errorbar", lambda ax, x, *a, **kw: drawn.append((ax, list(x))) or real(ax, x, *a, **kw)
    )
    assert plot_frontier(table, tmp_path / "frontier.png") is not None
    assert len(drawn) == 4
    for ax, xs in drawn:
        n = int(ax.get_title().rsplit("N=", 1)[1])
        assert xs in ([256 * n / 1024], [4.0])


def llama(vocab: int, decode_ms: float, hour: int) -> dict:
    """A model-job record of sdpa on a small Llama with a vocabulary of ``vocab``."""
    m = {
        "layers": 2,
        "hidden": 64,
        "heads": 4,
        "kv_heads": 2,
        "batch": 1,
        "prefill_len": 64,
        "vocab": vocab,
        "new_tokens": 8,
    }
    figures = {
        "decode_ms_per_token": decode_ms,
        "prefill_ms": 10 * decode_ms,
        "decode_ms_steps": [decode_ms] * 3,
    }
    rec = record("model", "sdpa", {"model": m, "seq_len": 64}, figures)
    return {**rec, "started_at": f"2026-11-23T{hour:02d}:00:00+00:00"}


def test_models_differing_only_in_vocabulary_are_both_shown():
    """The newest record per row label hid the other vocabulary's model."""
    sec = model_table(store.select(store.to_frame([llama(1024, 7.0, 9), llama(2048, 9.0, 10)])))
    tables = {t.rsplit(" · ", 1)[-1]: tab for t, tab in sec.parts}
    assert sorted(tables) == ["vocab=1024", "vocab=2048"]
    assert str(tables["vocab=1024"].iloc[0]["ms / decoded token"]).startswith("7")
    assert str(tables["vocab=2048"].iloc[0]["ms / decoded token"]).startswith("9")
    one = model_table(store.select(store.to_frame([llama(1024, 7.0, 9)])))
    assert "vocab" not in one.parts[0][0]  # named only where it differs


def test_encoder_settings_differing_only_in_batch_are_told_apart():
    """Two sdpa rows in one table, one per batch size, with nothing to tell them apart."""

    def rec(batch: int, ms: float) -> dict:
        enc = {"name": "minilm", "batch": batch}
        figures = {"cosine_mean": 1.0, "corpus_sha256": "c" * 64, "batch_ms_median": ms, "batch_ms_iqr": 0.1}
        return record("pretrained", "sdpa", {"pretrained": enc, "seq_len": 128}, figures)

    tables = dict(fidelity_table(store.to_frame([rec(8, 10.0), rec(32, 40.0)])))
    assert sorted(tables) == [
        "cpu · float32 · minilm · batch=32 · N=128",
        "cpu · float32 · minilm · batch=8 · N=128",
    ]
    assert tables["cpu · float32 · minilm · batch=32 · N=128"].iloc[0]["ms / batch (IQR)"].startswith("40")
    assert list(dict(fidelity_table(store.to_frame([rec(8, 10.0)])))) == ["cpu · float32 · minilm · N=128"]


def test_a_model_only_report_claims_no_kernel_workload_and_no_check():
    """A store of model jobs said 'Workload in every table: ... head_dim=64, causal=False' (the kernel
    defaults its records carry, not its causal model's) and that every job passed its check."""
    from experiments.report.report import build_sections, header

    df = store.to_frame([llama(1024, 7.0, 9)])
    shown = store.select(df)
    assert "Workload in every table" not in header(df, shown, [], False)
    status = build_sections(df, shown, None)[-1]
    assert status.name == "status" and "a model job has none of its own" in status.note


def test_model_and_encoder_times_carry_the_machine_marks():
    """A model's prefill and decoding step, and an encoder's batch time, measured beside other work or
    while the machine ran slow were shown bare, where the kernel tables mark such a time `*` or `~`."""
    calm, busy, slow = llama(1024, 7.0, 9), llama(1024, 7.0, 10), llama(1024, 21.0, 11)
    calm["figures"]["canary_before_ms"] = busy["figures"]["canary_before_ms"] = 10.0
    busy["figures"]["concurrent_jobs"] = 1
    slow["figures"]["canary_before_ms"] = 13.0  # 1.3x the store's fastest canary
    for rec, label in ((busy, "busy"), (slow, "slow")):
        rec["config"]["model"]["new_tokens"] = {"busy": 16, "slow": 32}[label]
        rec["config_hash"] = config_hash(rec["config"])
    sec = model_table(store.select(store.to_frame([calm, busy, slow])))
    rows = sorted((tab.iloc[0]["prefill ms"], tab.iloc[0]["ms / decoded token"]) for _, tab in sec.parts)
    assert rows == [("210 ~", "21.0 ~"), ("70.0", "7.00"), ("70.0 *", "7.00 *")]

    def rec(batch: int, others: float) -> dict:
        enc = {"name": "minilm", "batch": batch}
        figures = {
            "cosine_mean": 1.0,
            "batch_ms_median": 10.0,
            "batch_ms_iqr": 0.1,
            "others_cpu_cores": others,
        }
        return record("pretrained", "sdpa", {"pretrained": enc, "seq_len": 128}, figures)

    tables = dict(fidelity_table(store.to_frame([rec(8, 0.0), rec(32, 1.5)])))
    times = {t.split(" · ")[3]: tab.iloc[0]["ms / batch (IQR)"] for t, tab in tables.items()}
    assert times == {"batch=8": "10.0 (0.1)", "batch=32": "10.0 (0.1) *"}
