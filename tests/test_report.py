"""The report: store, tables, scaling fit, plots and the CLI, checked against the records themselves.

One small real sweep (three ``run.py -m`` subprocesses in parallel, isolate=false, each into its own
subfolder of one records folder) feeds every test:
naive and a deliberately wrong variant (figures invalid), sdpa with a backend the CPU lacks
(unsupported), and local_window with two window sizes (knob labels). The local_window sweep runs with
report=true, so the end-of-multirun report is exercised too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib import image as mpimg

from experiments.records import store
from experiments.records.records import config_hash, write_record
from experiments.report import kernel_tables as T
from experiments.report import plots, report
from experiments.report.compare import baseline_table
from experiments.report.format import Section, num, render
from experiments.report.grouping import NO_RECORD

from .helpers import sweep_overrides

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["isolate=false", "min_run_time=0.02", "seq_len=64,128", "heads=2", "head_dim=16"]
SWEEPS = {  # each with its ceilings: the report's share of the GEMM rate is checked below
    "faulty": [
        "variant=naive", "variant._target_=variants.naive.NaiveAttention,tests.faulty.WrongAttention",
        "roofline=true",
    ],
    "sdpa": ["variant=sdpa", "variant.backend=math,cudnn", "roofline=true"],
    "window": ["variant=local_window", "variant.window=4,16", "report=true", "roofline=true"],
}  # fmt: skip
PNGS = [
    "time_vs_n.png",
    "memory_vs_n.png",
    "gflops_vs_n.png",
    "scaling_exponents.png",
    "accuracy_heatmap.png",
    "patterns.png",
    "attention_weights.png",
]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Records of the three sweeps in one folder; returns (tmp root, {sweep name: completed process})."""
    tmp = tmp_path_factory.mktemp("report")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = {}
    for name, args in SWEEPS.items():
        # one records folder per sweep: a folder takes one sweep at a time (its lock)
        cmd = [sys.executable, "run.py", "-m", *sweep_overrides(*args, *SMALL)]
        cmd += [f"records_dir={tmp / 'records' / name}"]
        cmd += [f"hydra.sweep.dir={tmp / name}"]
        if "report=true" not in args:
            cmd.append("report=false")
        procs[name] = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        if name == "faulty":  # its wrong variant fails the sweep, after every record and the report
            assert p.returncode == 1 and "2 job(s) computed a wrong result: INVALID" in stderr, stderr[-3000:]
        else:
            assert p.returncode == 0, stderr[-3000:]
        out[name] = (stdout, stderr)
    return tmp, out


def raw_records(folder: Path) -> list[dict]:
    """The records as plain JSON, read without the code under test."""
    return [json.loads(p.read_text()) for p in sorted(folder.rglob("*.json"))]


def cell(section: Section, heading_part: str, variant: str, n: int) -> str:
    tabs = [tab for heading, tab in section.parts if heading_part in heading]
    assert len(tabs) == 1, [h for h, _ in section.parts]
    return tabs[0].loc[variant, f"N={n}"]


def label(rec: dict) -> str:
    """The row label the report should use for a record of this sweep (an independent statement)."""
    v = rec["config"]["variant"]
    if v["_target_"].startswith("tests.faulty."):
        return v["_target_"].rsplit(".", 1)[-1]
    if rec["variant_name"] == "local_window":
        return f"local_window(window={v['window']})"
    if rec["variant_name"] == "sdpa":
        return f"sdpa(backend={v['backend']})"
    return rec["variant_name"]


def test_store_keeps_every_record_and_prints_counts(sweep, capsys):
    tmp, _ = sweep
    recs = raw_records(tmp / "records")
    assert len(recs) == 12
    df = store.load([tmp / "faulty", tmp / "sdpa", tmp / "window", tmp / "records"])
    assert len(df) == len(recs)  # sweep folders and the record folder name the same files: counted once
    printed = capsys.readouterr().out
    assert "loaded 12 record(s)" in printed
    assert "ok 8" in printed and "ok (invalid) 2" in printed and "unsupported 2" in printed
    assert sorted(df["path"].map(lambda p: Path(p).name)) == sorted(
        p.name for p in (tmp / "records").rglob("*.json")
    )
    # config fields and environment are columns
    assert {"device", "dtype", "mode", "seq_len", "heads", "env_host", "env_torch", "fwd_median_s"} <= set(
        df.columns
    )
    # parquet and csv round trip
    store.save(df, tmp / "saved")
    for name in ("store.parquet", "store.csv"):
        back = store.read_store(tmp / "saved" / name)
        assert len(back) == len(df) and set(back["status"]) == set(df["status"])


def test_a_share_above_the_sweeps_gemm_rate_is_explained(sweep):
    tmp, _ = sweep
    shown = store.select(store.load([tmp / "records"], verbose=False))
    above = "percentage above 100"
    measured = 100 * shown["gflops_per_s"] * 1e9 / shown["roofline_gemm_flops_per_s"]
    assert (above in T.speed_table(shown).note) == bool((measured > 100).any())
    # a ceiling measured in a slow moment: the kernels' own rate exceeds it, and the note says why
    slow = shown.assign(roofline_gemm_flops_per_s=shown["gflops_per_s"].min() * 1e9 / 2)
    assert above in T.speed_table(slow).note


