"""Regression gates: measure one variant at a fixed small CPU shape and compare with a committed baseline.

Pure functions, no pytest: ``benchmarks/test_regression.py`` runs them for every registered variant and
``tests/test_regression_gates.py`` proves they bite on deliberately degraded copies.

What is gated, and how hard:

- **Hard gates** (the figures do not depend on machine load): peak CPU allocator bytes during one call
  (``experiments.measure.memory.cpu_peak_bytes``), useful FLOPs (``variant.flops``) and the relative error
  against the float64 oracle (output, plus the gradients of q, k, v for forward+backward). Memory and
  FLOPs must match the baseline (memory within :data:`MEM_REL_TOL` + :data:`MEM_ABS_TOL`, in both
  directions, so an improvement also asks for a refresh and the baseline stays tight); the error may
  not exceed ``max(ERR_FACTOR * baseline, ERR_FLOOR)``.
- **Timing gate** (survives a noisy shared machine): the variant's time is never compared with an
  absolute figure; it is a ratio to a reference (``sdpa`` with the math backend, same mode) timed in
  the same process, interleaved round by round, and the median of the per-round ratios may not exceed
  :data:`TIME_FACTOR` x the baseline ratio, nor fall below the baseline ratio / :data:`TIME_FACTOR`
  (every ratio divides by the reference, so a slower reference, or a slowdown the variant shares with
  it, shows only as ratios that fall; a variant made 3x faster asks for a refresh, as memory does). A
  ratio outside the limits is measured once more with twice the rounds before it counts (a real
  regression fails twice; a burst of load from a neighbour rarely does). Calls are timed in process
  CPU time (:data:`CLOCK`), not wall time: on a shared machine the wall time of a millisecond call is
  mostly whether the scheduler preempted it (per-round wall ratios spread over 10x here, CPU-time
  ratios over about 20%), and preemption hits long calls more often than short ones, which biases a
  wall-clock ratio. With one intra-op thread the CPU time is the call's work; a slowdown by waiting
  (sleep, locks) is not seen, which attention kernels do not do.
- **Call-path gate**: a slowdown of the call path every variant shares (``AttentionVariant.forward``
  in ``variants/base.py``: input checks, version counters, dtype checks) slows each variant and the
  reference alike, so no ratio above moves. The reference variant's call is therefore timed, in each
  mode and in the same way (interleaved rounds, same planning, same summary, the same two-sided rule
  confirmed by a second measurement), against the bare ``torch.nn.functional.scaled_dot_product_attention``
  call it makes, pinned to the same backend the same way (:func:`bare_reference_call`); its baseline
  entries are :func:`call_path_keys`. Its factor is :data:`CALL_PATH_FACTOR`, not :data:`TIME_FACTOR`:
  the path is a small part of the call, so 3x the ratio would need the path to grow about 20x.
- **Unsupported** cases (xformers on CPU, flex backward on CPU, ...) are recorded with their reason
  and must still be unsupported: a case that starts or stops running fails until the baseline is
  refreshed, so nothing is skipped silently. A variant whose library this machine lacks
  (``Unavailable``: xformers not installed) is skipped with that reason, shown in pytest's summary.

Compiled variants: the variant is built with ``example_knobs[0]`` and, where the constructor takes a
``compile`` knob, ``compile=False`` is forced (:func:`bench_knobs`): a compile costs about 25 s per shape
here and would measure the compiler, not the kernel.

Threads are pinned to :data:`THREADS` while measuring: the CPU flash kernel's scratch buffers (hence
peak memory), the reduction order (hence the error) and the timings all depend on the thread count.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import variants
from experiments.measure.accuracy import error_stats
from experiments.measure.memory import cpu_peak_bytes
from experiments.measure.spec import DType, JobSpec, Mode
from experiments.records.environment import cpu_capability, cpu_model
from variants import AttentionVariant, Unavailable, Unsupported, Workload

# ---------------------------------------------------------------------------------------------- setup
#: (B, H, N, D) of every measurement: big enough that the timing ratio is not all Python overhead,
#: small enough that the whole suite (chunked forward+backward with its tiny example chunks takes a
#: third of it) runs in one to two minutes on two busy cores.
BATCH, HEADS, SEQ, HEAD_DIM = 1, 4, 256, 32
DTYPE = torch.float32
#: torch intra-op threads while measuring (see the module docstring)
THREADS = 1
MODES = ("fwd", "fwd_bwd")
#: the clock every call is timed with (see the module docstring: CPU time, immune to preemption)
CLOCK = time.process_time
#: the in-run timing reference: (name, knobs)
REFERENCE = ("sdpa", {"backend": "math"})
#: the baseline keys of the call-path gate start with this (then the reference's name, knobs and mode)
CALL_PATH = "call_path:"
SEED = 0

# ---------------------------------------------------------------------------------------------- tolerances
#: peak memory may move by this fraction of the baseline ...
MEM_REL_TOL = 0.01
#: ... plus this many bytes (small bookkeeping allocations of the dispatcher or autograd)
MEM_ABS_TOL = 16 * 1024
#: the relative error may grow to this multiple of the baseline ...
ERR_FACTOR = 2.0
#: ... or up to this floor (about 8 units of fp32 rounding): below it errors are rounding noise
ERR_FLOOR = 8 * torch.finfo(DTYPE).eps
#: the time ratio to the reference may grow to this multiple of the baseline ratio. Generous on purpose:
#: over 20 runs on a loaded 2-core machine (a sweep and a CPU hog beside them, load average 1.7-5.2;
#: results/cpu/gate_noise/) the largest run stayed 2.1x or more below it, the widest spread being
#: chunked's (max 1.52x its median), and a CI runner with another CPU shifts Python-bound variants
#: against the BLAS-bound reference (the baseline's AMD EPYC against an Intel Xeon: up to 1.28x). On the
#: AMD EPYC at load 4.5-15 (loaded_call_path/) chunked forward came closest: 1.90, 1.58x below it.
TIME_FACTOR = 3.0
#: the call-path gate's factor (:func:`time_factor`), in place of :data:`TIME_FACTOR`. The ratio it
#: limits is 1 + path / bare call, 1.106 forward and 1.056 forward+backward in the baseline (a path of
#: about 0.16 ms beside a 1.5 ms call): 3x would let the path grow about 20x before failing. 1.2 fails
#: a path grown 3.1x in forward (4.8x in forward+backward, where the same path is a smaller part), and
#: sits well above the noise: over 20 runs on the loaded 2-core AMD EPYC (load average 4.5-15,
#: results/cpu/gate_noise/loaded_call_path/) the ratios over the baseline stayed within 0.959-1.033
#: forward and 0.986-1.020 forward+backward; the quieter runs of 2026-11-27 (1.157-1.174 forward) are
#: 1.061 of it, and another CPU moves the ratio by a few percent (the path is a tenth of the call).
CALL_PATH_FACTOR = 1.2
#: a baseline refresh refuses to record a relative error above this (every case's error is below 4e-6
#: here): the error gate is relative to the baseline, so a broken variant recorded once would pass after
UPDATE_ERR_CEILING = 1e-4

# ---------------------------------------------------------------------------------------------- timing plan
#: CPU seconds one case aims to spend in timed rounds (variant + reference together)
TIME_BUDGET_S = 1.5
MIN_ROUNDS = 5
MAX_ROUNDS = 200

BASELINE_PATH = Path(__file__).with_name("baseline.json")
#: the one command that rewrites :data:`BASELINE_PATH` (run from the repository root)
REFRESH_COMMAND = "python -m pytest benchmarks -p no:cacheprovider --benchmark-enable --update-baseline"


# ---------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One benchmarked configuration: a variant with fixed knobs, in one mode ('fwd' or 'fwd_bwd')."""

    name: str
    knobs: tuple[tuple[str, object], ...]
    mode: str

    @property
    def key(self) -> str:
        """Baseline key, e.g. ``local_window-window=3-block=4/fwd``."""
        return self.name + "".join(f"-{k}={v}" for k, v in self.knobs) + "/" + self.mode

    @property
    def id(self) -> str:
        """Test id, e.g. ``local_window-fwd``: :func:`cases` has one case per variant and mode. Short,
        so pytest-benchmark's table (with pyproject's four columns) fits 120 columns; the knobs are
        in :attr:`key`."""
        return f"{self.name}-{self.mode}"


