"""The regression gates of ``benchmarks/`` bite: degraded copies of a variant fail, the original passes.

Runs in the plain unit-test run (the benchmarks themselves do not). Each degraded copy is a subclass of
the registered ``naive`` class, measured with the real gate functions and compared with the committed
baseline entry of ``naive``; only one test registers a copy, and it unregisters it afterwards.
"""

from __future__ import annotations

import math

import pytest
import torch

import variants
from benchmarks import gates
from variants.registry import unregister

BASELINE = gates.load_baseline()
NaiveAttention = variants.get("naive")
ROUNDS = 40  # enough for a stable median at this shape, short enough for the unit-test run


def committed(key: str) -> dict:
    """The committed baseline entry for ``key`` (the test fails with the refresh hint if it is absent)."""
    base = BASELINE["entries"].get(key)
    assert base is not None, gates.missing_message(key)
    return base


class MemoryHungry(NaiveAttention):
    """``naive`` that holds one more score-sized buffer ``(B, H, Nq, Nk)`` through the call.

    Through the forward pass, and with autograd through the backward pass too (as a tensor needlessly
    saved for backward would be).
    """

    def _attend(self, q, k, v, **kw):
        extra = torch.ones(q.shape[0], q.shape[1], q.shape[2], k.shape[2], dtype=q.dtype)  # (B, H, Nq, Nk)
        out = super()._attend(q, k, v, **kw)  # `extra` is alive here: it overlaps the parent's own peak
        if out.requires_grad:
            out.register_hook(lambda grad, held=extra: grad)  # the graph keeps `extra` until backward ends
        return out


class Slowed(NaiveAttention):
    """``naive`` doing its whole computation ``REPEAT`` times: same memory, FLOPs and error, slower.

    Extra work rather than ``time.sleep``: the gate times CPU time, and work slows down with the machine's
    load exactly as the reference does.
    """

    REPEAT = 8

    def _attend(self, q, k, v, **kw):
        for _ in range(self.REPEAT - 1):
            super()._attend(q, k, v, **kw)
        return super()._attend(q, k, v, **kw)


class Inaccurate(NaiveAttention):
    """``naive`` whose output is off by one part in a thousand (a broken rescaling, say)."""

    def _attend(self, q, k, v, **kw):
        return super()._attend(q, k, v, **kw) * (1 + 1e-3)


def _naive() -> variants.AttentionVariant:
    return gates.build("naive", {})


# ------------------------------------------------------------------------------ the committed baseline
@pytest.mark.parametrize("mode", gates.MODES)
def test_unmodified_variant_passes_the_committed_baseline(mode):
    # memory, FLOPs and error; its time is benchmarks/test_regression.py's to gate (a timed unit test
    # would depend on a quiet machine)
    key = f"naive/{mode}"
    assert gates.compare_static(key, gates.measure_static(_naive(), mode), committed(key)) == []


def test_committed_baseline_records_what_this_machine_cannot_run():
    entries = BASELINE["entries"]
    unsupported = {k for k, e in entries.items() if e["status"] == "unsupported"}
    # xformers is CUDA-only and FlexAttention has no CPU backward: recorded, not left out
    assert {c.key for c in gates.cases() if c.name == "xformers"} <= unsupported
    assert any(k.startswith("flex") and k.endswith("/fwd_bwd") for k in unsupported)
    assert all(entries[k]["reason"] for k in unsupported)


def test_committed_baseline_is_for_the_current_settings():
    assert BASELINE["config"] == gates.config(), f"refresh with `{gates.REFRESH_COMMAND}`"
    assert {"torch_version", "cpu_model", "gpu", "torch_threads_benchmarked"} <= set(BASELINE["machine"])


def test_unsupported_case_still_says_so():
    attn = gates.build("xformers", gates.bench_knobs("xformers"))
    for case in (c for c in gates.cases() if c.name == "xformers"):
        key, mode = case.key, case.mode
        entry = gates.measure_static(attn, mode)
        assert entry["status"] == "unsupported" and entry["reason"]
        assert gates.compare_static(key, entry, committed(key)) == []