def test_table_numbers_equal_record_figures(sweep):
    tmp, _ = sweep
    df = store.load([tmp / "records"], verbose=False)
    shown = store.select(df)
    speed, memory, acc = T.speed_table(shown), T.memory_table(shown), T.accuracy_table(shown)
    checked = 0
    for rec in raw_records(tmp / "records"):
        f, n = rec["figures"], rec["config"]["seq_len"]
        if rec["status"] != "ok" or not f["valid"]:
            continue
        ms = f["fwd_median_s"] * 1e3
        # the Markdown cell shows about 3 significant digits of the figure
        text = cell(speed, "median time", label(rec), n)
        assert float(text.split()[0]) == pytest.approx(ms, rel=5e-3)
        gflops, pct = cell(speed, "GFLOP/s", label(rec), n).split()
        assert float(gflops) == pytest.approx(f["gflops_per_s"], rel=5e-3)
        # beside it: the share of the GEMM rate the same sweep measured on this device and dtype
        gemm = rec["roofline"]["gemm_flops_per_s"]
        # (a share above 100% is marked "!": a GEMM rate measured beside another sweep is low)
        assert float(pct.strip("(%)!")) == pytest.approx(100 * f["gflops_per_s"] * 1e9 / gemm, rel=0.05)
        assert float(cell(memory, "peak MiB", label(rec), n)) == pytest.approx(f["peak_mib"], rel=5e-3)
        assert float(cell(acc, "vs oracle", label(rec), n)) == pytest.approx(f["out_rel_err"], rel=0.05)
        if "dev_full_rel_err" in f:
            assert float(cell(acc, "vs full", label(rec), n)) == pytest.approx(
                f["dev_full_rel_err"], rel=0.05
            )
        # the CSV keeps the exact numbers
        row = speed.data[(speed.data["variant"] == label(rec)) & (speed.data["seq_len"] == n)].iloc[0]
        assert row["time_ms"] == pytest.approx(ms, rel=1e-12)
        assert row["iqr_ms"] == pytest.approx(f["fwd_iqr_s"] * 1e3, rel=1e-12, abs=1e-15)
        checked += 1
    assert checked == 8


def test_invalid_figures_are_never_numbers(sweep):
    tmp, _ = sweep
    wrong = [
        r
        for r in raw_records(tmp / "records")
        if r["config"]["variant"]["_target_"].endswith("WrongAttention")
    ]
    assert wrong and all(r["status"] == "ok" and r["figures"]["valid"] is False for r in wrong)
    shown = store.select(store.load([tmp / "records"], verbose=False))
    for sec in (T.speed_table(shown), T.memory_table(shown)):
        for _, tab in sec.parts:
            if "WrongAttention" in tab.index:
                assert set(tab.loc["WrongAttention"]) <= {"invalid", NO_RECORD}
        rows = sec.data[sec.data["variant"] == "WrongAttention"]
        assert (
            len(rows) == 2
            and rows.drop(columns=["seq_len", "valid"]).select_dtypes("number").isna().all().all()
        )
    assert "WrongAttention" not in set(T.scaling_table(shown).data.get("variant", []))
    # the accuracy table shows the error that made it invalid, marked as a failure
    acc = T.accuracy_table(shown)
    assert all(
        cell(acc, "vs oracle", "WrongAttention", r["config"]["seq_len"]).startswith("FAIL") for r in wrong
    )
    # and the written Markdown agrees: no number in its speed or memory rows
    out = tmp / "md"
    report.report_paths([tmp / "records"], out, plots=False, echo=False)
    md = (out / "tables.md").read_text()
    speed_memory = md.split("## Accuracy")[0]
    for line in speed_memory.splitlines():
        if line.startswith("| WrongAttention"):
            cells = [c.strip() for c in line.strip("|").split("|")][1:]
            assert set(cells) <= {"invalid", NO_RECORD}, line


def test_status_table_names_every_status_and_reason(sweep):
    tmp, _ = sweep
    recs = raw_records(tmp / "records")
    df = store.load([tmp / "records"], verbose=False)
    sec = T.status_table(df, store.select(df))
    text = render(sec)
    for status in {r["status"] for r in recs}:
        assert f"| {status} " in text
    assert "ok (invalid)" in text
    for r in recs:
        if r["status"] != "ok":
            assert r["reason"] in text
    # an unsupported job is a word in the speed table, never a blank
    assert cell(T.speed_table(store.select(df)), "median time", "sdpa(backend=cudnn)", 64) == "unsupported"


