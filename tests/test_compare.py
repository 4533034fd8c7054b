"""Comparing two runs (``report --baseline``): each speedup says whether it is outside the two runs'
own noise, and the section counts how many cells got faster, slower, or stayed within noise."""

from __future__ import annotations

import pytest

from experiments.records import store
from experiments.records.records import config_hash
from experiments.report.compare import baseline_table
from experiments.report.format import Section


def record(n: int, median_ms: float, spread_ms: float, canary_ms: float = 20.0, hour: int = 10) -> dict:
    """A fwd record of naive at N=``n``: median ``median_ms``, quartiles ``median -/+ spread_ms``,
    and a canary of ``canary_ms`` before and after it."""
    cfg = {
        "variant": {"_target_": "variants.naive.NaiveAttention"},
        **{"device": "cpu", "dtype": "float32", "mode": "fwd", "batch": 1, "heads": 8, "head_dim": 64},
        **{"seq_len": n, "seed": 0, "threads": 1, "round": 0},
    }
    med, q1, q3 = (x / 1e3 for x in (median_ms, median_ms - spread_ms, median_ms + spread_ms))
    figures = {"fwd_median_s": med, "fwd_q1_s": q1, "fwd_q3_s": q3, "valid": True, "peak_mib": 1.0}
    figures["canary_before_ms"] = figures["canary_after_ms"] = canary_ms
    return {
        "variant_name": "naive",
        "label": f"naive N={n}",
        "status": "ok",
        "reason": None,
        "config": cfg,
        "config_hash": config_hash(cfg),
        "figures": figures,
        "env": {"host": "vm", "code_version": "c1"},
        "started_at": f"2026-11-23T{hour:02d}:00:00+00:00",
        "finished_at": f"2026-11-23T{hour:02d}:00:30+00:00",
        "_path": f"n{n}-{hour}.json",
    }


# N: (baseline median, spread), (this run's median, spread, canary) -> the verdict
CELLS = {
    256: ((10.0, 0.2), (5.0, 0.1, 20.0), "faster"),  # 2x, quartiles far apart
    512: ((10.0, 0.5), (10.3, 0.3, 20.0), "within noise"),  # quartiles overlap
    1024: ((10.0, 0.1), (10.3, 0.05, 20.0), "within noise"),  # apart, but 3% is below the 5% floor
    2048: ((10.0, 0.1), (20.0, 0.2, 20.0), "slower"),
    4096: ((10.0, 0.1), (5.0, 0.1, 30.0), "slow machine"),  # its canary: 1.5x the run's fastest
}


@pytest.fixture
def compared() -> Section:
    base = store.to_frame([record(n, m, s, hour=9) for n, ((m, s), _, _) in CELLS.items()])
    cur = store.to_frame([record(n, m, s, c, hour=11) for n, (_, (m, s, c), _) in CELLS.items()])
    return baseline_table(cur, base)


def test_each_speedup_says_whether_it_is_outside_the_two_runs_noise(compared):
    data = compared.data.set_index("seq_len")
    for n, (_, _, verdict) in CELLS.items():
        assert data.loc[n, "verdict"] == verdict, n
    assert data.loc[256, "speedup"] == pytest.approx(2.0) and data.loc[2048, "speedup"] == pytest.approx(0.5)
    (speedup,) = [tab for heading, tab in compared.parts if "speedup" in heading]
    cells = {int(c.split("=")[-1]) if "=" in str(c) else c: v for c, v in speedup.iloc[0].items()}
    assert cells[256] == "2.00x" and cells[2048] == "0.50x"
    assert cells[512] == "0.97x ≈" and cells[1024] == "0.97x ≈" and cells[4096] == "2.00x ~"


def test_the_comparison_counts_its_verdicts(compared):
    assert compared.note.startswith(
        "1 faster, 1 slower, 2 within noise (of 4 compared); not compared: 1 on a slow machine"
    )
    assert "`≈`: within the two runs' noise" in compared.note


def test_the_comparison_names_a_change_of_cpu_instruction_set_on_one_cpu_model():
    """Two hosts of one cloud machine type can share a CPU model name and not its vector units (an
    AVX2 host ran a store 1.5x slower than an AVX-512 one): the comparison says so."""
    from experiments.report.compare import env_diff

    def frame(isa: str):
        recs = [record(256, 10.0, 0.1)]
        recs[0]["env"] = {"host": "vm", "cpu_model": "AMD EPYC", "cpu_capability": isa}
        return store.to_frame(recs)

    assert "cpu_capability: AVX2 (this) vs AVX512 (baseline)" in env_diff(frame("AVX2"), frame("AVX512"))
    assert env_diff(frame("AVX2"), frame("AVX2")) == "The two sets report the same environment."