# ------------------------------------------------------------------------------ the gates bite
def test_memory_hungry_copy_fails_the_memory_gate():
    key = "naive/fwd"
    entry = gates.measure_static(MemoryHungry(), "fwd")
    fails = gates.compare_static(key, entry, committed(key))
    assert len(fails) == 1 and "peak memory grew" in fails[0], fails
    extra = gates.BATCH * gates.HEADS * gates.SEQ * gates.SEQ * 4  # the buffer's bytes, fp32
    assert entry["peak_bytes"] - committed(key)["peak_bytes"] == extra
    assert f"{entry['peak_bytes']:,} B" in fails[0] and f"{committed(key)['peak_bytes']:,} B" in fails[0]


def test_memory_hungry_copy_fails_the_memory_gate_in_backward():
    key = "naive/fwd_bwd"
    fails = gates.compare_static(key, gates.measure_static(MemoryHungry(), "fwd_bwd"), committed(key))
    assert any("peak memory grew" in f for f in fails), fails


def _scripted_times(monkeypatch, ratio: float) -> list[int]:
    """Replace the interleaved timing by one where every round's ratio is ``ratio`` (the machine's state
    is scripted: this tests the gate's logic, the real timing is the benchmarks'); returns the rounds
    each measurement asked for."""
    asked: list[int] = []

    def times(fn, ref, rounds):
        asked.append(rounds)
        return [ratio * 1e-3] * rounds, [1e-3] * rounds

    monkeypatch.setattr(gates, "interleaved_times", times)
    return asked


def test_slowed_copy_fails_the_timing_gate_with_its_numbers(monkeypatch):
    key = "naive/fwd"
    base = committed(key)
    asked = _scripted_times(monkeypatch, 4 * base["time_ratio"])  # past the 3x limit, every round
    attn = _naive()
    entry = gates.measure(attn, "fwd", rounds=ROUNDS)
    fails = gates.check_time(key, attn, "fwd", entry, base)
    assert asked == [ROUNDS, 2 * ROUNDS]  # a failure is measured again, with twice the rounds
    assert len(fails) == 1, f"ratio {entry['time_ratio']:.3f} vs baseline {base['time_ratio']:.3f}"
    msg = fails[0]
    assert "time regression" in msg and "confirmed by a second measurement" in msg
    assert f"{entry['time_ratio']:.3f}" in msg and f"{gates.time_limit(key, base):.3f}" in msg


def test_a_slowdown_the_second_measurement_does_not_confirm_passes(monkeypatch):
    key = "naive/fwd"
    base = committed(key)
    attn = _naive()
    _scripted_times(monkeypatch, 4 * base["time_ratio"])
    entry = gates.measure(attn, "fwd", rounds=ROUNDS)  # a burst of load slowed the first measurement
    _scripted_times(monkeypatch, 1.2 * base["time_ratio"])  # the second one is within the limit
    assert gates.check_time(key, attn, "fwd", entry, base) == []


def test_a_ratio_within_the_limit_passes_without_a_second_measurement(monkeypatch):
    key = "naive/fwd"
    base = committed(key)
    asked = _scripted_times(monkeypatch, 2.9 * base["time_ratio"])
    entry = gates.measure(_naive(), "fwd", rounds=ROUNDS)
    assert gates.check_time(key, _naive(), "fwd", entry, base) == [] and asked == [ROUNDS]


