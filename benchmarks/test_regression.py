"""Regression benchmarks: every registered variant, forward and forward+backward, against the baseline.

One test per (variant, mode) at the fixed small CPU shape of :mod:`benchmarks.gates`. Hard gates on peak
memory, FLOPs and error against the float64 oracle; a timing gate on the time ratio to ``sdpa`` (math
backend) measured in the same run, interleaved. With ``--benchmark-enable`` the variant's calls are
timed by pytest-benchmark (``benchmark.pedantic``, the reference call timed in its ``setup`` between
rounds, both in process CPU time), so its JSON holds the variant's statistics and, in ``extra_info``,
every gated figure; with the benchmark plugin disabled the same interleaving runs without it.

A new variant is covered with no edit here, and fails until the baseline is refreshed
(``gates.REFRESH_COMMAND``). ``test_call_path`` gates, per mode, the reference's own call against its
bare torch call: the one slowdown the ratios to the reference cannot see, that of the call path they
all share.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import gates

CASES = gates.cases()
#: the cases by key: tests are parametrized by the key (a string), so pytest-benchmark's saved JSON
#: holds a readable parameter rather than an unserializable object
BY_KEY = {c.key: c for c in CASES}


def _benchmark_times(benchmark: Any, fn: Any, ref: Any, rounds: int) -> tuple[list[float], list[float]]:
    """Time ``rounds`` calls of ``fn`` with pytest-benchmark, one timed ``ref`` call before each."""
    ref_times: list[float] = []

    def timed_reference() -> None:  # pedantic's setup: runs before every round, outside its timer
        t = gates.CLOCK()
        ref()
        ref_times.append(gates.CLOCK() - t)

    with gates.pinned_threads():
        benchmark.pedantic(fn, setup=timed_reference, rounds=rounds, warmup_rounds=0, iterations=1)
    return list(benchmark.stats.stats.data), ref_times


# the reference is timed with gates.CLOCK in pedantic's setup; the variant must be timed with the same
@pytest.mark.benchmark(timer=gates.CLOCK)
@pytest.mark.parametrize("key", list(BY_KEY), ids=[c.id for c in BY_KEY.values()])
def test_regression(key: str, request: pytest.FixtureRequest, baseline, recorded, updating) -> None:
    case = BY_KEY[key]
    attn = gates.build(case.name, dict(case.knobs))
    entry = gates.measure_static(attn, case.mode)
    if entry["status"] == "unavailable" and not updating:
        pytest.skip(f"{case.key}: {entry['reason']}")
    if entry["status"] == "ok":
        fn, ref = gates.timed_calls(attn, case.mode)
        rounds = gates.plan_rounds(fn, ref)
        if updating:  # the baseline ratio is what later runs are held to: measure it longer
            rounds *= 2
        # asked for only here: an unsupported case has nothing to time, and an unused fixture warns
        benchmark = request.getfixturevalue("benchmark")
        if benchmark.disabled:  # a disabled fixture calls its target once: let that be the whole loop
            times = benchmark.pedantic(gates.interleaved_times, args=(fn, ref, rounds))
        else:
            benchmark.group = case.mode
            times = _benchmark_times(benchmark, fn, ref, rounds)
        entry.update(gates.summarize_times(*times))
        benchmark.extra_info.update({"key": case.key, **entry})
    if updating:
        if refused := gates.unrecordable(case.key, entry):
            pytest.fail(refused, pytrace=False)
        recorded[case.key] = entry
        return
    base = baseline["entries"].get(case.key)
    fails = gates.compare_static(case.key, entry, base)
    if not fails:
        fails = gates.check_time(case.key, attn, case.mode, entry, base)
    if fails:
        pytest.fail("\n".join(fails), pytrace=False)


#: the call-path gate's baseline keys and their modes
CALL_PATH = gates.call_path_keys()


@pytest.mark.parametrize("key", list(CALL_PATH), ids=[f"call_path-{m}" for m in CALL_PATH.values()])
def test_call_path(key: str, baseline, recorded, updating) -> None:
    """The reference variant's call against its bare torch call, timed as every case is (the gate
    functions without pytest-benchmark, as with the plugin disabled). Each case's ratio divides by the
    reference, so a slowdown of the call path that every variant and the reference share
    (``AttentionVariant.forward``) moves no case: it moves this ratio."""
    mode = CALL_PATH[key]
    fn, ref = gates.call_path_calls(mode)
    rounds = gates.plan_rounds(fn, ref)
    if updating:  # the baseline ratio is what later runs are held to: measure it longer
        rounds *= 2
    entry = {"status": "ok", **gates.time_pair(fn, ref, rounds)}
    if updating:
        recorded[key] = entry
        return
    base = baseline["entries"].get(key)
    fails = [gates.missing_message(key)] if base is None else gates.check_call_path(key, mode, entry, base)
    if fails:
        pytest.fail("\n".join(fails), pytrace=False)


def test_baseline_settings_match(baseline, updating) -> None:
    """The committed baseline was measured with today's shape, dtype, threads and reference."""
    if updating:
        pytest.skip("the baseline is being rewritten")
    assert baseline["config"] == gates.config(), (
        f"benchmarks/baseline.json was measured with {baseline['config']}, the gates now use "
        f"{gates.config()}; refresh with `{gates.REFRESH_COMMAND}`"
    )


def test_baseline_has_no_stale_entries(baseline, updating) -> None:
    """Every baseline entry is a case that still exists (a removed variant or new knobs need a refresh)."""
    if updating:
        pytest.skip("the baseline is being rewritten")
    stale = sorted(set(baseline["entries"]) - gates.baseline_keys())
    assert not stale, f"baseline entries for cases that no longer exist: {stale}; refresh with " + (
        f"`{gates.REFRESH_COMMAND}`"
    )