def test_the_comparison_names_a_variant_whose_code_changed_under_the_same_commit():
    """A plugin's new version runs under the same commit of this repository: the comparison said "the
    same environment" for it. It names the variant whose source hash moved, with the package versions
    where they differ, and not the one whose code stayed."""
    from experiments.report.compare import env_diff

    def frame(code: str, package: str | None, other: str = "n1"):
        recs = [record(256, 10.0, 0.1), sparse_record(256, 10.0, hour=10)]
        recs[0]["env"] = {"host": "vm", "git_commit": "abc", "variant_code": code, "variant_package": package}
        recs[1]["env"] = {"host": "vm", "git_commit": "abc", "variant_code": other}
        recs[1]["variant_name"] = "sparse"
        return store.to_frame(recs)

    text = env_diff(frame("v2", "dilated-attn 0.2.0"), frame("v1", "dilated-attn 0.1.0"))
    versions = "dilated-attn 0.2.0 (this) vs dilated-attn 0.1.0 (baseline)"
    assert text == f"Differences: variant code: naive ({versions})."
    text = env_diff(frame("v2", None, "n2"), frame("v1", None))  # built in, edited without a commit
    assert text == "Differences: variant code: naive, sparse."
    assert env_diff(frame("v1", "p 1"), frame("v1", "p 1")) == "The two sets report the same environment."
    old = frame("v1", None)  # a baseline from before records kept the hash: unknown, not changed
    old["env_variant_code"] = None
    assert env_diff(frame("v2", None, "n1"), old) == "The two sets report the same environment."


def test_a_sweep_with_the_default_threads_names_the_threads_it_ran_on():
    """``threads=null`` (the default: every CPU) left the configured count empty, and the note said "The
    machine vm (? thread(s))": the machine's state is keyed, as the canary's, by the measured count,
    so a side run with threads=2 and one with the default on 2 cores are the same machine."""
    recs = {}
    for side, threads, copy_gbs, hour in (("base", None, 37.6, 9), ("cur", 2, 18.6, 11)):
        recs[side] = []
        for n in (256, 512):
            rec = with_machine(record(n, 10.0, 0.1, hour=hour), copy_gbs)
            rec["config"]["threads"] = threads
            rec["figures"]["threads"] = 2
            recs[side].append(rec)
    sec = baseline_table(store.to_frame(recs["cur"]), store.to_frame(recs["base"]))
    assert "The machine vm (2 thread(s)) was in another state" in sec.note, sec.note
    assert "?" not in sec.note.split("The machine", 1)[1].split(")")[0]


def test_two_sides_measured_on_the_same_machines_are_compared_host_to_host():
    """A code change measured on two hosts each side: each host's cell against its own baseline (the
    newest of each side came from different hosts: 20 ms against 10 ms read as 2x slower)."""

    def on(host: str, median_ms: float, hour: int) -> dict:
        rec = record(256, median_ms, 0.1, hour=hour)
        rec["env"] = {**rec["env"], "host": host}
        return rec

    base = store.to_frame([on("a", 10.0, 9), on("b", 20.0, 8)])
    cur = store.to_frame([on("a", 10.0, 11), on("b", 20.0, 12)])
    sec = baseline_table(cur, base)
    data = sec.data.set_index("env_host")
    assert data["speedup"].to_dict() == {"a": pytest.approx(1.0), "b": pytest.approx(1.0)}
    assert (data["env_host_base"] == data.index).all()
    assert "Matched host to host (on both sides: a, b)" in sec.note
    # no machine on both sides: the comparison of two machines, newest (host a) against newest
    other = store.to_frame([on("c", 5.0, 11)])
    sec = baseline_table(other, base)
    assert sec.data["speedup"].tolist() == [pytest.approx(10.0 / 5.0)] and "host to host" not in sec.note


def on_host(host: str, n: int, median_ms: float, hour: int, spread_ms: float = 0.1) -> dict:
    """:func:`record` measured on ``host``."""
    rec = record(n, median_ms, spread_ms, hour=hour)
    rec["env"] = {**rec["env"], "host": host}
    return rec