def test_knob_settings_are_distinct_rows_only_when_they_differ(sweep):
    tmp, _ = sweep
    df = store.load([tmp / "records"], verbose=False)
    assert set(df["variant"]) == {
        "naive",
        "WrongAttention",
        "sdpa(backend=math)",
        "sdpa(backend=cudnn)",
        "local_window(window=4)",
        "local_window(window=16)",
    }
    one = [r for r in (tmp / "records").rglob("*.json") if '"window": 4' in r.read_text()]
    assert set(store.load(one, verbose=False)["variant"]) == {"local_window"}


def test_fit_exponent_recovers_known_powers():
    n = np.array([256, 512, 1024, 2048, 4096])
    k, r2 = T.fit_exponent(n, 3e-9 * n**2)
    assert k == pytest.approx(2.0, abs=1e-9) and r2 == pytest.approx(1.0, abs=1e-12)
    k, r2 = T.fit_exponent(n, 0.5 * n + 0.0)
    assert k == pytest.approx(1.0, abs=1e-9) and r2 == pytest.approx(1.0, abs=1e-12)
    rng = np.random.default_rng(0)
    k, r2 = T.fit_exponent(n, n**2 * np.exp(rng.normal(0, 0.05, n.size)))
    assert k == pytest.approx(2.0, abs=0.1) and 0.99 < r2 <= 1.0
    with pytest.raises(ValueError):
        T.fit_exponent([512, 512], [1.0, 2.0])


def test_scaling_table_fits_the_records(sweep):
    tmp, _ = sweep
    fits = T.scaling_fits(store.select(store.load([tmp / "records"], verbose=False))).set_index("variant")
    naive = {
        r["config"]["seq_len"]: r["figures"] for r in raw_records(tmp / "records") if label(r) == "naive"
    }
    expected = np.log(naive[128]["fwd_median_s"] / naive[64]["fwd_median_s"]) / np.log(2)
    assert fits.loc["naive", "time_exponent"] == pytest.approx(expected, rel=1e-9)
    assert fits.loc["naive", "time_n_min"] == 64 and fits.loc["naive", "time_n_max"] == 128
    # two lengths: a line through two points fits exactly, so no R², and no R² column in the table
    assert fits["time_r2"].isna().all() and fits["memory_r2"].isna().all()
    tabs = T.scaling_table(store.select(store.load([tmp / "records"], verbose=False))).parts
    assert tabs and all("time R²" not in tab.columns for _, tab in tabs)


def test_a_fit_over_three_lengths_has_its_r2(sweep, tmp_path):
    tmp, _ = sweep
    rec = next(
        r for r in raw_records(tmp / "records") if label(r) == "naive" and r["config"]["seq_len"] == 64
    )
    # log2 N = 0, 1, 2 against log2 t = 0, 2, 3: slope 1.5, residuals -1/6, 1/3, -1/6, so
    # R² = 1 - (1/6) / (14/3) = 27/28 (R² does not depend on the log's base)
    for n, ms in ((64, 1), (128, 4), (256, 8)):
        r = json.loads(json.dumps(rec))
        r["config"]["seq_len"], r["figures"]["fwd_median_s"] = n, ms / 1e3
        r["config_hash"] = config_hash(r["config"])  # one record per length (and file name)
        write_record(r, tmp_path)
    df = store.select(store.load([tmp_path], verbose=False))
    fit = T.scaling_fits(df).set_index("variant").loc["naive"]
    assert fit["time_exponent"] == pytest.approx(1.5, rel=1e-9)
    assert fit["time_r2"] == pytest.approx(27 / 28, rel=1e-9)
    (_, tab), *_ = T.scaling_table(df).parts
    assert tab.loc["naive", "time R²"] == f"{27 / 28:.3f}"


def test_same_config_twice_keeps_both_and_shows_the_newest(sweep, tmp_path):
    tmp, _ = sweep
    recs = raw_records(tmp / "records")
    for r in recs:
        write_record(r, tmp_path)
    old = next(r for r in recs if label(r) == "naive" and r["config"]["seq_len"] == 64)
    new = json.loads(json.dumps(old))
    later = datetime.fromisoformat(old["started_at"]) + timedelta(hours=1)
    new["started_at"] = new["finished_at"] = later.isoformat(timespec="seconds")
    new["figures"]["fwd_median_s"] = old["figures"]["fwd_median_s"] * 7
    write_record(new, tmp_path)
    df = store.load([tmp_path], verbose=False)
    assert len(df) == len(recs) + 1
    same = df[df["config_hash"] == old["config_hash"]]
    assert len(same) == 2 and same["newest"].sum() == 1
    text = cell(T.speed_table(store.select(df)), "median time", "naive", 64)
    assert float(text.split()[0]) == pytest.approx(new["figures"]["fwd_median_s"] * 1e3, rel=5e-3)
    # asked for every measurement: both, one row per run
    both = T.speed_table(store.select(df, all_measurements=True))
    times = both.data[(both.data["variant"] == "naive") & (both.data["seq_len"] == 64)]["time_ms"]
    expected = sorted(r["figures"]["fwd_median_s"] * 1e3 for r in (old, new))
    assert sorted(times) == pytest.approx(expected)
    tab = next(tab for heading, tab in both.parts if "median time" in heading)
    shown = sorted(float(c.split()[0]) for c in tab.loc["naive", "N=64"] if c != NO_RECORD)
    assert shown == pytest.approx(expected, rel=5e-3)


