"""Decode, grouped-head, scale and bias jobs, and model jobs, end to end through the job runner:
their configs are checked, their records carry the right byte counts, and the report puts them on
the right axis. Oracles: analytic byte counts, the float64 reference with the same bias, and what a
config means by construction."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from experiments.measure.kernel import measure
from experiments.records.records import config_hash
from experiments.report.format import num
from experiments.report.grouping import group_keys, length_axis
from experiments.report.kernel_tables import bandwidth_table
from experiments.report.model_section import model_table
from experiments.sweep.schema import BenchConfig, validate

from .test_runner import job_cfg, job_spec


def _conf(**over) -> BenchConfig:
    cfg = job_cfg(**over)
    cfg.pop("hydra", None)
    return BenchConfig(**{k: v for k, v in cfg.items() if k in BenchConfig.__dataclass_fields__})


@pytest.mark.parametrize(
    "over,msg",
    [
        (dict(heads=8, kv_heads=3), "kv_heads must divide heads"),
        (dict(bias="t5"), "bias must be one of"),
        (dict(causal=True, seq_len=64, kv_len=32), "kv_len >= seq_len"),
        (dict(scale=-0.5), "scale must be a finite number > 0"),
        (dict(scale=float("nan")), "scale must be a finite number > 0"),
        (dict(records_dir=""), "records_dir is empty"),
    ],
)
def test_bad_decode_settings_are_one_line_errors(over, msg):
    with pytest.raises(ValueError, match=msg):
        validate(_conf(**over))


def test_a_causal_decode_config_is_valid():
    validate(_conf(causal=True, seq_len=1, kv_len=4096, heads=8, kv_heads=2, bias="alibi"))


def test_configs_without_the_new_fields_hash_as_before():
    cfg = job_cfg(variant="naive")
    old = {k: v for k, v in cfg.items() if k not in ("kv_heads", "scale", "bias", "model")}
    assert config_hash(cfg) == config_hash(old)  # committed records are still found on resume
    assert config_hash({**cfg, "kv_heads": 2}) != config_hash(cfg)


@pytest.mark.parametrize(
    "variant,bias", [("naive", "alibi"), ("sdpa", "alibi"), ("chunked", "alibi"), ("local_window", None)]
)
def test_decode_job_with_grouped_heads_and_alibi_is_checked_and_counts_its_bytes(variant, bias):
    b, h, hkv, nq, nk, d = 2, 8, 2, 1, 96, 16
    spec = job_spec(
        variant=variant,
        batch=b,
        heads=h,
        kv_heads=hkv,
        seq_len=nq,
        kv_len=nk,
        head_dim=d,
        causal=True,
        min_run_time=0.02,
        **({"bias": bias} if bias else {}),
    )
    res = measure(spec)
    assert res["status"] == "ok", res
    f = res["figures"]
    assert f["valid"] is True and f["out_rel_err"] < 1e-5  # the oracle applies the same ALiBi bias
    # q read + output written, the whole K/V cache (Hkv heads) read, the (1, H, Nq, Nk) bias read; fp32
    want = (b * h * nq * 2 * d + b * hkv * nk * 2 * d) * 4 + (h * nq * nk * 4 if bias else 0)
    assert f["min_bytes"] == want
    assert f["bytes_per_s"] == pytest.approx(want / f["fwd_median_s"])


def _decode_frame() -> pd.DataFrame:
    rows = []
    for nq in (1, 16):
        for nk in (1024, 4096, 16384):
            rows.append(
                dict(
                    variant="sdpa",
                    status="ok",
                    valid=True,
                    device="cpu",
                    dtype="float32",
                    mode="fwd",
                    seq_len=nq,
                    kv_len=nk,
                    heads=32,
                    kv_heads=4,
                    fwd_median_s=1e-3,
                    bytes_per_s=5e9 * nq,
                    roofline_copy_bytes_per_s=20e9,
                    min_bytes=5e6,
                    started_at="2026-01-01",
                    config_hash="x",
                    path="p",
                    reason=None,
                )
            )
    return pd.DataFrame(rows)


def test_decode_tables_put_the_key_length_on_the_axis_and_split_by_query_length():
    df = _decode_frame()
    assert length_axis(df) == "kv_len"
    assert "seq_len" in group_keys(df) and "kv_len" not in group_keys(df)
    sec = bandwidth_table(df)
    assert [title.split(": ")[0] for title, _ in sec.parts] == [
        "cpu · float32 · fwd · seq_len=1",
        "cpu · float32 · fwd · seq_len=16",
    ]
    tab = sec.parts[0][1]
    assert list(tab.columns) == ["Nk=1024", "Nk=4096", "Nk=16384"]
    assert tab.loc["sdpa", "Nk=4096"] == "5.00 (25%)"  # 5 GB/s of a 20 GB/s copy
    assert sec.data["pct_of_copy"].tolist() == pytest.approx([25.0] * 3 + [400.0] * 3)


def test_decode_bandwidth_is_shown_against_the_read_ceiling_and_the_tighter_roofline():
    # one query against 4096 keys: 5e6 bytes in 1 ms; 16 queries: the same bytes, 16x the FLOPs
    df = _decode_frame().assign(roofline_read_bytes_per_s=40e9, roofline_gemm_flops_per_s=100e9)
    df["flops"] = 4 * 32 * df["seq_len"] * df["kv_len"] * 128  # 4 FLOPs per (query head, key, dim)
    sec = bandwidth_table(df)
    assert sec.parts[0][1].loc["sdpa", "Nk=4096"] == "5.00 (25% / 12%)"  # of a 20 GB/s copy, 40 GB/s read
    data = sec.data.set_index(["seq_len", "kv_len"])
    one, many = data.loc[(1, 4096)], data.loc[(16, 4096)]
    # memory: 5e6 B / 40e9 B/s = 0.125 ms against 67 MFLOP / 100 GFLOP/s = 0.67 ms: compute binds
    assert one["bound"] == "compute" and one["roofline_ms"] == pytest.approx(
        4 * 32 * 4096 * 128 / 100e9 * 1e3
    )
    assert one["pct_of_roofline"] == pytest.approx(100 * one["roofline_ms"] / 1.0)
    assert many["bound"] == "compute" and many["roofline_ms"] == pytest.approx(16 * one["roofline_ms"])
    small = bandwidth_table(df.assign(flops=1e3)).data
    assert set(small["bound"]) == {"memory"}
    assert small["roofline_ms"].tolist() == pytest.approx([5e6 / 40e9 * 1e3] * 6)
    # the read ceiling's note names what it was: a sum in older records, the faster of two reads since
    assert "(a sum over a large tensor:" in sec.note
    newer = bandwidth_table(df.assign(roofline_read_op="gemv")).note
    assert "(the faster of a sum and a matrix-vector product" in newer and "a sum over" not in newer


def test_cuda_decode_bandwidth_is_also_shown_from_the_cuda_graph_replay():
    # eager: 5e6 bytes in 1 ms; the replay (launches removed) in 0.1 ms: 50 GB/s, 250% of a 20 GB/s copy
    df = _decode_frame().assign(fwd_graph_median_s=1e-4)
    sec = bandwidth_table(df)
    titles = [title for title, _ in sec.parts]
    assert len(titles) == 4 and "CUDA graph" in titles[1] and "CUDA graph" not in titles[0]
    assert sec.parts[1][1].loc["sdpa", "Nk=4096"] == "50.0 (250%)"
    assert sec.data["graph_gbytes_per_s"].tolist() == pytest.approx([50.0] * 6)
    assert "replayed as a CUDA graph" in sec.note
    # a store of both devices: the replay's table for the CUDA group alone
    mixed = bandwidth_table(pd.concat([_decode_frame(), df.assign(device="cuda")], ignore_index=True))
    graph_titles = [title for title, _ in mixed.parts if "CUDA graph" in title]
    assert len(mixed.parts) == 6 and graph_titles and all(t.startswith("cuda") for t in graph_titles)
    # without a replay (the CPU) neither the table, nor its columns, nor the sentence
    plain = bandwidth_table(_decode_frame())
    assert len(plain.parts) == 2 and "graph_gbytes_per_s" not in plain.data and "CUDA graph" not in plain.note


def test_a_cpu_decode_whose_bytes_fit_in_the_last_level_cache_says_so():
    """Its repeated calls read the cache, not memory: 43 GB/s was 123% of the read ceiling, unmarked.
    Here Nk scales the bytes (5 MB at 4096 keys) against a 4 MiB cache: only Nk=1024 fits."""
    df = _decode_frame().assign(cache_bytes=4 * 2**20)
    df["min_bytes"] = 5e6 * df["kv_len"] / 4096
    sec = bandwidth_table(df)
    tab = sec.parts[0][1]
    assert tab.loc["sdpa", "Nk=1024"].endswith(" in cache")
    assert not tab.loc["sdpa", "Nk=4096"].endswith("in cache")
    assert sec.data.set_index(["seq_len", "kv_len"])["in_cache"].to_dict() == {
        (nq, nk): nk == 1024 for nq in (1, 16) for nk in (1024, 4096, 16384)
    }
    assert "`in cache`: the bytes fit in the CPU's last-level cache (4 MiB)" in sec.note
    # a record without the figure (CUDA, or measured before it): no mark, no sentence
    plain = bandwidth_table(_decode_frame())
    assert not plain.data["in_cache"].any() and "in cache" not in plain.note


def test_the_last_level_cache_is_the_one_lscpu_names():
    import shutil
    import subprocess

    from experiments.measure.roofline import last_level_cache_bytes

    size = last_level_cache_bytes()
    if size is None or shutil.which("lscpu") is None:
        pytest.skip("this machine does not say its cache sizes (/sys/devices/system/cpu, lscpu)")
    out = subprocess.run(["lscpu", "-B", "--caches=ONE-SIZE"], capture_output=True, text=True, check=True)
    assert size == max(int(line) for line in out.stdout.split()[1:])  # one instance's bytes, per level


def test_self_attention_sweeps_keep_the_query_length_axis():
    df = _decode_frame().assign(kv_len=None)
    df = df[df["kv_len"].isna()].drop_duplicates("seq_len")
    assert length_axis(df) == "seq_len"
    assert bandwidth_table(df).parts == []  # no job has fewer queries than keys


def test_model_job_runs_a_transformers_model_and_reports_it():
    pytest.importorskip("transformers")
    spec = job_spec(
        variant="local_window",
        experiment="llama",
        **{"model.layers": 1, "model.hidden": 64, "model.prefill_len": 24, "model.new_tokens": 3},
    )
    res = measure(spec)
    assert res["status"] == "ok", res
    f = res["figures"]
    assert f["tokens_generated"] == 3 and f["kv_length_final"] == 24 + 2
    assert f["prefill_ms"] > 0 and f["decode_ms_per_token"] > 0
    row = dict(
        variant="local_window",
        status="ok",
        valid=None,
        device="cpu",
        dtype="float32",
        model=json.dumps(dict(spec.model)),
        started_at="t",
        config_hash="x",
        path="p",
        reason=None,
        **{k: f[k] for k in ("prefill_ms", "decode_ms_per_token", "peak_mib")},
    )
    sec = model_table(pd.DataFrame([row]))
    title, tab = sec.parts[0]
    assert "1 layers, width 64" in title and "prefill 24 tokens, then 3 decoded" in title
    assert tab.loc["local_window", "ms / decoded token"] == num(f["decode_ms_per_token"])


def test_a_decode_job_times_the_step_of_a_variant_with_a_state_and_records_what_it_keeps():
    # linear keeps H x D x (Dv + 1) numbers whatever the context; sdpa keeps the K/V cache
    b, h, hkv, d = 1, 4, 2, 16
    figs = {}
    for variant in ("linear", "sdpa"):
        for nk in (64, 256):
            spec = job_spec(
                variant=variant,
                seq_len=1,
                kv_len=nk,
                batch=b,
                heads=h,
                kv_heads=hkv,
                head_dim=d,
                causal=True,
                min_run_time=0.02,
            )
            res = measure(spec)
            assert res["status"] == "ok" and res["figures"]["valid"], res
            figs[variant, nk] = res["figures"]
    assert figs["linear", 64]["state_bytes"] == figs["linear", 256]["state_bytes"] == hkv * d * (d + 1) * 4
    assert figs["sdpa", 256]["state_bytes"] == 4 * figs["sdpa", 64]["state_bytes"] == hkv * 256 * 2 * d * 4
    assert figs["linear", 256]["step_median_s"] > 0 and "step_median_s" not in figs["sdpa", 256]
    # the report's decoding table: time per token from the step where there is one, and the state
    df = pd.DataFrame(
        [
            {
                "variant": v,
                "variant_name": v,
                "seq_len": 1,
                "kv_len": nk,
                "mode": "fwd",
                "causal": True,
                "device": "cpu",
                "dtype": "float32",
                "status": "ok",
                "valid": True,
                "reason": None,
                "config_hash": f"{v}{nk}",
                "started_at": "t",
                "path": "p",
                **f,
            }
            for (v, nk), f in figs.items()
        ]
    )
    from experiments.report.kernel_tables import decode_table

    sec = decode_table(df)
    lin = sec.data[sec.data["variant"] == "linear"].sort_values("kv_len")
    assert list(lin["s_per_token"]) == [figs["linear", nk]["step_median_s"] for nk in (64, 256)]
    assert "MiB" in sec.parts[0][1].to_string()
    assert "graph" not in sec.parts[0][0] and "graph_s_per_token" not in sec.data  # the CPU: no replay
    # on CUDA the forward over the cache has a CUDA-graph replay: shown beside the eager time; a state
    # variant's step has none, and keeps its step time alone
    graphed = decode_table(df.assign(fwd_graph_median_s=2e-5))
    assert "CUDA graph" in graphed.parts[0][0] and "replayed as a CUDA graph" in graphed.note
    per = graphed.data.set_index(["variant", "kv_len"])["graph_s_per_token"]
    assert per["sdpa", 256] == pytest.approx(2e-5) and np.isnan(per["linear", 256])
    assert ", graph 0.02 (" in graphed.parts[0][1].loc["sdpa", "Nk=256"]


def test_a_decoding_store_gets_the_decode_plots_and_others_do_not(tmp_path):
    from pathlib import Path

    from experiments.records import store
    from experiments.report import plots

    root = Path(__file__).resolve().parents[1] / "results" / "cpu"
    dec = store.select(store.load([root / "decode_state" / "records"], verbose=False))
    names = {p.name for p in plots.write_all(dec, tmp_path / "dec")}
    assert {"decode_vs_nk.png", "state_vs_nk.png"} <= names
    quick = store.select(store.load([root / "quick" / "records"], verbose=False))
    assert not {"decode_vs_nk.png", "state_vs_nk.png"} & {
        p.name for p in plots.write_all(quick, tmp_path / "q")
    }


def test_a_gradient_oracle_too_large_for_the_budget_is_skipped_and_said(monkeypatch):
    # additive's float64 reference scores hold `hidden` values per pair, 3x with their graph: with a
    # budget of 16 values per pair at this shape, hidden=4 is checked and hidden=64 is skipped (in one
    # call, and in blocks of the fewest rows), and the record says so
    from experiments.measure import grad_budget

    monkeypatch.setattr(grad_budget, "GRAD_ORACLE_BYTES", 2 * 64 * 64 * 8 * 16)
    small = job_spec(variant="additive", mode="fwd_bwd", seq_len=64, heads=2, head_dim=16, min_run_time=0.02)
    big = job_spec(variant="additive", mode="fwd_bwd", seq_len=64, heads=2, head_dim=16, min_run_time=0.02)
    small.variant["hidden"], big.variant["hidden"] = 4, 64
    f_small, f_big = measure(small)["figures"], measure(big)["figures"]
    assert "grad_rel_err" in f_small and "grad_check_skipped" not in f_small
    said = "float64 oracle 12 MiB > 1 MiB at once, and 3 MiB in blocks of 16 rows, the fewest"
    assert "grad_rel_err" not in f_big and f_big["grad_check_skipped"] == said


def _self_attention_rows(ns: tuple[int, ...]) -> pd.DataFrame:
    """sdpa of the same shape as :func:`_decode_frame`'s at each N of ``ns`` (kv_len null: self-
    attention), its time quadratic and its memory linear in N."""
    return pd.DataFrame(
        [
            {
                **_decode_frame().iloc[0].to_dict(),
                "seq_len": n,
                "kv_len": None,
                "fwd_median_s": 1e-3 * (n / 1024) ** 2,
                "fwd_q1_s": 0.9e-3 * (n / 1024) ** 2,
                "fwd_q3_s": 1.1e-3 * (n / 1024) ** 2,
                "peak_mib": n / 64,
                "gflops_per_s": 10.0,
            }
            for n in ns
        ]
    )


@pytest.mark.parametrize("ns", [(16, 1024), (1024, 2048, 4096)])
def test_a_store_of_decode_and_self_attention_sweeps_keeps_each_sweep_on_its_own_length_axis(ns, tmp_path):
    """The default records folder collects both. One axis for the whole store: the key length (as many
    values as the query length's, with N = 16 and 1024) left the self-attention rows without a length
    (`n/a (0 lengths)` in the scaling table, the plots failing on int(NA)) and split their tables one
    per N; the query length (outnumbered by 1024, 2048, 4096) put Nq on the decode sweep's axis."""
    from experiments.report import plots
    from experiments.report.kernel_tables import scaling_fits, scaling_table, speed_table

    dec = _decode_frame().assign(
        fwd_q1_s=0.9e-3, fwd_q3_s=1.1e-3, peak_mib=lambda d: d["kv_len"] / 1024, gflops_per_s=10.0
    )
    df = pd.concat([dec, _self_attention_rows(ns)], ignore_index=True)
    fits = scaling_fits(df)
    own = fits[fits["seq_len"].isna()].iloc[0]  # the self-attention sweep: N is its axis, not a key
    assert own["time_exponent"] == pytest.approx(2.0) and own["memory_exponent"] == pytest.approx(1.0)
    assert own["time_points"] == len(ns) and (own["time_n_min"], own["time_n_max"]) == (ns[0], ns[-1])
    assert sorted(fits["seq_len"].dropna()) == [1, 16]  # the decode sweeps: one fit per query length
    assert set(fits.loc[fits["seq_len"].notna(), "time_points"]) == {3}
    speed = {title.split(": ")[0]: tab for title, tab in speed_table(df).parts if "median time" in title}
    assert list(speed) == [
        "cpu · float32 · fwd · seq_len=1",
        "cpu · float32 · fwd · seq_len=16",
        "cpu · float32 · fwd",  # one table across its lengths
    ]
    assert list(speed["cpu · float32 · fwd"].columns) == [f"N={n}" for n in ns]
    assert list(speed["cpu · float32 · fwd · seq_len=1"].columns) == ["Nk=1024", "Nk=4096", "Nk=16384"]
    assert [title.split(": ")[0] for title, _ in scaling_table(df).parts] == list(speed)
    for plot in (plots.plot_time, plots.plot_memory, plots.plot_gflops, plots.plot_scaling):
        assert plot(df, tmp_path).is_file(), plot.__name__


def _stepped_frame() -> pd.DataFrame:
    """:func:`_decode_frame` as a decode sweep of sdpa (through its forward) and linear (through its
    step), causal, with the state each keeps; every figure stable and on its 2 threads' cores."""
    sdpa = _decode_frame().assign(fwd_cpu_per_wall=2.0, fwd_unstable=False)
    linear = sdpa.assign(variant="linear", step_median_s=2e-4, step_cpu_per_wall=2.0, step_unstable=False)
    df = pd.concat([sdpa, linear], ignore_index=True)
    return df.assign(causal=True, state_bytes=2**20, threads=2, machine_slowdown=1.0, fwd_iqr_s=1e-5)


def test_the_decoding_table_names_the_records_from_before_state_bytes():
    """The decode store with flex measured again: the decoding table showed flex alone and did not
    say that the other variants' records, written before `state_bytes`, were left out."""
    from experiments.report.kernel_tables import decode_table

    df = _stepped_frame()
    older = df["variant"] == "sdpa"
    df.loc[older, "state_bytes"] = np.nan  # recorded before the field
    sec = decode_table(df)
    shown = {title.split(": ")[0]: tab for title, tab in sec.parts}["cpu · float32 · fwd · seq_len=1"]
    assert list(shown.index) == ["linear"]
    n = int((older & (df["seq_len"] < df["kv_len"])).sum())
    said = f"Not shown: {n} decoding record(s) of sdpa, written before records carried `state_bytes`"
    assert said in sec.note
    assert "Not shown" not in decode_table(_stepped_frame()).note


def test_the_decoding_plots_name_the_records_from_before_state_bytes(monkeypatch, tmp_path):
    """decode_vs_nk.png and state_vs_nk.png drew flex alone from the decode store and did not say why."""
    from experiments.report import plots

    titles: list[str] = []

    def keep(fig, path, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        titles.append(fig._suptitle.get_text())
        return path

    monkeypatch.setattr(plots, "_save", keep)
    df = _stepped_frame()
    for plot in (plots.plot_decode, plots.plot_state):
        plot(df, tmp_path)  # every record carries state_bytes: nothing left out
    df.loc[df["variant"] == "sdpa", "state_bytes"] = np.nan
    n = int(((df["variant"] == "sdpa") & (df["seq_len"] < df["kv_len"])).sum())
    for plot in (plots.plot_decode, plots.plot_state):
        plot(df, tmp_path)
    assert ["Not shown" in t for t in titles] == [False, False, True, True]
    said = f"Not shown: {n} decoding record(s) of sdpa, written before records carried state_bytes"
    assert all(said in " ".join(t.split()) for t in titles[2:]), titles


def test_decode_and_bandwidth_cells_carry_the_marks_of_the_figure_they_show(monkeypatch, tmp_path):
    """The speed table marked `~`, `*` and `unstable`; the decoding and bandwidth tables showed the same
    records plain, and a step's own flags (its core share, its stability) were never read."""
    from experiments.report import plots
    from experiments.report.kernel_tables import decode_table, speed_table

    df = _stepped_frame()
    at = {
        (v, nq, nk): i
        for i, (v, nq, nk) in enumerate(zip(df["variant"], df["seq_len"], df["kv_len"], strict=True))
    }
    df.loc[at["sdpa", 1, 1024], "machine_slowdown"] = 1.5  # its canary ran slow: ~
    df.loc[at["sdpa", 1, 4096], "fwd_unstable"] = True
    df.loc[at["sdpa", 1, 16384], "fwd_cpu_per_wall"] = 1.5  # off its cores: *
    df.loc[at["linear", 1, 1024], "step_cpu_per_wall"] = 1.72  # the step off its cores: *
    df.loc[at["linear", 1, 4096], "step_unstable"] = True
    df.loc[at["linear", 1, 16384], ["fwd_cpu_per_wall", "fwd_unstable"]] = [1.0, True]  # the forward only
    dec = {title.split(": ")[0]: tab for title, tab in decode_table(df).parts}[
        "cpu · float32 · fwd · seq_len=1"
    ]
    assert dec.loc["sdpa"].tolist() == [
        "1.00 ms ~ (1.00 MiB)",
        "1.00 ms unstable (1.00 MiB)",
        "1.00 ms * (1.00 MiB)",
    ]
    assert dec.loc["linear"].tolist() == [
        "0.2 ms * (1.00 MiB)",
        "0.2 ms unstable (1.00 MiB)",
        "0.2 ms (1.00 MiB)",  # timed through its step: the forward's flags are not its
    ]
    speed = speed_table(df).parts[0][1]
    assert speed.loc["sdpa"].str.endswith(("~", "unstable", "*")).all()  # the same marks
    bw = {title.split(": ")[0]: tab for title, tab in bandwidth_table(df).parts}
    row = bw["cpu · float32 · fwd · seq_len=1"].loc["sdpa"].tolist()
    assert row == ["5.00 (25%) ~", "5.00 (25%) unstable", "5.00 (25%) *"]
    assert bw["cpu · float32 · fwd · seq_len=1"].loc["linear", "Nk=16384"] == "5.00 (25%) * unstable"
    # the decode plot rings a step's time where the step was * or ~, not where the forward was
    drawn = {}
    monkeypatch.setattr(plots, "_plot_vs_n", lambda data, y, *args, **kw: drawn.setdefault(y, data))
    plots.plot_decode(df, tmp_path)
    flagged = drawn["ms_per_token"].set_index(["variant", "seq_len", "kv_len"])["flagged"]
    assert flagged["linear", 1, 1024] and not flagged["linear", 1, 16384]
    assert flagged["sdpa", 1, 1024] and flagged["sdpa", 1, 16384] and not flagged["sdpa", 1, 4096]


def _frame_of(results: dict) -> pd.DataFrame:
    """A report frame of ``{(variant, nq, nk): measure() result}``, as the store flattens records."""
    from experiments.records import store

    recs = []
    for i, ((v, nq, nk), res) in enumerate(results.items()):
        cfg = job_cfg(variant=v, seq_len=nq, kv_len=nk, causal=True)
        cfg.pop("hydra", None)
        recs.append(
            {
                **res,
                "config": cfg,
                "config_hash": f"h{i}",
                "_path": f"p{i}",
                "started_at": f"2026-01-01T00:0{i}",
            }
        )
    return store.to_frame(recs)


def test_a_state_variant_decoding_over_padding_is_shown_as_its_forward_not_its_step():
    """With padding the newest keys are the padded ones, so no step is timed: the decoding table
    showed the forward over the whole context under "timed through its decoding step" (linear 4.5 ms
    a token where its step takes under 1), unmarked."""
    from experiments.report.kernel_tables import decode_table

    shape = dict(batch=1, heads=4, kv_heads=2, head_dim=16, causal=True, min_run_time=0.02, seq_len=1)
    res = measure(job_spec(variant="linear", kv_len=256, padding=0.1, **shape))
    assert res["status"] == "ok", res
    assert "step_median_s" not in res["figures"] and "padding=0.1" in res["figures"]["step_skipped"]
    plain = measure(job_spec(variant="linear", kv_len=256, **shape))
    assert "step_skipped" not in plain["figures"] and plain["figures"]["step_median_s"] > 0
    df = _frame_of({("linear", 1, 256): res})
    sec = decode_table(df)
    (cell,) = sec.parts[0][1].loc["linear"].tolist()
    assert " forward, no step" in cell and "`forward, no step`" in sec.note


def test_a_variant_whose_cells_ran_different_paths_has_each_cell_tagged():
    """chunked decodes one query per head on the C kernel and 16 (128 rows per K/V head) on its
    PyTorch path: one row of the bandwidth table mixed the two, and nothing said which was which."""
    from experiments.report.kernel_tables import bandwidth_table, speed_table

    shape = dict(batch=1, heads=32, kv_heads=4, head_dim=32, causal=True, min_run_time=0.02, kv_len=512)
    results = {}
    for v, nq in (("chunked", 1), ("chunked", 16), ("sdpa", 1), ("sdpa", 16)):
        results[v, nq, 512] = measure(job_spec(variant=v, seq_len=nq, **shape))
        assert results[v, nq, 512]["status"] == "ok", results[v, nq, 512]
    ran = {nq: results["chunked", nq, 512]["variant"]["decode_ran"] for nq in (1, 16)}
    if ran[1] != "kernel":
        pytest.skip(f"the C decode kernel did not run here: {results['chunked', 1, 512]['variant']}")
    assert ran[16] == "torch"
    df = _frame_of(results)
    assert df.set_index("seq_len").loc[16].query("variant == 'chunked'")["decode_ran"].item() == "torch"
    # one table row holds both query lengths where the length axis is N; each chunked cell is tagged
    sec = speed_table(df)
    text = "\n".join(tab.to_string() for _, tab in sec.parts)
    assert "[decode=kernel]" in text and "decode=torch]" in text
    assert all("[" not in c for _, tab in sec.parts if "sdpa" in tab.index for c in tab.loc["sdpa"])
    assert bandwidth_table(df).parts  # the bandwidth table still draws (its rows split by query length)


@pytest.mark.parametrize("variant", ["linear", "performer", "retention", "window_linear", "gla"])
def test_a_decode_job_checks_its_step_against_the_oracle(variant):
    """The step is a path of its own (prefill, then the new tokens onto the state): its output was timed
    but never compared with anything at the record's shape. It now gets the forward's oracle rows."""
    shape = dict(batch=1, heads=4, kv_heads=2, head_dim=16, causal=True, min_run_time=0.02, kv_len=256)
    for nq in (1, 3):
        f = measure(job_spec(variant=variant, seq_len=nq, **shape))["figures"]
        assert f["valid"] is True and f["step_median_s"] > 0, f
        assert f["step_rel_err"] < 1e-4 and f["step_row_rel_err"] < 1e-4, f


def test_a_step_that_loses_the_prefilled_context_marks_the_figures_invalid():
    shape = dict(batch=1, heads=4, kv_heads=2, head_dim=16, causal=True, min_run_time=0.02, kv_len=256)
    res = measure(job_spec("tests.faulty.ContextLostStepLinear", variant="linear", seq_len=1, **shape))
    f = res["figures"]
    assert f["out_rel_err"] < 1e-4  # the forward over the cache is right
    assert f["step_rel_err"] > 0.1 and f["valid"] is False and "invalid" in res["reason"]


def test_a_decode_job_over_packed_documents_times_no_step():
    """The step's state was prefilled over every earlier document's keys, which the forward (and the
    oracle) keep apart: a step that answers other queries than the record's was timed as its decode."""
    shape = dict(batch=1, heads=4, kv_heads=2, head_dim=16, causal=True, min_run_time=0.02, kv_len=256)
    res = measure(job_spec(variant="retention", seq_len=2, documents=2, **shape))
    f = res["figures"]
    assert res["status"] == "ok" and f["valid"] is True, res
    assert "step_median_s" not in f and "documents=2" in f["step_skipped"]


def test_the_accuracy_table_shows_the_decoding_steps_error():
    from experiments.report.kernel_tables import accuracy_table

    shape = dict(batch=1, heads=4, kv_heads=2, head_dim=16, causal=True, min_run_time=0.02, seq_len=1)
    results = {
        ("linear", 1, 256): measure(job_spec(variant="linear", kv_len=256, **shape)),
        ("sdpa", 1, 256): measure(job_spec(variant="sdpa", kv_len=256, **shape)),
    }
    sec = accuracy_table(_frame_of(results))
    steps = [tab for title, tab in sec.parts if "decoding step" in title]
    assert len(steps) == 1
    step_err = results["linear", 1, 256]["figures"]["step_rel_err"]
    assert step_err in set(sec.data["step_rel_err"].dropna())
    assert "n/a" in steps[0].to_string()  # sdpa has no step