def test_a_comparison_of_machines_takes_one_baseline_machine_per_row_and_names_it():
    """A baseline of a fast machine at every N and a slower one re-run later at one N, against a third
    machine: the newest per cell took the slow one at that N (10 ms against 30 ms read as 3x faster
    between two cells that were 1x), and nothing said which machine a cell was compared against."""
    base = store.to_frame(
        [
            *(on_host("fastbox", n, 10.0, hour=9) for n in (1024, 2048, 4096)),
            on_host("slowbox", 2048, 30.0, 10),
        ]
    )
    cur = store.to_frame([on_host("newbox", n, 10.0, hour=11) for n in (1024, 2048, 4096)])
    sec = baseline_table(cur, base)
    data = sec.data.set_index("seq_len")
    assert data["speedup"].tolist() == [pytest.approx(1.0)] * 3
    assert set(data["env_host_base"]) == {"fastbox"}
    assert sec.note.startswith("0 faster, 0 slower, 3 within noise (of 3 compared)")
    assert (
        "each row against one baseline host" in sec.note
        and "fastbox (not compared against: slowbox)" in sec.note
    )


def test_a_time_either_side_marks_is_not_counted_as_a_change():
    """A time the speed table marks (`*` measured beside other work, `unstable`, on either side) read
    as plain faster or slower, and was counted so, though the difference may be the other work's."""
    recs = {n: (record(n, 10.0, 0.1, hour=9), record(n, 20.0, 0.1, hour=11)) for n in (256, 512, 1024, 2048)}
    recs[256][1]["figures"]["concurrent_jobs"] = 1  # this run: another job measured beside it
    recs[512][1]["figures"]["fwd_unstable"] = True
    recs[1024][0]["figures"]["others_cpu_cores"] = 1.8  # the baseline: other processes kept 1.8 cores busy
    sec = baseline_table(
        store.to_frame([c for _, c in recs.values()]), store.to_frame([b for b, _ in recs.values()])
    )
    verdicts = sec.data.set_index("seq_len")["verdict"].to_dict()
    assert verdicts == {256: "beside other work", 512: "unstable", 1024: "beside other work", 2048: "slower"}
    assert sec.note.startswith(
        "0 faster, 1 slower, 0 within noise (of 1 compared); not compared: 2 beside other work, 1 unstable"
    )
    (speedup,) = [tab for heading, tab in sec.parts if "speedup" in heading]
    assert speedup.loc["naive"].tolist() == ["0.50x *", "0.50x unstable", "0.50x *", "0.50x"]


def test_the_summary_counts_and_names_what_now_fails_and_what_only_the_baseline_has():
    """A configuration that now ends in ``error`` (ok in the baseline) and one only the baseline
    measured were left out of the count; the latter showed `–`, which says no job was run there."""
    base = store.to_frame([record(n, 10.0, 0.1, hour=9) for n in (256, 512, 1024)])
    failed = record(512, 10.0, 0.1, hour=11)
    failed["status"], failed["figures"] = "error", {}
    cur = store.to_frame([record(256, 10.0, 0.1, hour=11), failed])
    sec = baseline_table(cur, base)
    assert sec.note.startswith(
        "0 faster, 0 slower, 1 within noise (of 1 compared); "
        "1 now failing (ok in the baseline: naive N=512); 1 baseline only (no record now: naive N=1024)."
    ), sec.note
    (speedup,) = [tab for heading, tab in sec.parts if "speedup" in heading]
    assert speedup.loc["naive"].tolist() == ["1.00x ≈", "error (was ok)", "baseline only"]
    assert sec.data.set_index("seq_len")["verdict"].to_dict() == {
        256: "within noise",
        512: "now failing",
        1024: "baseline only",
    }


def with_machine(rec: dict, copy_gbs: float, gemm_gflops: float = 100.0, canary_ms: float = 20.0) -> dict:
    """``rec`` measured in a sweep whose ceilings were ``copy_gbs`` and ``gemm_gflops`` (one thread),
    with a canary of ``canary_ms`` around the job."""
    rec["roofline"] = {"device": "cpu", "threads": 1, "copy_bytes_per_s": copy_gbs * 1e9}
    rec["roofline"]["gemm_flops_per_s"] = gemm_gflops * 1e9
    rec["figures"]["canary_before_ms"] = rec["figures"]["canary_after_ms"] = canary_ms
    return rec


