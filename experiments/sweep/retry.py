"""The retry policy: measure a job after the machine settles, and again from the start when its
timing was unstable or the machine ran slow (its canary), keeping every attempt's figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..measure.canary import SLOW_RATIO, job_canary_ms
from ..measure.kinds import rules
from ..measure.machine_load import settle
from ..measure.spec import JobSpec
from ..records.records import read_json, write_json_atomic
from .concurrency import measuring, others_measuring
from .progress import say
from .schema import BenchConfig

#: what an earlier attempt leaves in the record: each timing figure's median, IQR, samples and
#: stability, and the machine's speed around it (the canary)
_ATTEMPT_FIELDS = ("_median_s", "_iqr_s", "_samples", "_unstable", "_cpu_per_wall", "_page_faults", "_steal")
_ATTEMPT_FIELDS += ("canary_before_ms", "canary_after_ms", "canary_ratio")


def timing_figures(figures: dict[str, Any]) -> list[str]:
    """The timing figures of a record (``fwd``, ``bwd``, ...; each has an ``_unstable`` flag), in record
    order; none for a job that times nothing (a task's training)."""
    return [k.removesuffix("_unstable") for k in figures if k.endswith("_unstable")]


def unstable_figures(figures: dict[str, Any]) -> list[str]:
    """The timing figures of a record marked unstable, in record order."""
    return [f for f in timing_figures(figures) if figures[f"{f}_unstable"]]


def canary_ratio(figures: dict[str, Any], path: Path) -> float | None:
    """The job's canary (:func:`~experiments.measure.canary.job_canary_ms`) over the fastest job canary
    of the sweep so far, this one included, which ``path`` keeps for the sweep's later jobs; None for a
    job without a canary (CUDA, or one that never ran)."""
    job = job_canary_ms(figures.get("canary_before_ms"), figures.get("canary_after_ms"))
    if job is None:
        return None
    seen = (read_json(path) or {}).get("fastest_ms")
    if seen is None or job < seen:
        seen = job
        try:
            write_json_atomic(path, {"fastest_ms": job})  # a race with a parallel job loses one update only
        except OSError as exc:  # a diagnostic: the job's record matters more than the sweep's canary file
            say(f"warning: could not write the canary file {path}: {exc}; later jobs compare with their own")
    return job / seen


def measure_with_retries(
    spec: JobSpec, conf: BenchConfig, label: str, want_roof: bool, canary_path: Path
) -> dict[str, Any]:
    """Measure one job (in its own process unless ``isolate=false``) after the machine settles; a job
    whose timing figures end ``unstable``, or whose canary ran more than ``SLOW_RATIO`` times slower than
    the sweep's fastest (``canary_ratio``), is measured again from the start, up to ``retry_unstable``
    times, in a fresh process after the machine settles again, and the last attempt is kept.

    Why again and not longer: on this project's 2-core VM a figure went unstable when the machine ran
    slower for a stretch of seconds to minutes (sparse fwd+bwd at N=4096 had more than half of its
    calls slow while its forward and backward alone, in the same job, were stable). More samples in
    the same stretch do not help; a later attempt measures the machine as it usually is. The earlier
    attempts' timing figures stay in the record (``figures.earlier_attempts``), so nothing is dropped.
    """
    from ..measure.timing import STABLE_IQR
    from .isolation import run_inline, run_isolated

    earlier: list[dict[str, Any]] = []
    roofline = None
    for attempt in range(conf.retry_unstable + 1):
        waited, busy = settle(conf.settle_s, side_by_side=lambda: others_measuring() > 0)
        if busy:
            say(f"[{label}] the machine did not go quiet in {waited:.0f} s ({busy}); measuring anyway")
        elif waited > 2:
            say(f"[{label}] waited {waited:.0f} s for the machine to go quiet")
        with measuring() as concurrent:  # other jobs measuring on this host meanwhile
            if conf.isolate:

                def alive(elapsed: float) -> None:
                    say(f"[{label}] still running: {elapsed:.0f} s (timeout_s={conf.timeout_s:g})")

                result = run_isolated(spec, conf.timeout_s, roofline=want_roof, heartbeat=alive)
            else:
                result = run_inline(spec, roofline=want_roof)
            figures = result.setdefault("figures", {})
            figures["concurrent_jobs"] = concurrent()
            figures["settle_wait_s"], figures["settle_busy"] = waited, busy
        if result.get("roofline"):  # the sweep's ceilings are measured once, by the first attempt
            roofline, want_roof = result["roofline"], False
        figures["canary_ratio"] = ratio = canary_ratio(figures, canary_path)
        why = []
        if result["status"] == "ok" and (shaky := unstable_figures(figures)):
            why.append(f"{', '.join(shaky)} unstable (IQR above {STABLE_IQR:.0%} of the median)")
        # only a job with timing figures is measured again for a slow machine (a task's accuracy does
        # not depend on its speed), and not beside other jobs of the suite (a parallel launcher: a
        # slower canary is expected there)
        timed = rules(spec.kind).timed
        alone = not figures["concurrent_jobs"]
        if result["status"] == "ok" and timed and alone and ratio is not None and ratio > SLOW_RATIO:
            why.append(f"the machine ran slow (canary {ratio:.2f}x the sweep's fastest)")
        if not why or attempt == conf.retry_unstable:
            break
        tries = f"attempt {attempt + 2} of {conf.retry_unstable + 1}"
        say(f"[{label}] {'; '.join(why)}; measuring again ({tries})")
        earlier.append({k: v for k, v in figures.items() if k.endswith(_ATTEMPT_FIELDS)})
    if roofline is not None:
        result["roofline"] = roofline
    if earlier:
        figures["earlier_attempts"] = earlier
    figures["attempts"] = len(earlier) + 1
    return result
