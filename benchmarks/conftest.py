"""pytest wiring of the regression benchmarks: the ``--update-baseline`` option and machine information.

Run (from the repository root; ``testpaths`` keeps this folder out of the plain unit-test run)::

    python -m pytest -q benchmarks -p no:cacheprovider --benchmark-enable
    python -m pytest -q benchmarks -p no:cacheprovider --benchmark-enable --benchmark-json=bench.json

Refresh the committed baseline after an intended change (see ``gates.REFRESH_COMMAND``)::

    python -m pytest benchmarks -p no:cacheprovider --benchmark-enable --update-baseline
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import gates

_ENTRIES = pytest.StashKey[dict[str, dict[str, Any]]]()
_GOALS = pytest.StashKey[list[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-baseline",
        action="store_true",
        default=False,
        help="measure every case and rewrite benchmarks/baseline.json instead of comparing with it",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("benchmark_only", default=False):
        # pytest-benchmark would skip every gate that does not time through its fixture (the pattern
        # gates, unsupported cases, the baseline checks) and exit 0 having gated almost nothing
        raise pytest.UsageError(
            "benchmarks/: --benchmark-only would skip the gates that do not time through "
            "pytest-benchmark's fixture; run them all with --benchmark-enable (README)"
        )
    if config.getoption("benchmark_skip", default=False):
        # pytest-benchmark would skip every case that times through its fixture, so their gates never
        # compare, and exit 0
        raise pytest.UsageError(
            "benchmarks/: --benchmark-skip would skip every gate that times through pytest-benchmark's "
            "fixture and exit 0; run them all with --benchmark-enable (README)"
        )
    config.stash[_ENTRIES] = {}
    config.stash[_GOALS] = []


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict[str, Any]) -> None:
    """Add torch version, thread counts, CPU model and GPU to pytest-benchmark's JSON ``machine_info``."""
    machine_info.update(gates.machine_info())


@pytest.fixture(scope="session")
def updating(request: pytest.FixtureRequest) -> bool:
    """True when this run refreshes the baseline rather than gating on it."""
    return bool(request.config.getoption("--update-baseline"))


@pytest.fixture(scope="session")
def baseline() -> dict[str, Any]:
    """The committed baseline document (``entries`` empty when the file does not exist yet)."""
    return gates.load_baseline()


@pytest.fixture(scope="session")
def recorded(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """Entries measured in this run, by key; written to the baseline at the end of an update run."""
    return request.config.stash[_ENTRIES]


@pytest.fixture(scope="session")
def goal_lines(request: pytest.FixtureRequest) -> list[str]:
    """Lines on goals this run tracks without gating them, printed in the terminal summary."""
    return request.config.stash[_GOALS]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Where each tracked goal stands (met or not: a goal is not a gate)."""
    lines = config.stash.get(_GOALS, [])
    if lines:
        terminalreporter.section("goals (tracked, not gated)")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In an update run, write the baseline: this run's entries plus old ones for cases not run now.

    Keeping unmeasured entries (every key of :func:`gates.baseline_keys`: the cases' and the call-path
    gate's) lets ``-k`` refresh one variant; entries of cases that no longer exist (a variant removed,
    knobs changed) are dropped. Nothing is written if a case errored.
    """
    config = session.config
    if not config.getoption("--update-baseline", default=False):
        return
    new = config.stash.get(_ENTRIES, {})
    if not new:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if session.testsfailed:
        if reporter is not None:
            reporter.write_line(f"baseline NOT written: {session.testsfailed} case(s) failed", red=True)
        return
    keys = gates.baseline_keys()
    old = gates.load_baseline()
    same_config = old.get("config") == gates.config()
    # each entry says which CPU measured it: a -k refresh adds entries from this machine beside
    # entries another one measured (time ratios to the BLAS-bound reference move with the CPU)
    before = (old.get("machine") or {}).get("cpu_model")
    kept = {
        k: {"measured_on": before, **v}
        for k, v in old.get("entries", {}).items()
        if k in keys and same_config
    }
    here = gates.machine_info()
    kept.update({k: {**v, "measured_on": here["cpu_model"]} for k, v in new.items()})
    # a partial (-k) refresh on the machine of the last full one keeps its header: the header would
    # otherwise take the refreshing shell's details (its default thread count) for every entry's
    partial = len(kept) > len(new) and before == here["cpu_model"]
    gates.write_baseline(kept, machine=old.get("machine") if partial else None)
    if reporter is not None:
        reporter.write_line(
            f"baseline written: {gates.BASELINE_PATH} ({len(new)} measured, {len(kept) - len(new)} kept)",
            green=True,
        )