@pytest.mark.parametrize(
    "now, changed",
    [
        ({"copy_gbs": 18.6}, "copy 18.6 GB/s (this) vs 37.6 (baseline)"),  # the VM's memory at half speed
        ({"copy_gbs": 37.6, "canary_ms": 26.0}, "canary 26 ms (this) vs 20 (baseline)"),
        ({"copy_gbs": 37.6, "gemm_gflops": 80.0}, "GEMM 80 GFLOP/s (this) vs 100 (baseline)"),
    ],
)
def test_one_host_in_another_state_in_the_two_runs_is_not_compared(now, changed):
    """The scaling store measured again with unchanged kernels, on a day this project's VM copied at
    18.6 GB/s against 37.6, read "0 faster, 87 slower": every difference counted as the code's. A
    host whose ceilings or canary moved more than ``SLOW_RATIO`` between the runs is named, with both
    sides' figures, and its cells are marked and not compared; within that, they are."""
    base = store.to_frame([with_machine(record(n, 10.0, 0.1, hour=9), 37.6) for n in (256, 512)])
    cur = store.to_frame([with_machine(record(n, 20.0, 0.1, hour=11), **now) for n in (256, 512)])
    sec = baseline_table(cur, base)
    assert sec.data["verdict"].tolist() == ["machine changed"] * 2
    assert sec.note.startswith(
        "0 faster, 0 slower, 0 within noise (of 0 compared); not compared: 2 on a machine in another state"
    )
    assert "The machine vm (1 thread(s)) was in another state in the two runs: " in sec.note
    assert changed in sec.note
    (speedup,) = [tab for heading, tab in sec.parts if "speedup" in heading]
    assert speedup.loc["naive"].tolist() == ["0.50x ≠", "0.50x ≠"]
    # 10% apart in every figure: the same machine's state, compared
    cur = store.to_frame([with_machine(record(n, 20.0, 0.1, hour=11), 34.0, 91.0, 22.0) for n in (256, 512)])
    sec = baseline_table(cur, base)
    assert sec.data["verdict"].tolist() == ["slower"] * 2 and "another state" not in sec.note


def test_two_sets_measured_in_alternating_rounds_are_compared_whatever_their_ceilings():
    """side_by_side takes rounds in turn (baseline, this, this, baseline): one copy bandwidth measured
    per sweep moved 17% between the sides on this VM within minutes, and the cells were marked `≠`
    with the advice to measure side by side, which they were. Sets whose times overlap are compared."""
    base = store.to_frame([with_machine(record(256, 10.0, 0.1, hour=h), 37.6) for h in (9, 12)])
    cur = store.to_frame([with_machine(record(256, 20.0, 0.1, hour=h), 18.6) for h in (10, 11)])
    sec = baseline_table(cur, base)
    assert sec.data["verdict"].tolist() == ["slower"] and "another state" not in sec.note
    assert "measured in alternating rounds (their times overlap)" in sec.note


def test_only_the_host_whose_state_moved_is_not_compared():
    """Two hosts on both sides, one of them with its memory at half speed: the other's cells are
    compared. A comparison of two machines (no host on both sides) compares their states as well."""

    def on(host: str, n: int, median_ms: float, hour: int, copy_gbs: float) -> dict:
        return with_machine(on_host(host, n, median_ms, hour), copy_gbs)

    base = store.to_frame([on("a", 256, 10.0, 9, 37.6), on("b", 256, 10.0, 9, 37.6)])
    cur = store.to_frame([on("a", 256, 20.0, 11, 18.6), on("b", 256, 20.0, 11, 37.0)])
    sec = baseline_table(cur, base)
    assert sec.data.set_index("env_host")["verdict"].to_dict() == {"a": "machine changed", "b": "slower"}
    assert "The machine a (1 thread(s))" in sec.note and "The machine b" not in sec.note
    other = store.to_frame([on("c", 256, 20.0, 11, 18.6)])
    sec = baseline_table(other, base)
    assert sec.data["verdict"].tolist() == ["slower"] and "another state" not in sec.note


def sparse_record(n: int, median_ms: float, hour: int, **knobs: object) -> dict:
    """:func:`record` of the block-sparse variant with ``knobs`` in its config (and no others)."""
    rec = record(n, median_ms, 0.1, hour=hour)
    rec["config"]["variant"] = {"_target_": "variants.sparse.BlockSparseAttention", "block": 64, **knobs}
    rec["config_hash"] = config_hash(rec["config"])
    rec["variant_name"] = "sparse"
    return rec