class _VirtualClock:
    """A clock for :data:`gates.CLOCK` that moves only when told: the calls' costs are scripted."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scripted_call_path(monkeypatch, path_s: float) -> list[int]:
    """Each ``F.scaled_dot_product_attention`` call costs 1 ms and each ``AttentionVariant.forward``
    ``path_s`` more, on a virtual clock (the calls still run, untimed); returns the rounds each
    measurement asked for."""
    clock = _VirtualClock()
    monkeypatch.setattr(gates, "CLOCK", clock)
    sdpa, forward = torch.nn.functional.scaled_dot_product_attention, variants.AttentionVariant.forward

    def costly_sdpa(*args, **kwargs):
        clock.now += 1e-3
        return sdpa(*args, **kwargs)

    def costly_forward(self, *args, **kwargs):
        clock.now += path_s
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", costly_sdpa)
    monkeypatch.setattr(variants.AttentionVariant, "forward", costly_forward)
    asked: list[int] = []
    times = gates.interleaved_times
    monkeypatch.setattr(gates, "interleaved_times", lambda fn, ref, n: asked.append(n) or times(fn, ref, n))
    return asked


CALL_PATH = gates.call_path_keys()


#: how many times its baseline cost the call path (``AttentionVariant.forward``'s own work) grows in
#: the scripted slowdown each mode's gate must catch: forward+backward's call is longer, so the same
#: path is a smaller part of it (results/cpu/gate_noise/NOTES.md)
PATH_GROWTH_CAUGHT = {"fwd": 3.5, "fwd_bwd": 5.5}


@pytest.mark.parametrize("key", list(CALL_PATH), ids=list(CALL_PATH.values()))
def test_a_slower_call_path_fails_the_call_path_gate(monkeypatch, key):
    """A slowdown in ``AttentionVariant.forward`` slows every variant and the reference alike, so no
    case's ratio moves: the call-path gate, the reference against its bare torch call, fails on it."""
    mode, base = CALL_PATH[key], committed(key)
    # the baseline's path costs (ratio - 1) x the bare call; here it grows PATH_GROWTH_CAUGHT-fold (a
    # path grown 20-fold in forward still passed the cases' 3x factor)
    grown = 1 + PATH_GROWTH_CAUGHT[mode] * (base["time_ratio"] - 1)
    asked = _scripted_call_path(monkeypatch, (grown - 1) * 1e-3)
    entry = gates.measure_call_path(mode, rounds=ROUNDS)
    assert entry["time_ratio"] == pytest.approx(grown)
    (fail,) = gates.check_call_path(key, mode, entry, base)
    assert asked == [ROUNDS, 2 * ROUNDS]  # confirmed by a second measurement, as every timing case
    assert "time regression" in fail and "confirmed by a second measurement" in fail
    assert f"{gates.time_limit(key, base):.3f}" in fail and "AttentionVariant.forward" in fail


@pytest.mark.parametrize("key", list(CALL_PATH), ids=list(CALL_PATH.values()))
def test_the_call_path_gate_has_its_own_factor(key):
    """Just over ``CALL_PATH_FACTOR`` x the baseline ratio fails, just under passes (both sides), while
    a case's gate keeps ``TIME_FACTOR`` (3x) for the same numbers."""
    base = {**TIMED, "time_ratio": committed(key)["time_ratio"]}
    factor, b = gates.CALL_PATH_FACTOR, base["time_ratio"]
    assert 1 < factor < gates.TIME_FACTOR
    over, under = ({**TIMED, "time_ratio": factor * b * s} for s in (1.001, 0.999))
    (fail,) = gates.compare_time(key, over, base, labels=gates.CALL_PATH_LABELS)
    assert "time regression" in fail and f"{factor:g} x baseline ratio {b:.3f}" in fail
    assert gates.compare_time(key, under, base, labels=gates.CALL_PATH_LABELS) == []
    fell, held = ({**TIMED, "time_ratio": b / factor * s} for s in (0.999, 1.001))
    (fail,) = gates.compare_time(key, fell, base, labels=gates.CALL_PATH_LABELS)
    assert "time ratio fell" in fail and f"/ {factor:g}:" in fail
    assert gates.compare_time(key, held, base, labels=gates.CALL_PATH_LABELS) == []
    assert gates.compare_time("sdpa/fwd", over, base) == [] == gates.compare_time("sdpa/fwd", fell, base)
    assert gates.time_limit(key, base) == pytest.approx(factor * b)


@pytest.mark.parametrize("key", list(CALL_PATH), ids=list(CALL_PATH.values()))
def test_the_call_path_at_its_baseline_passes(monkeypatch, key):
    mode, base = CALL_PATH[key], committed(key)
    asked = _scripted_call_path(monkeypatch, (base["time_ratio"] - 1) * 1e-3)
    entry = gates.measure_call_path(mode, rounds=ROUNDS)
    assert entry["time_ratio"] == pytest.approx(base["time_ratio"])
    assert gates.check_call_path(key, mode, entry, base) == [] and asked == [ROUNDS]