def bench_knobs(name: str) -> dict[str, object]:
    """Knobs a variant is benchmarked with: its first ``example_knobs``, never compiled."""
    knobs = dict(variants.get(name).example_knobs[0])
    if "compile" in inspect.signature(variants.get(name).__init__).parameters:
        knobs["compile"] = False  # compile time (~25 s per shape on this CPU) is not what is gated
    return knobs


def cases() -> list[Case]:
    """Every variant this repository ships (:func:`variants.builtin`) in every mode, with
    :func:`bench_knobs`. A third party's variant, installed by entry point, is not held to this
    repository's baseline: a machine without it could not refresh or check its entries."""
    return [
        Case(name, tuple(bench_knobs(name).items()), mode) for name in variants.builtin() for mode in MODES
    ]


def build(name: str, knobs: dict[str, object]) -> AttentionVariant:
    """The variant with its knobs; learned parameters are the same in every run."""
    torch.manual_seed(SEED + 1)
    return variants.build(name, heads=HEADS, head_dim=HEAD_DIM, **knobs)


def reference() -> AttentionVariant:
    """The timing reference variant."""
    name, knobs = REFERENCE
    return build(name, dict(knobs))


@contextlib.contextmanager
def pinned_threads(n: int = THREADS) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, restoring the previous count after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Inputs:
    """q, k, v ``(B, H, N, D)`` and the gradient fed to the output in forward+backward."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor


def make_inputs(mode: str) -> Inputs:
    """Seeded inputs (drawn in float64, then cast, so every dtype sees the same numbers)."""
    g = torch.Generator().manual_seed(SEED)
    shape = (BATCH, HEADS, SEQ, HEAD_DIM)
    q, k, v, go = (torch.randn(shape, generator=g, dtype=torch.float64).to(DTYPE) for _ in range(4))
    if mode == "fwd_bwd":
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return Inputs(q, k, v, go)


def causal_only(attn: AttentionVariant) -> bool:
    """Whether ``attn`` runs only causally (retention): its cases, and their timing reference, are
    causal; every other case is plain non-causal self-attention."""
    return not type(attn).supports_noncausal


def workload(mode: str, causal: bool = False) -> Workload:
    """The workload every case runs (self-attention, no masks; ``causal`` for a causal-only variant),
    as a sweep job would build it."""
    return JobSpec(
        variant={},
        batch=BATCH,
        heads=HEADS,
        seq_len=SEQ,
        head_dim=HEAD_DIM,
        dtype=DType(str(DTYPE)[6:]),
        mode=Mode(mode),
        causal=causal,
    ).workload()


def make_call(
    attn: AttentionVariant, mode: str, inputs: Inputs | None = None, causal: bool = False
) -> Callable[[], Any]:
    """A no-argument callable running one forward (no autograd) or forward+backward of ``attn``.

    Forward+backward returns the gradients of q, k, v and of the variant's parameters (a training step
    computes those too).
    """
    x = inputs or make_inputs(mode)
    if mode == "fwd":

        def fwd() -> torch.Tensor:
            with torch.no_grad():
                return attn(x.q, x.k, x.v, causal=causal)

        return fwd
    if mode != "fwd_bwd":
        raise ValueError(f"mode must be one of {MODES}, got '{mode}'")
    params = [p for p in attn.parameters() if p.requires_grad]

    def fwd_bwd() -> tuple[torch.Tensor, ...]:
        out = attn(x.q, x.k, x.v, causal=causal)
        return torch.autograd.grad(out, [x.q, x.k, x.v, *params], x.grad_out)

    return fwd_bwd


# ---------------------------------------------------------------------------------------------- measuring
def rel_error(attn: AttentionVariant, mode: str) -> float:
    """Worst relative error (max abs error / reference scale) against the float64 oracle.

    Forward: the output. Forward+backward: the output and the gradients of q, k, v.
    """
    x = make_inputs(mode)
    causal = causal_only(attn)
    q64, k64, v64 = (t.detach().double().requires_grad_(mode == "fwd_bwd") for t in (x.q, x.k, x.v))
    with pinned_threads(), torch.set_grad_enabled(mode == "fwd_bwd"):
        out = attn(x.q, x.k, x.v, causal=causal)
        ref = variants.oracle(attn, q64, k64, v64, causal=causal)
    pairs = [(out.detach(), ref.detach())]
    if mode == "fwd_bwd":
        with pinned_threads():
            grads = torch.autograd.grad(out, (x.q, x.k, x.v), x.grad_out)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), x.grad_out.double())
        pairs += zip(grads, ref_grads, strict=True)
    return max(error_stats(got, want, "e")["e_rel_err"] for got, want in pairs)


def measure_static(attn: AttentionVariant, mode: str) -> dict[str, Any]:
    """The load-independent figures: ``{status, peak_bytes, flops, rel_err}`` or ``{status, reason}``.

    Unsupported is what :meth:`AttentionVariant.check` says, or an :class:`Unsupported` raised by the
    first call (some variants only find out inside: a length that fits no grid, a kernel that refuses
    the input). That first call also warms caches (block masks, dispatch choices) up, so the memory
    measured is the steady state of a call, not its one-time setup.
    """
    causal = causal_only(attn)
    fn = make_call(attn, mode, causal=causal)
    try:
        attn.check(workload(mode, causal))
        with pinned_threads():
            fn()
    except Unsupported as exc:
        return {"status": "unsupported", "reason": str(exc)}
    except Unavailable as exc:  # a library this machine lacks: no figure to hold anyone to
        return {"status": "unavailable", "reason": str(exc)}
    with pinned_threads():
        peak = cpu_peak_bytes(fn)
    return {
        "status": "ok",
        "peak_bytes": peak,
        "flops": attn.flops(workload(mode, causal), mode),
        "rel_err": rel_error(attn, mode),
    }


def plan_rounds(fn: Callable[[], Any], ref: Callable[[], Any], budget_s: float = TIME_BUDGET_S) -> int:
    """Warm both up and return how many interleaved rounds fill ``budget_s`` (within the round limits)."""
    with pinned_threads():
        fn(), ref()  # first calls pay one-time costs (caches, lazy imports); not timed
        t0 = CLOCK()
        fn()
        ref()
        per_round = max(CLOCK() - t0, 1e-6)
    return int(min(MAX_ROUNDS, max(MIN_ROUNDS, budget_s / per_round)))


def interleaved_times(
    fn: Callable[[], Any], ref: Callable[[], Any], rounds: int
) -> tuple[list[float], list[float]]:
    """Seconds per call of ``fn`` and ``ref``, alternating one call each per round.

    Alternating keeps both under the same load: a neighbour's burst that slows one call of the pair
    mostly slows the other too, and the median of per-round ratios drops the rounds where it did not.
    The order flips every round so neither always runs with a warmer cache.
    """
    fn_times: list[float] = []
    ref_times: list[float] = []
    with pinned_threads():
        for i in range(rounds):
            for which in (fn, ref) if i % 2 else (ref, fn):
                t = CLOCK()
                which()
                (fn_times if which is fn else ref_times).append(CLOCK() - t)
    return fn_times, ref_times


def summarize_times(fn_times: list[float], ref_times: list[float]) -> dict[str, Any]:
    """``time_ratio`` (median of per-round ratios), its quartiles and both medians (CPU seconds per call)."""
    ratios = sorted(f / r for f, r in zip(fn_times, ref_times, strict=True))
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "time_ratio": statistics.median(ratios),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "time_s": statistics.median(fn_times),
        "ref_time_s": statistics.median(ref_times),
        "rounds": len(ratios),
    }


def bare_reference_call(mode: str, inputs: Inputs | None = None) -> Callable[[], Any]:
    """:func:`make_call` for the bare ``F.scaled_dot_product_attention`` call that :func:`reference`
    makes at this shape (no mask, not causal), its backend pinned as the variant pins it: an
    ``sdpa_kernel`` context around each call (variants/sdpa.py ``_backend_context``). The same
    output as the reference's, bit for bit, without ``AttentionVariant.forward`` around it."""
    from torch.nn.attention import sdpa_kernel

    from variants.sdpa import BACKENDS

    backend = BACKENDS[REFERENCE[1]["backend"]]
    x = inputs or make_inputs(mode)
    if mode == "fwd":

        def fwd() -> torch.Tensor:
            with torch.no_grad(), sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(x.q, x.k, x.v)

        return fwd
    if mode != "fwd_bwd":
        raise ValueError(f"mode must be one of {MODES}, got '{mode}'")

    def fwd_bwd() -> tuple[torch.Tensor, ...]:
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(x.q, x.k, x.v)
        return torch.autograd.grad(out, [x.q, x.k, x.v], x.grad_out)

    return fwd_bwd