def test_a_knob_added_since_the_baseline_is_matched_at_its_default():
    """sparse gained ``global_rows`` and ``cuda_tile``: its baseline records hold neither, so every
    sparse cell read "baseline only" and "no baseline". A knob the baseline lacks is taken at the
    class's default today, and the note says so; a record that set it otherwise is not matched."""
    base = store.to_frame([sparse_record(n, 10.0, 9) for n in (256, 512)])
    cur = store.to_frame(
        [
            sparse_record(256, 5.0, 11, global_rows="auto", cuda_tile="auto"),
            sparse_record(512, 5.0, 11, global_rows="dense", cuda_tile="auto"),
        ]
    )
    sec = baseline_table(cur, base)
    data = sec.data.set_index("seq_len")
    assert data.loc[256, "verdict"] == "faster" and data.loc[256, "speedup"] == pytest.approx(2.0)
    said = "the baseline's records lack cuda_tile, global_rows, taken at their defaults (auto, auto)"
    assert said in sec.note
    # global_rows=dense is not the default: not the baseline's configuration
    (speedup,) = [tab for heading, tab in sec.parts if "speedup" in heading]
    assert speedup.loc["sparse(global_rows=auto)"].tolist() == ["2.00x", "baseline only"]
    assert speedup.loc["sparse(global_rows=dense)"].tolist() == ["–", "no baseline"]


def test_a_knob_of_a_class_that_cannot_be_imported_is_not_filled():
    """A third party's class not installed here: its defaults are unknown, so nothing is matched."""
    old, new = sparse_record(256, 10.0, 9), sparse_record(256, 5.0, 11, extra_knob=3)
    for rec in (old, new):
        rec["config"]["variant"]["_target_"] = "not_installed.Attention"
    sec = baseline_table(store.to_frame([new]), store.to_frame([old]))
    assert sec.data["speedup"].isna().all() and "Knobs added since" not in sec.note


def test_a_gpu_s_changed_state_reads_in_tera():
    """The note gave a GPU's GEMM as "6.82e+05 GFLOP/s (this) vs 5e+05 (baseline)"."""
    base = [with_machine(record(n, 10.0, 0.1, hour=9), 3020.0, gemm_gflops=5.0e5) for n in (256, 512)]
    cur = [with_machine(record(n, 10.0, 0.1, hour=11), 3020.0, gemm_gflops=6.82e5) for n in (256, 512)]
    sec = baseline_table(store.to_frame(cur), store.to_frame(base))
    assert "GEMM 682 TFLOP/s (this) vs 500 (baseline)" in sec.note, sec.note


def test_a_ceiling_measured_another_way_on_each_side_is_not_the_machine_changing():
    """The sweep's GEMM ceiling was a 1024 GEMM before it was a 2048 one, which runs at another rate
    on the same machine: the two are not compared; the copy, measured alike, still is."""
    base = [with_machine(record(256, 10.0, 0.1, hour=9), 37.6, gemm_gflops=80.0)]
    cur = [with_machine(record(256, 20.0, 0.1, hour=11), 37.0, gemm_gflops=100.0)]
    base[0]["roofline"]["gemm_n"], cur[0]["roofline"]["gemm_n"] = 1024, 2048
    sec = baseline_table(store.to_frame(cur), store.to_frame(base))
    assert sec.data["verdict"].tolist() == ["slower"] and "another state" not in sec.note
    cur[0]["roofline"]["copy_bytes_per_s"] = 18.6e9
    sec = baseline_table(store.to_frame(cur), store.to_frame(base))
    assert sec.data["verdict"].tolist() == ["machine changed"]
    assert (
        "copy 18.6 GB/s (this) vs 37.6 (baseline), canary" in sec.note
        and "GEMM" not in sec.note.split("state")[-1]
    )
    # a record from before the GEMM's dtype was written ran it in the job's: the same GEMM as float32's
    for rec in (*base, *cur):
        rec["roofline"].update(gemm_n=2048, dtype="float32", copy_bytes_per_s=37.6e9)
    cur[0]["roofline"]["gemm_dtype"] = "float32"
    sec = baseline_table(store.to_frame(cur), store.to_frame(base))
    assert sec.data["verdict"].tolist() == ["machine changed"]
    assert "GEMM 100 GFLOP/s (this) vs 80 (baseline), copy" in sec.note


def test_the_report_header_names_the_plugin_packages_that_ran():
    """A plugin's code is not this repository's commit, which the header names: the header names the
    plugin package and its versions too, and says nothing of plugins where none ran."""
    from experiments.report.report import header

    recs = [record(256, 10.0, 0.1, hour=9), record(256, 9.0, 0.1, hour=10), record(512, 9.0, 0.1)]
    for rec, package in zip(recs, ("dilated-attn 0.1.0", "dilated-attn 0.2.0", None), strict=True):
        rec["env"]["variant_package"] = package
    df = store.to_frame(recs)
    line = "Variants from installed packages (not this repository's commit): "
    assert line + "naive (dilated-attn 0.1.0, dilated-attn 0.2.0)." in header(df, df, [], True)
    assert line not in header(df.iloc[2:], df.iloc[2:], [], True)