def test_the_call_path_gate_times_the_reference_against_the_call_it_makes():
    """The bare call is the reference's own: the same backend, inputs and output, bit for bit (real
    calls, untimed)."""
    assert list(CALL_PATH.values()) == list(gates.MODES)
    for mode in gates.MODES:
        got, bare = (call() for call in gates.call_path_calls(mode))
        got, bare = (x if isinstance(x, tuple) else (x,) for x in (got, bare))
        assert len(got) == len(bare) and all(torch.equal(a, b) for a, b in zip(got, bare, strict=True))


def test_a_falling_call_path_ratio_names_the_bare_call():
    (fail,) = gates.compare_time("k", {**TIMED, "time_ratio": 0.1}, TIMED, labels=gates.CALL_PATH_LABELS)
    assert "time ratio fell: 0.100 x its bare F.scaled_dot_product_attention call" in fail
    assert "the bare call got slower" in fail and "reference 1.000 ms" in fail


def test_write_baseline_writes_the_entries_it_is_given_and_no_others(tmp_path):
    """Which old entries survive a refresh is conftest's choice (by ``baseline_keys``): the writer adds
    none from the file, call-path entries included."""
    path = tmp_path / "baseline.json"
    call_path = {k: {**TIMED, "time_ratio": 1.1} for k in CALL_PATH}
    gates.write_baseline({"naive/fwd": OK, **call_path}, path, machine={})
    gates.write_baseline({"naive/fwd": {**OK, "flops": 7}}, path, machine={})
    doc = gates.load_baseline(path)
    assert doc["entries"] == {"naive/fwd": {**OK, "flops": 7}} and doc["config"] == gates.config()


def test_a_k_refresh_keeps_the_call_path_entries_and_drops_cases_that_are_gone(monkeypatch, tmp_path):
    """``--update-baseline -k naive``: naive's entry is rewritten, every other entry of today's gates
    (a case not run, the call-path gate's) kept from the file, and an entry of a variant that no longer
    exists dropped; through conftest's hook and the real writer, on a scratch file."""
    from types import SimpleNamespace

    from benchmarks import conftest

    path = tmp_path / "baseline.json"
    call_path = {k: {**TIMED, "time_ratio": 1.1, "measured_on": "old cpu"} for k in CALL_PATH}
    old = {
        "naive/fwd": {**OK, "measured_on": "old cpu"},
        "sdpa/fwd": {**OK, "flops": 5, "measured_on": "old cpu"},
        "removed_variant/fwd": {**OK, "measured_on": "old cpu"},
        **call_path,
    }
    gates.write_baseline(old, path, machine={"cpu_model": "old cpu"})
    real_load, real_write = gates.load_baseline, gates.write_baseline
    handed: dict = {}
    monkeypatch.setattr(gates, "load_baseline", lambda p=path: real_load(p))
    monkeypatch.setattr(
        gates,
        "write_baseline",
        lambda entries, machine=None: (handed.update(entries), real_write(entries, path, machine)),
    )
    config = SimpleNamespace(
        getoption=lambda name, default=None: True,
        stash={conftest._ENTRIES: {"naive/fwd": {**OK, "flops": 7}}},
        pluginmanager=SimpleNamespace(get_plugin=lambda name: None),
    )
    conftest.pytest_sessionfinish(SimpleNamespace(config=config, testsfailed=0), 0)
    here = gates.machine_info()["cpu_model"]
    want = {"naive/fwd": {**OK, "flops": 7, "measured_on": here}, "sdpa/fwd": old["sdpa/fwd"], **call_path}
    assert handed == want  # conftest keeps the call-path entries itself
    assert real_load(path)["entries"] == want


def test_inaccurate_copy_fails_the_error_gate():
    key = "naive/fwd"
    fails = gates.compare_static(key, gates.measure_static(Inaccurate(), "fwd"), committed(key))
    assert len(fails) == 1 and "relative error" in fails[0], fails