def test_cuda_graph_times_get_their_own_table_only_when_recorded(sweep, tmp_path):
    tmp, _ = sweep
    recs = raw_records(tmp / "records")
    plain = T.speed_table(store.select(store.load([tmp / "records"], verbose=False)))
    assert not [h for h, _ in plain.parts if "CUDA graph" in h]
    for r in recs:
        if label(r) == "naive" and r["config"]["seq_len"] == 64 and r["status"] == "ok":
            r["figures"]["fwd_graph_median_s"] = 0.00125  # as a CUDA job with cuda_graph=true records it
        write_record(r, tmp_path)
    sec = T.speed_table(store.select(store.load([tmp_path], verbose=False)))
    assert cell(sec, "CUDA graph", "naive", 64) == num(1.25)
    row = sec.data[(sec.data["variant"] == "naive") & (sec.data["seq_len"] == 64)]
    assert row["graph_ms"].tolist() == pytest.approx([1.25])


def test_a_baseline_with_no_records_is_an_error_before_any_report(sweep, tmp_path, capsys):
    from experiments.report.report import main

    tmp, _ = sweep
    out = tmp_path / "report"
    (tmp_path / "nope").mkdir()  # there, with nothing in it
    assert main([str(tmp / "records"), "--out", str(out), "--baseline", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: --baseline {tmp_path / 'nope'}: no records there to compare against"
    assert not out.exists()  # a report without the comparison asked for is not written


def test_a_baseline_that_shares_no_configuration_is_an_error_naming_what_differs(sweep, tmp_path, capsys):
    from experiments.report.report import main

    tmp, _ = sweep
    for r in raw_records(tmp / "records"):  # the same jobs, but every one of them causal
        r["config"]["causal"] = not r["config"].get("causal")
        write_record(r, tmp_path / "other")
    out = tmp_path / "report"
    assert main([str(tmp / "records"), "--out", str(out), "--baseline", str(tmp_path / "other")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no configuration was measured on both sides" in err and "causal" in err
    assert not out.exists()


def test_a_saved_store_compares_with_the_records_it_was_saved_from(sweep, tmp_path, capsys):
    # a CSV store holds 1.0 and NaN where records hold 1 and None: still the same configurations
    from experiments.report.report import main

    tmp, _ = sweep
    store.save(store.load([tmp / "records"], verbose=False), tmp_path / "saved")
    out = tmp_path / "report"
    assert (
        main([str(tmp / "records"), "--out", str(out), "--baseline", str(tmp_path / "saved" / "store.csv")])
        == 0
    )
    assert "same record on both sides" in (out / "tables.md").read_text()


def test_unusable_inputs_and_outputs_are_one_line_errors(sweep, tmp_path, capsys):
    from experiments.report.report import main

    tmp, _ = sweep
    (tmp_path / "afile").write_text("")
    assert main([str(tmp / "records"), "--out", str(tmp_path / "afile" / "x")]) == 1
    assert (
        capsys.readouterr().err.strip()
        == f"error: --out {tmp_path / 'afile' / 'x'}: {tmp_path / 'afile'} is a file, not a folder"
    )
    (tmp_path / "cut.parquet").write_bytes(b"PAR1 cut short")  # a saved store cut short
    df = store.load([tmp_path / "cut.parquet", tmp / "records"], verbose=False)
    assert len(df) and df.attrs["unreadable"][0].startswith(f"{tmp_path / 'cut.parquet'}: ")


def test_baseline_ratios(sweep, tmp_path):
    tmp, _ = sweep
    for r in raw_records(tmp / "records"):
        r["env"]["host"], r["env"]["torch"] = "other-machine", "9.9"
        if r["status"] == "ok":
            r["figures"]["fwd_median_s"] *= 2  # the baseline is twice as slow
        write_record(r, tmp_path)
    cur = store.load([tmp / "records"], verbose=False)
    base = store.load([tmp_path], verbose=False)
    # the machine as the comparison sees it, made known: no slow canary, no spread (how busy the
    # machine was when the fixture's sweeps ran must not decide this test; tests/test_compare.py
    # checks the noise verdicts on stores of known spread), nor beside other work or unstable (marked
    # times are not compared)
    for df in (cur, base):
        df["machine_slowdown"] = 1.0
        df["fwd_q1_s"] = df["fwd_q3_s"] = df["fwd_median_s"]
        df["concurrent_jobs"] = df["others_cpu_cores"] = 0
        df["fwd_cpu_per_wall"], df["fwd_unstable"] = df["threads"].astype(float), False
    sec = baseline_table(cur, base)
    assert cell(sec, "speedup", "naive", 64) == "2.00x"
    assert cell(sec, "speedup", "WrongAttention", 128) == "invalid"
    assert cell(sec, "memory", "sdpa(backend=math)", 64) == "1.00x"
    assert "other-machine" in sec.note and "9.9" in sec.note


def test_a_baseline_of_the_same_records_is_not_a_comparison(sweep, tmp_path):
    """A sweep run twice reuses its records (resume): both sides are then the same measurement, which
    read "within noise" in every cell. Tags (``extra``) label the sides and are not matched on."""
    tmp, _ = sweep
    cur = store.load([tmp / "records"], verbose=False)
    sec = baseline_table(cur, cur)
    assert cell(sec, "speedup", "naive", 64) == "same record"
    assert "(of 0 compared)" in sec.note and "the same record on both sides" in sec.note
    for r in raw_records(tmp / "records"):
        r["extra"] = {"run": "before"}
        r["started_at"] = "2020-01-01T00:00:00+00:00"  # another measurement of the same jobs
        write_record(r, tmp_path)
    sec = baseline_table(cur, store.load([tmp_path], verbose=False))
    assert cell(sec, "speedup", "naive", 64).startswith("1.00x"), sec.note  # the same figures
    assert "same record" not in sec.note and "No baseline record" not in sec.note


def test_partial_sweep_loads_what_is_there(sweep, tmp_path, capsys):
    tmp, _ = sweep
    recs = sorted((tmp / "records").rglob("*.json"))
    for p in recs[:3]:
        (tmp_path / p.name).write_text(p.read_text())
    (tmp_path / "cut.json").write_text(recs[3].read_text()[:100])  # a record cut short by a crash
    manifest = tmp_path / store.MANIFEST
    lines = [json.dumps({"record": str(tmp_path / p.name)}) for p in recs[:3]]
    manifest.write_text("\n".join([*lines, json.dumps({"record": str(tmp_path / "gone.json")}), '{"rec']))
    df = store.load([tmp_path], verbose=True)
    printed = capsys.readouterr().out
    assert len(df) == 3
    assert "1 unreadable file(s)" in printed and "1 missing path(s)" in printed


def test_report_writes_tables_store_and_valid_pngs(sweep):
    tmp, out = sweep
    # the sweep with report=true ended with its tables printed and everything written
    stdout = out["window"][0]
    assert "## Speed" in stdout and "local_window(window=16)" in stdout
    rep = tmp / "window" / "report"
    for name in ["tables.md", "store.parquet", "store.csv", "speed.csv", "memory.csv", "accuracy.csv", *PNGS]:
        assert (rep / name).is_file(), name
    # the CLI over every record (plots below, drawn once)
    cli_out = tmp / "cli"
    assert report.main([str(tmp / "records"), "--out", str(cli_out), "--no-plots"]) == 0
    shown = store.select(store.load([tmp / "records"], verbose=False))
    record_plots = (
        plots.plot_time,
        plots.plot_memory,
        plots.plot_gflops,
        plots.plot_scaling,
        plots.plot_accuracy,
    )
    for fn, name in zip(record_plots, PNGS, strict=False):
        assert fn(shown, cli_out) == cli_out / name
    for folder, names in ((rep, PNGS), (cli_out, PNGS[:5])):
        for name in names:
            data = (folder / name).read_bytes()
            assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, name
            img = mpimg.imread(folder / name)
            assert img.ndim == 3 and min(img.shape[:2]) > 200, name
    md = (cli_out / "tables.md").read_text()
    for heading in ("## Speed", "## Memory", "## Accuracy", "## Scaling", "## Status"):
        assert heading in md
    assert "useful (query, key) pairs" in md
    assert len(pd.read_csv(cli_out / "store.csv")) == 12


def test_weights_plot_draws_what_ran_with_its_knobs(sweep, monkeypatch):
    tmp, _ = sweep
    df = store.select(store.load([tmp / "records"], verbose=False))
    ran = {r["config"]["variant"]["_target_"] for r in raw_records(tmp / "records") if r["status"] == "ok"}
    panels = plots._swept_variants(df)
    # one panel per (variant, knobs) that ran ok, none for the others, each built with its recorded knobs
    assert {f"{type(v).__module__}.{type(v).__qualname__}" for _, v, _ in panels} == ran
    windows = sorted(v.window for _, v, _ in panels if type(v).name == "local_window")
    recorded = {
        r["config"]["variant"]["window"]
        for r in raw_records(tmp / "records")
        if r["variant_name"] == "local_window"
    }
    assert windows == sorted(recorded)
    # the figure draws exactly those panels
    drawn = []
    monkeypatch.setattr(
        plots,
        "attention_weights",
        lambda v, x, causal, documents: drawn.append((x.shape[2], causal, documents)) or np.eye(x.shape[2]),
    )
    (tmp / "weights_plot").mkdir()
    plots.plot_weights(df, tmp / "weights_plot")
    assert drawn == [(64, False, 1)] * len(panels)  # at the sweep's shortest length, as they ran
    drawn.clear()
    plots.plot_weights(df, tmp / "weights_plot", n_max=32)  # longer than legible: drawn at n_max
    assert drawn == [(32, False, 1)] * len(panels)
    # a variant that ran causal over 1 and 4 packed documents is drawn under each of those masks
    ok = df[df["status"] == "ok"]
    sdpa = ok[ok["variant_name"] == "sdpa"].iloc[[0, 0]].assign(causal=True, documents=[1, 4])
    drawn.clear()
    plots.plot_weights(pd.concat([ok[ok["variant_name"] != "sdpa"], sdpa]), tmp / "weights_plot")
    others = len(panels) - 1
    assert sorted(drawn) == sorted([(64, False, 1)] * others + [(64, True, 1), (64, True, 4)])
    # a model job's decoder is causal and a task's model when its task is, whatever the sweep's flag
    assert plots._mask_setting({"kind": "model", "causal": False, "documents": 1}) == (True, 1)
    task = {"kind": "task", "causal": False, "documents": pd.NA}
    assert plots._mask_setting({**task, "task": json.dumps({"name": "recall", "causal": True})}) == (True, 1)
    assert plots._mask_setting({**task, "task": {"name": "recall", "causal": False}}) == (False, 1)


def test_attention_weights_are_the_masked_softmax_the_sweep_ran():
    """The weights drawn for a causal call over packed documents: a float64 softmax written here, over
    the pairs of one document at or before the query (the lengths drawn as the sweep draws them)."""
    import torch

    import variants
    from experiments.measure.inputs import document_lengths

    x, _ = plots.structured_input(40)
    got = plots.attention_weights(variants.build("sdpa"), x, causal=True, documents=3)
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(document_lengths(1, 40, 3)[0]))
    scores = (x[0, 0] @ x[0, 0].T) / 16**0.5  # (N, N): D = 16
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(40, 40, dtype=torch.bool).tril()
    want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-12)
    assert len(set(doc.tolist())) == 3 and (got[~allowed.numpy()] == 0).all()
    # two-way, one document: every pair has weight
    assert (plots.attention_weights(variants.build("sdpa"), x) > 0).all()


def test_single_length_scaling_says_it_needs_two_lengths(sweep, capsys):
    tmp, _ = sweep
    df = store.select(store.load([tmp / "records"], verbose=False))
    one = df[df["seq_len"] == df["seq_len"].min()]
    plots.write_all(one, tmp / "one_length")
    assert "scaling plot skipped: scaling needs >= 2 lengths" in capsys.readouterr().out


def test_default_out_dir_is_inside_the_input(sweep):
    tmp, _ = sweep
    assert report.default_out_dir([tmp / "records"]) == tmp / "records" / "report"
    assert report.main([str(tmp / "nowhere")]) == 1  # no records: says so, exit status 1


def test_a_path_that_is_not_there_or_not_a_store_is_one_line(sweep, capsys):
    """A misspelt folder beside a real one would drop its records (or a comparison's side) without a
    word; a report's own table is no saved store."""
    tmp, _ = sweep
    assert report.main([str(tmp / "nowhere"), str(tmp / "records"), "--no-plots"]) == 1
    assert capsys.readouterr().err.strip() == f"error: no such file or folder: {tmp / 'nowhere'}"
    assert report.main([str(tmp / "records"), "--baseline", str(tmp / "gone"), "--no-plots"]) == 1
    assert "no such file or folder" in capsys.readouterr().err
    table = tmp / "table.csv"
    pd.DataFrame({"variant": ["naive"], "N=64": [1.0]}).to_csv(table, index=False)
    assert report.main([str(table), "--out", str(tmp / "from_table"), "--no-plots"]) == 1
    assert "not a saved store" in capsys.readouterr().out


def test_a_json_with_a_hash_and_a_status_alone_is_no_record(sweep, tmp_path, capsys):
    """Such a file counted as an ok job of variant '?' in the status table; now it is named as
    unreadable, with what it lacks, and the store holds the real records only."""
    tmp, _ = sweep
    real = store.load([tmp / "records"], verbose=False)
    (tmp_path / "bare.json").write_text(json.dumps({"config_hash": "x", "status": "ok"}))
    (tmp_path / "odd.json").write_text(
        json.dumps({"config_hash": "y", "status": "fine", "config": {}, "env": {}})
    )
    df = store.load([tmp / "records", tmp_path])
    out = capsys.readouterr().out
    assert len(df) == len(real) and "?" not in set(df["variant_name"])
    assert f"{tmp_path / 'bare.json'}: a record's hash and status, but no config or env" in out
    assert f"{tmp_path / 'odd.json'}: status 'fine' is none of ok, unsupported" in out


def test_a_time_marked_in_the_tables_is_ringed_in_the_time_plot(sweep, tmp_path, monkeypatch):
    tmp, _ = sweep
    df = store.select(store.load([tmp / "records"], verbose=False))
    # the machine as the fixture's records saw it is replaced by a known one: quiet everywhere, on its
    # cores, except naive at N=64, measured beside 1.2 busy cores of other work
    df = df.assign(others_cpu_cores=0.0, concurrent_jobs=0, machine_slowdown=1.0, fwd_cpu_per_wall=64.0)
    hit = (df["variant"] == "naive") & (df["seq_len"] == 64)
    df.loc[hit, "others_cpu_cores"] = 1.2
    saved = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: saved.append(fig) or path)
    plots.plot_time(df, tmp_path)
    (fig,) = saved
    red = [
        c
        for ax in fig.axes
        for c in ax.collections
        if len(c.get_edgecolor()) and tuple(c.get_edgecolor()[0]) == (1, 0, 0, 1)
    ]
    ringed = sorted(float(x) for c in red for x, _ in c.get_offsets())
    assert ringed == [64.0] * int(hit.sum())  # the one flagged point, in each panel that has it
    texts = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("beside other work (*)" in t for t in texts)


def test_loaded_times_are_marked_and_skipped_files_are_named_in_the_report(sweep, tmp_path):
    tmp, _ = sweep
    recs = [r for r in raw_records(tmp / "records") if r["status"] == "ok" and label(r) == "naive"]
    for i, r in enumerate(recs):
        r["figures"]["others_cpu_cores"] = 1.2 if r["config"]["seq_len"] == 64 else 0.1
        r["figures"]["concurrent_jobs"] = 0  # (the fixture's three sweeps did run side by side)
        r["figures"]["fwd_unstable"] = r["config"]["seq_len"] == 128
        # the machine's own speed is not what this test is about (no `~` from the real canaries)
        r["figures"].update(canary_before_ms=20.0, canary_after_ms=20.0)
        write_record({**r, "started_at": f"{r['started_at']}{i}"}, tmp_path / "recs")
    (tmp_path / "recs" / "junk.json").write_bytes(b"\x8b\x00 not json")
    (tmp_path / "recs" / "list.json").write_text("[1, 2]")
    out = tmp_path / "out"
    report.report_paths([tmp_path / "recs"], out, plots=False, echo=False)
    text = (out / "tables.md").read_text()
    assert "- unreadable: " + str(tmp_path / "recs" / "junk.json") in text
    assert "- not a record: " + str(tmp_path / "recs" / "list.json") in text
    shown = store.select(store.load([tmp_path / "recs"], verbose=False))
    speed = T.speed_table(shown)
    assert cell(speed, "median time", "naive", 64).endswith(" *")  # measured beside 1.2 busy cores
    assert not cell(speed, "median time", "naive", 128).endswith("*")
    assert cell(speed, "median time", "naive", 128).endswith(" unstable")  # its timed runs never settled
    assert "unstable" not in cell(speed, "median time", "naive", 64)
    # the fixture's parallel sweeps: jobs that measured beside another job of the suite are marked
    fixture = T.speed_table(store.select(store.load([tmp / "records"], verbose=False)))
    recs = [r for r in raw_records(tmp / "records") if r["status"] == "ok" and r["figures"]["valid"]]
    for r in recs:
        marked = " *" in cell(fixture, "median time", label(r), r["config"]["seq_len"])
        beside = r["figures"]["concurrent_jobs"] > 0 or r["figures"]["others_cpu_cores"] > 0.5
        # or its threads were off their cores (CPU time over wall time under 0.9 of its thread count)
        mode = r["config"]["mode"]
        off = r["figures"][f"{mode}_cpu_per_wall"] < 0.9 * r["figures"]["threads"]
        assert marked == (beside or off)


def test_two_hosts_merge_into_one_report_without_mixing_their_figures(sweep, tmp_path):
    tmp, _ = sweep
    naive = [r for r in raw_records(tmp / "records") if label(r) == "naive"]
    for host, scale in (("alpha", 1.0), ("beta", 3.0)):
        for r in naive:
            r2 = json.loads(json.dumps(r))
            r2["env"]["host"] = host
            r2["figures"]["fwd_median_s"] = r["figures"]["fwd_median_s"] * scale
            write_record(r2, tmp_path / host)  # one records folder per machine
    shown = store.select(store.load([tmp_path / "alpha", tmp_path / "beta"], verbose=False))
    assert set(shown["env_host"]) == {"alpha", "beta"}
    speed = T.speed_table(shown)
    times = [(h, tab) for h, tab in speed.parts if "median time" in h]
    assert len(times) == 2 and {("host=alpha" in h) + 2 * ("host=beta" in h) for h, _ in times} == {1, 2}
    n = naive[0]["config"]["seq_len"]
    by_host = {
        ("alpha" if "host=alpha" in h else "beta"): float(t.loc["naive", f"N={n}"].split()[0])
        for h, t in times
    }
    assert by_host["beta"] == pytest.approx(3 * by_host["alpha"], rel=0.01)  # each cell is one machine's


@pytest.mark.parametrize(
    "cpu_per_wall, device, marked", [(1.3, "cpu", True), (1.95, "cpu", False), (1.3, "cuda", False)]
)
def test_a_cpu_time_whose_threads_were_off_their_cores_is_marked(cpu_per_wall, device, marked):
    from tests.test_rounds import record

    rec = record(0, 0.105, 0.02, 10)
    rec["config"].update(threads=2, device=device)
    rec["figures"].update(fwd_bwd_cpu_per_wall=cpu_per_wall, threads=2)
    speed = T.speed_table(store.select(store.to_frame([rec])))
    text = speed.parts[0][1].iloc[0, 0]
    assert text.startswith("105") and text.endswith(" *") == marked, text
    assert speed.data["cpu_per_wall"].tolist() == [cpu_per_wall]


def test_a_store_with_no_usable_record_has_no_scaling_row():
    """Only refusals: the scaling section says there is nothing to fit (it showed a row of NaN keys,
    headed "nan · nan · nan", because assigning columns to an empty frame took their index)."""
    from experiments.records.store import to_frame
    from experiments.report.kernel_tables import scaling_fits, scaling_table

    from .test_runner import job_cfg

    recs = [
        {"config_hash": f"h{n}", "status": "unsupported", "_path": f"r{n}.json", "reason": "no",
         "config": job_cfg(variant="naive", seq_len=n), "figures": {}, "env": {"host": "h"}}
        for n in (64, 128)
    ]  # fmt: skip
    df = to_frame(recs)
    assert scaling_fits(df).empty
    sec = scaling_table(df)
    assert sec.parts == [] and "nothing to fit" in sec.note


def test_with_every_measurement_each_run_gets_its_own_scaling_fit():
    """``--all-measurements`` shows a row per run in the speed table; the fit pooled the runs (an
    exponent of 1.50 with R² 0.79 where one run grew as N² and the other as N)."""
    rows = [
        {"variant": "sdpa", "run": run, "seq_len": n, "fwd_median_s": 1e-3 * (n / 1024) ** k,
         "peak_mib": n / 64, "status": "ok", "valid": True, "device": "cpu", "dtype": "float32",
         "mode": "fwd", "started_at": "t", "config_hash": f"{run}{n}", "path": "p", "reason": None}
        for run, k in (("run2", 1), ("sweep", 2))
        for n in (1024, 2048, 4096)
    ]  # fmt: skip
    df = pd.DataFrame(rows)
    fits = T.scaling_fits(df).set_index("run")
    assert fits.loc["sweep", "time_exponent"] == pytest.approx(2.0)
    assert fits.loc["run2", "time_exponent"] == pytest.approx(1.0)
    assert fits["time_r2"].tolist() == pytest.approx([1.0, 1.0])
    (_, tab), *_ = T.scaling_table(df).parts
    assert tab.loc[("sdpa", "sweep"), "time exponent"] == "2.00"
    assert tab.loc[("sdpa", "run2"), "time exponent"] == "1.00"
    # the newest measurement alone (no run column): one fit per variant, as before
    assert len(T.scaling_fits(df[df["run"] == "sweep"].drop(columns="run"))) == 1


def test_one_host_name_on_two_cpus_is_two_machines():
    """The 2-core VM is `vm` on an Intel Xeon and on an AMD EPYC: by host name alone the Intel's
    11.7 ms canary made every AMD job (23 ms) look 2x slow (marked ~), and the same configuration
    measured on both fell into one cell, the newest hiding the other."""
    from experiments.records.store import machine_names

    df = pd.DataFrame(
        {
            "env_host": ["vm", "vm", "vm", "box"],
            "env_cpu_model": ["Intel Xeon", "AMD EPYC", None, "AMD EPYC"],
        }
    )
    assert list(machine_names(df)) == ["vm (Intel Xeon)", "vm (AMD EPYC)", "vm (?)", "box"]
    df.loc[0, "env_cpu_model"] = "Intel(R) Xeon(R) Processor"  # as /proc/cpuinfo spells it: shortened
    assert machine_names(df)[0] == "vm (Intel Xeon)"
    one = df.iloc[[1, 3]]
    assert list(machine_names(one)) == ["vm", "box"]  # one CPU per host name: the name alone


def test_the_canary_line_counts_only_jobs_that_measured_something():
    """Unsupported jobs have a canary but no thread count: they made a line of their own,
    "vm, ? thread(s) ... 1 slower than 1.15x", about jobs with no time to mark."""
    from experiments.report.report import _canaries

    df = pd.DataFrame(
        {
            "status": ["ok", "ok", "unsupported", "unsupported"],
            "env_host": ["vm"] * 4,
            "fig_threads": [1, 1, None, None],
            "canary_before_ms": [10.0, 11.0, 9.0, 13.0],
            "machine_slowdown": [1.0, 1.1, 1.0, 1.44],
        }
    )
    (line,) = _canaries(df)
    assert line.startswith("- vm, 1 thread(s): 10 / 10.5 / 11 ms") and "of 2 jobs); 0 slower" in line