def call_path_keys() -> dict[str, str]:
    """The call-path gate's baseline keys, with their modes: ``call_path:sdpa-backend=math/fwd``, ..."""
    ref = Case(REFERENCE[0], tuple(REFERENCE[1].items()), "")
    return {CALL_PATH + ref.key + mode: mode for mode in MODES}


def baseline_keys() -> set[str]:
    """Every key a baseline for today's gates holds: each case's (:func:`cases`) and the call-path
    gate's (:func:`call_path_keys`). A refresh keeps old entries by it; any other key is stale."""
    return {c.key for c in cases()} | set(call_path_keys())


def call_path_calls(mode: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The calls the call-path gate alternates: :func:`reference` through ``AttentionVariant.forward``,
    and :func:`bare_reference_call`, which its ratios divide by."""
    return make_call(reference(), mode), bare_reference_call(mode)


def measure_call_path(mode: str, rounds: int | None = None) -> dict[str, Any]:
    """The call-path gate's entry: the reference's time ratio to its bare torch call, as
    :func:`measure_time` measures a variant's (``time_s`` the reference's, ``ref_time_s`` the bare
    call's)."""
    return {"status": "ok", **time_pair(*call_path_calls(mode), rounds)}


def timed_calls(attn: AttentionVariant, mode: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The calls a case's timing alternates: ``attn`` and :func:`reference`, doing the same kind of
    attention (both causal for a causal-only variant)."""
    causal = causal_only(attn)
    return make_call(attn, mode, causal=causal), make_call(reference(), mode, causal=causal)


def measure_time(attn: AttentionVariant, mode: str, rounds: int | None = None) -> dict[str, Any]:
    """Time ratio of ``attn`` to :func:`reference` in ``mode``, interleaved (see :func:`summarize_times`)."""
    return time_pair(*timed_calls(attn, mode), rounds)


def time_pair(fn: Callable[[], Any], ref: Callable[[], Any], rounds: int | None = None) -> dict[str, Any]:
    """:func:`summarize_times` of ``fn`` against ``ref``, interleaved over ``rounds`` (default:
    :func:`plan_rounds`)."""
    n = plan_rounds(fn, ref) if rounds is None else rounds
    return summarize_times(*interleaved_times(fn, ref, n))


def measure(attn: AttentionVariant, mode: str, rounds: int | None = None) -> dict[str, Any]:
    """Every figure a baseline entry holds: :func:`measure_static` plus :func:`measure_time` when it runs."""
    entry = measure_static(attn, mode)
    if entry["status"] == "ok":
        entry.update(measure_time(attn, mode, rounds))
    return entry


# ---------------------------------------------------------------------------------------------- comparing
def missing_message(key: str) -> str:
    """The failure for a case the baseline does not know (a new variant, new knobs or a new mode)."""
    return (
        f"{key}: no baseline entry (a new variant or changed example_knobs?). If the change is intended, "
        f"refresh the baseline with `{REFRESH_COMMAND}` and commit benchmarks/baseline.json"
    )


def compare_static(key: str, entry: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    """Failures (with numbers) of the hard gates and the supported/unsupported status; [] if all hold."""
    if base is None:
        return [missing_message(key)]
    hint = f"if intended, refresh with `{REFRESH_COMMAND}`"
    if entry["status"] != base["status"]:
        now = entry.get("reason", "it runs") if entry["status"] == "unsupported" else "it runs"
        was = base.get("reason", "it ran") if base["status"] == "unsupported" else "it ran"
        return [f"{key}: status changed from {base['status']} ({was}) to {entry['status']} ({now}); {hint}"]
    if entry["status"] != "ok":
        return []
    fails = []
    mem, mem0 = entry["peak_bytes"], base["peak_bytes"]
    mem_tol = MEM_REL_TOL * mem0 + MEM_ABS_TOL
    if abs(mem - mem0) > mem_tol:
        word = "grew" if mem > mem0 else "shrank"
        fails.append(
            f"{key}: peak memory {word}: {mem:,} B vs baseline {mem0:,} B ({mem - mem0:+,} B, "
            f"{(mem - mem0) / max(mem0, 1):+.1%}; tolerance +/-{mem_tol:,.0f} B); {hint}"
        )
    if entry["flops"] != base["flops"]:
        fails.append(f"{key}: FLOPs {entry['flops']:,} vs baseline {base['flops']:,} (must be equal); {hint}")
    err_limit = max(ERR_FACTOR * base["rel_err"], ERR_FLOOR)
    if not entry["rel_err"] <= err_limit:  # 'not <=' so a NaN error fails too
        fails.append(
            f"{key}: relative error vs float64 oracle {entry['rel_err']:.3e} > limit {err_limit:.3e} "
            f"(baseline {base['rel_err']:.3e}, limit = max({ERR_FACTOR:g} x baseline, {ERR_FLOOR:.2e}))"
        )
    return fails


def unrecordable(key: str, entry: dict[str, Any]) -> str | None:
    """Why a baseline refresh must not record ``entry`` (its error above :data:`UPDATE_ERR_CEILING`,
    or NaN), else None: the error gate is relative to the baseline, so a broken variant recorded once
    would pass from then on (a 3.9 error refreshed, then passed)."""
    if entry.get("status") == "ok" and not entry["rel_err"] <= UPDATE_ERR_CEILING:
        return (
            f"{key}: relative error vs float64 oracle {entry['rel_err']:.3e} > {UPDATE_ERR_CEILING:.0e}: not "
            "recorded (the baseline would hold a broken variant's error as its limit); fix the variant first"
        )
    return None


def time_factor(key: str) -> float:
    """The timing rule's factor for a baseline key: :data:`CALL_PATH_FACTOR` for the call-path gate's
    keys (:data:`CALL_PATH`), :data:`TIME_FACTOR` for every case."""
    return CALL_PATH_FACTOR if key.startswith(CALL_PATH) else TIME_FACTOR


def time_limit(key: str, base: dict[str, Any]) -> float:
    """Largest time ratio that passes for the baseline entry ``base`` of ``key``."""
    return time_factor(key) * base["time_ratio"]


#: how a timing failure names its two calls: the timed one, the one its ratio divides by, and that
#: one in full
CASE_LABELS = ("variant", "reference", f"reference {REFERENCE[0]}{REFERENCE[1]}")
CALL_PATH_LABELS = (
    "reference",
    "bare call",
    f"its bare F.scaled_dot_product_attention call ({REFERENCE[1]['backend']} backend)",
)


def compare_time(
    key: str,
    entry: dict[str, Any],
    base: dict[str, Any] | None,
    labels: tuple[str, str, str] = CASE_LABELS,
) -> list[str]:
    """The timing-gate failure (with its numbers) or []; only for entries that ran in both. ``labels``
    name the two calls (:data:`CASE_LABELS`, :data:`CALL_PATH_LABELS`)."""
    if base is None or entry.get("status") != "ok" or base.get("status") != "ok":
        return []
    timed, ref, ref_in_full = labels
    factor = time_factor(key)
    limit = time_limit(key, base)
    low = base["time_ratio"] / factor
    if entry["time_ratio"] < low:
        return [
            f"{key}: time ratio fell: {entry['time_ratio']:.3f} x {ref_in_full} "
            f"({timed} {entry['time_s'] * 1e3:.3f} ms, {ref} {entry['ref_time_s'] * 1e3:.3f} ms CPU) < "
            f"{low:.3f} = baseline ratio {base['time_ratio']:.3f} / {factor:g}: the {ref} got "
            f"slower (a slowdown it shares with the {timed} cancels in the ratio), or the {timed} over "
            f"{factor:g}x faster: then refresh its baseline"
        ]
    if entry["time_ratio"] <= limit:
        return []
    return [
        f"{key}: time regression: {entry['time_ratio']:.3f} x {ref_in_full} "
        f"(per-round quartiles {entry['ratio_q1']:.3f}-{entry['ratio_q3']:.3f}, {entry['rounds']} rounds; "
        f"{timed} {entry['time_s'] * 1e3:.3f} ms, {ref} {entry['ref_time_s'] * 1e3:.3f} ms CPU) > limit "
        f"{limit:.3f} = {factor:g} x baseline ratio {base['time_ratio']:.3f} (run-to-run spread on a "
        f"loaded machine: results/cpu/gate_noise/NOTES.md)"
    ]


def check_time(
    key: str, attn: AttentionVariant, mode: str, entry: dict[str, Any], base: dict[str, Any] | None
) -> list[str]:
    """:func:`compare_time`, confirming a failure with a second measurement of twice the rounds.

    A failure is returned only when both measurements exceed the limit; the message has both.
    """
    return confirmed_time(key, entry, base, lambda rounds: measure_time(attn, mode, rounds))


def check_call_path(key: str, mode: str, entry: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    """:func:`check_time` for the call-path gate (``entry`` from :func:`measure_call_path`)."""
    fails = confirmed_time(
        key, entry, base, lambda rounds: measure_call_path(mode, rounds), labels=CALL_PATH_LABELS
    )
    return [
        f + ". The call path every variant shares (AttentionVariant.forward, variants/base.py) or sdpa's "
        "wrapper changed speed: each variant's ratio to the reference hides that"
        for f in fails
    ]


def confirmed_time(
    key: str,
    entry: dict[str, Any],
    base: dict[str, Any] | None,
    remeasure: Callable[[int], dict[str, Any]],
    labels: tuple[str, str, str] = CASE_LABELS,
) -> list[str]:
    """:func:`compare_time`, and when it fails, again on ``remeasure(rounds)`` (twice the rounds): the
    failure only when both fail, with both measurements' numbers."""
    first = compare_time(key, entry, base, labels)
    if not first:
        return []
    again = {**entry, **remeasure(max(2 * entry["rounds"], MIN_ROUNDS))}
    second = compare_time(key, again, base, labels)
    if not second:
        return []
    return [first[0] + "; confirmed by a second measurement: " + second[0].split(": ", 1)[1]]


# ---------------------------------------------------------------------------------------------- baseline file
def config() -> dict[str, Any]:
    """The measurement settings a baseline is valid for; a baseline with others must be refreshed."""
    return {
        "shape": {"batch": BATCH, "heads": HEADS, "seq": SEQ, "head_dim": HEAD_DIM},
        "dtype": str(DTYPE).replace("torch.", ""),
        "threads": THREADS,
        "reference": {"name": REFERENCE[0], "knobs": REFERENCE[1]},
        "modes": list(MODES),
    }


def machine_info() -> dict[str, Any]:
    """torch version, thread counts, CPU model and GPU of this machine (pytest-benchmark JSON, baseline)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "torch_version": torch.__version__,
        "torch_threads_benchmarked": THREADS,
        "torch_threads_default": torch.get_num_threads(),
        "cpu_model": cpu_model(),
        "cpu_capability": cpu_capability(),
        "cpu_count": os.cpu_count(),
        "gpu": gpu,
        "cuda_version": torch.version.cuda,
    }


def load_baseline(path: Path = BASELINE_PATH) -> dict[str, Any]:
    """The committed baseline: ``{"config", "machine", "entries": {key: entry}}`` (empty if absent)."""
    if not path.exists():
        return {"config": None, "machine": None, "entries": {}}
    with open(path) as f:
        return json.load(f)


def write_baseline(
    entries: dict[str, dict[str, Any]], path: Path = BASELINE_PATH, machine: dict[str, Any] | None = None
) -> None:
    """Write ``entries``, and nothing else, as the baseline for the current :func:`config`, atomically,
    keys sorted; ``machine`` is the machine of this write unless given, each entry's ``measured_on``
    the CPU that measured it. Which old entries a ``-k`` refresh keeps is conftest's choice
    (by :func:`baseline_keys`)."""
    doc = {
        "refresh_command": REFRESH_COMMAND,
        "config": config(),
        "machine": machine or machine_info(),
        "entries": {k: entries[k] for k in sorted(entries)},
    }
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