def test_registered_copy_without_a_baseline_entry_asks_for_a_refresh(monkeypatch):
    name = "naive_slowed_for_test"
    monkeypatch.setattr(Slowed, "__module__", "variants.naive_slowed")  # as if a module of this package
    variants.register(name)(Slowed)
    try:
        keys = {c.key: c for c in gates.cases()}
        assert f"{name}/fwd" in keys and f"{name}/fwd_bwd" in keys  # the suite picks it up unasked
        case = keys[f"{name}/fwd"]
        entry = gates.measure_static(gates.build(case.name, dict(case.knobs)), case.mode)
        fails = gates.compare_static(case.key, entry, BASELINE["entries"].get(case.key))
        assert len(fails) == 1 and gates.REFRESH_COMMAND in fails[0]
    finally:
        unregister(name)
        del Slowed.name  # register() set it; inherit naive's again
    assert name not in variants.available()


def test_a_third_party_variant_is_not_held_to_this_repository_s_baseline():
    """A variant registered from another package (an entry point): this baseline cannot hold entries
    for it (a machine without the plugin could neither check nor refresh them), so the gates leave it
    to its own repository; the registry-wide correctness tests still run it."""
    name = "naive_slowed_elsewhere"
    assert Slowed.__module__.split(".")[0] != "variants"  # this test module: not the package
    variants.register(name)(Slowed)
    try:
        assert name in variants.available() and name not in variants.builtin()
        assert not [c for c in gates.cases() if c.name == name]
        assert {c.name for c in gates.cases()} == set(variants.builtin())
    finally:
        unregister(name)
        del Slowed.name


# ------------------------------------------------------------------------------ comparison rules
OK = {"status": "ok", "peak_bytes": 1_000_000, "flops": 1000, "rel_err": 1e-6}
TIMED = {
    **OK,
    "time_ratio": 1.0,
    "ratio_q1": 0.9,
    "ratio_q3": 1.1,
    "time_s": 1e-3,
    "ref_time_s": 1e-3,
    "rounds": 9,
}


@pytest.mark.parametrize(
    "change, words",
    [
        ({"peak_bytes": 1_000_000 + 10_000 + gates.MEM_ABS_TOL + 1}, "peak memory grew"),
        ({"peak_bytes": 1_000_000 - 10_000 - gates.MEM_ABS_TOL - 1}, "peak memory shrank"),
        ({"flops": 1001}, "FLOPs 1,001 vs baseline 1,000"),
        ({"rel_err": 2.1e-6}, "relative error"),
        ({"rel_err": math.nan}, "relative error"),
        ({"status": "unsupported", "reason": "gone"}, "status changed from ok"),
    ],
)
def test_each_hard_gate_fails_beyond_its_tolerance(change, words):
    fails = gates.compare_static("v/fwd", {**OK, **change}, OK)
    assert len(fails) == 1 and words in fails[0], fails


@pytest.mark.parametrize(
    "change",
    [
        {"peak_bytes": 1_000_000 + 10_000 + gates.MEM_ABS_TOL},
        {"peak_bytes": 1_000_000 - 10_000 - gates.MEM_ABS_TOL},
        {"rel_err": 2e-6},
        {"rel_err": 1e-9},  # better is fine
    ],
)
def test_hard_gates_pass_within_tolerance(change):
    assert gates.compare_static("v/fwd", {**OK, **change}, OK) == []


def test_error_floor_spares_rounding_noise():
    tiny = {**OK, "rel_err": 1e-9}
    assert gates.compare_static("v/fwd", {**OK, "rel_err": gates.ERR_FLOOR}, tiny) == []


def test_status_change_either_way_fails():
    unsupported = {"status": "unsupported", "reason": "no CPU kernel"}
    assert "status changed from unsupported" in gates.compare_static("v/fwd", OK, unsupported)[0]
    assert gates.compare_static("v/fwd", unsupported, unsupported) == []


def test_missing_entry_names_the_refresh_command():
    fails = gates.compare_static("new/fwd", OK, None)
    assert len(fails) == 1 and gates.REFRESH_COMMAND in fails[0]


def test_time_gate_is_generous_and_reports_numbers():
    assert gates.compare_time("v/fwd", {**TIMED, "time_ratio": gates.TIME_FACTOR}, TIMED) == []
    fails = gates.compare_time("v/fwd", {**TIMED, "time_ratio": gates.TIME_FACTOR + 0.5}, TIMED)
    assert len(fails) == 1
    assert f"{gates.TIME_FACTOR + 0.5:.3f}" in fails[0] and "baseline ratio 1.000" in fails[0]


def test_a_refresh_refuses_to_record_a_broken_variant():
    assert gates.unrecordable("v/fwd", OK) is None
    assert "not recorded" in gates.unrecordable("v/fwd", {**OK, "rel_err": 3.9})
    assert "not recorded" in gates.unrecordable("v/fwd", {**OK, "rel_err": float("nan")})
    assert gates.unrecordable("v/fwd", {"status": "unsupported", "reason": "r"}) is None


def test_time_gate_fails_a_ratio_that_falls_too():
    """Every ratio divides by the reference (sdpa's math path, through the same wrapper): a 10x
    slowdown of the sdpa wrapper moved sdpa's own ratio from 0.386 to 0.362 and passed, while every
    other variant's ratio fell 7.5x. A fall past the baseline / TIME_FACTOR now fails."""
    assert gates.compare_time("v/fwd", {**TIMED, "time_ratio": 1 / gates.TIME_FACTOR}, TIMED) == []
    (fail,) = gates.compare_time("v/fwd", {**TIMED, "time_ratio": 0.1}, TIMED)
    assert "time ratio fell: 0.100" in fail and "the reference got slower" in fail


def test_machine_info_hook_adds_torch_threads_cpu_and_gpu():
    from benchmarks.conftest import pytest_benchmark_update_machine_info

    info = {"node": "x"}
    pytest_benchmark_update_machine_info(None, info)
    assert info["torch_version"] == torch.__version__
    assert info["torch_threads_benchmarked"] == gates.THREADS
    assert info["cpu_model"] and "gpu" in info and info["node"] == "x"


def test_benchmark_only_is_refused_rather_than_skipping_the_gates():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "pytest", "benchmarks", "--benchmark-only", "-p", "no:cacheprovider", "-q"]
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 4, p.stdout[-2000:] + p.stderr[-2000:]  # pytest's usage error
    assert "--benchmark-only would skip the gates" in p.stderr and "--benchmark-enable" in p.stderr


@pytest.mark.parametrize("partial", [True, False], ids=["-k refresh", "full refresh"])
def test_a_partial_refresh_keeps_the_baseline_header_of_the_machine_that_wrote_it(monkeypatch, partial):
    """``-k naive`` rewrites naive's entries and keeps the others with their header; only a refresh of
    every case (or one from another CPU) writes this shell's machine details in the header."""
    from types import SimpleNamespace

    from benchmarks import conftest

    cpu = gates.machine_info()["cpu_model"]
    header = {"cpu_model": cpu, "torch_threads_default": 99}  # what a full refresh's shell had
    old = {"config": gates.config(), "machine": header, "entries": {"naive/fwd": {"status": "ok"}}}
    if not partial:
        old["entries"] = {}
    written = {}
    monkeypatch.setattr(gates, "load_baseline", lambda: old)
    monkeypatch.setattr(
        gates, "cases", lambda: [SimpleNamespace(key="naive/fwd"), SimpleNamespace(key="sdpa/fwd")]
    )
    monkeypatch.setattr(
        gates, "write_baseline", lambda entries, machine=None: written.update(e=entries, m=machine)
    )
    stash = {conftest._ENTRIES: {"sdpa/fwd": {"status": "ok"}}}
    config = SimpleNamespace(
        getoption=lambda name, default=None: True,
        stash=stash,
        pluginmanager=SimpleNamespace(get_plugin=lambda name: None),
    )
    conftest.pytest_sessionfinish(SimpleNamespace(config=config, testsfailed=0), 0)
    assert set(written["e"]) == ({"naive/fwd", "sdpa/fwd"} if partial else {"sdpa/fwd"})
    assert written["m"] == (header if partial else None)  # None: write_baseline takes this machine's
