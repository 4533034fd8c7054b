"""One measurement job: build the variant and inputs, check correctness, time it, measure memory.

``measure(spec)`` never raises: whatever happens becomes a status (DESIGN.md: ok, unsupported,
unavailable, oom, nan, error; the parent adds killed and timeout). ``spec`` is the job's
:class:`~experiments.measure.spec.JobSpec` (from a resolved config dict:
``JobSpec.from_config(cfg)``). What runs depends on the job's kind
(:mod:`experiments.measure.kinds`): this module's :func:`measure_kernel` for a kernel job.
"""

from __future__ import annotations

import resource
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from variants import AttentionVariant, Unavailable, Unsupported, Workload

from .accuracy import grad_tolerance, gradient_accuracy, output_accuracy, tolerance, within_tolerance
from .canary import canary_ms
from .common import build_variant, check_device, check_threads, forget_compiled_code, job_threads
from .grad_budget import gradient_block
from .inputs import Inputs, make_inputs
from .kinds import rules
from .machine_load import LOADED_CORES, load_average, others_cores, snapshot
from .memory import high_water_mark_mib, peak_bytes, release_free_heap, reset_high_water_mark
from .roofline import last_level_cache_bytes
from .spec import Device, JobSpec
from .timing import TIMING_FIELDS, Timing, time_backward, time_call, time_cuda_graph

# above this, even the output check on ``accuracy_rows`` rows is skipped (only a variant's own
# formula, ``oracle_forward``, gets there: one that computes every row, or performer's features)
FULL_ORACLE_BYTES = 2 * 2**30


def _timing_fields(prefix: str, t: Timing | None) -> dict[str, float | int | None]:
    """A timing figure's fields in a record: ``<prefix>_<field>`` for each of :data:`TIMING_FIELDS`."""
    return {} if t is None else {f"{prefix}_{name}": getattr(t, name) for name in TIMING_FIELDS}


def classify(exc: BaseException) -> tuple[str, str]:
    """(status, one-line reason) for an exception raised inside a job."""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, Unsupported):
        return "unsupported", msg
    if isinstance(exc, Unavailable):
        return "unavailable", msg
    if (
        isinstance(exc, torch.OutOfMemoryError)
        or (
            isinstance(exc, (RuntimeError, MemoryError))
            and any(s in str(exc) for s in ("can't allocate memory", "out of memory", "Cannot allocate"))
        )
        or isinstance(exc, MemoryError)
    ):
        return "oom", msg
    cause = exc.__cause__ or exc.__context__
    if cause is not None and type(exc).__name__ == "InstantiationException":
        return classify(cause)
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return "error", last.splitlines()[0]


def _canary(threads: int) -> float | None:
    """:func:`~experiments.measure.canary.canary_ms`, or None when it cannot run (its 12 MiB buffers
    not allocated): the canary is a diagnostic, and :func:`measure` never raises."""
    try:
        return canary_ms(threads)
    except Exception:
        return None


def measure(spec: JobSpec, roofline: bool = False) -> dict[str, Any]:
    """Run one job; returns ``{"status", "reason", "variant", "figures"}``. Never raises.

    With ``roofline``, also measures the device's GEMM and copy ceilings for the job's dtype
    afterwards (``result["roofline"]``, see :mod:`experiments.measure.roofline`); a CUDA job adds the GPU it
    ran on as torch sees it (``result["env"]``). A CPU job's figures include the machine's speed just
    before and after it (``canary_before_ms``, ``canary_after_ms``; :mod:`experiments.measure.canary`).
    """
    result: dict[str, Any] = {"status": "ok", "reason": None, "variant": None, "figures": {}}
    t0 = time.perf_counter()
    # the machine's speed around the job (experiments.measure.canary): CPU jobs, on the job's threads
    canary_threads = job_threads(spec) if spec.device is Device.cpu else None
    canary_before = _canary(canary_threads) if canary_threads else None
    load_start, busy_start = load_average(), snapshot()
    try:
        rules(spec.kind).load("measurer")(spec, result)
    except BaseException as exc:  # the whole point: turn anything into a status
        if isinstance(exc, KeyboardInterrupt):
            raise
        result["status"], result["reason"] = classify(exc)
        if result["status"] == "error":
            result["traceback"] = traceback.format_exc(limit=8)
    result["measure_s"] = time.perf_counter() - t0  # harness overhead = job wall time - this
    # how busy the rest of the machine was: a job timed beside other work is flagged in the tables
    result["figures"]["load_avg_1m"] = load_start
    # counted from after the first call: a compiled variant's own compile workers are not "others"
    result["figures"]["others_cpu_cores"] = others_cores(result.pop("busy_start", busy_start), snapshot())
    if canary_threads:
        result["figures"]["canary_before_ms"] = canary_before
        result["figures"]["canary_after_ms"] = _canary(canary_threads)
    if spec.device is Device.cuda and torch.cuda.is_available():
        result["env"] = torch_gpu_info()
    # what the OS saw, beside the allocator's peak: the C allocator may keep freed memory (resident
    # GBs while torch's peak is MBs). Per job only in an isolated child, whose count includes torch;
    # read before the ceilings' 1.5 GiB of buffers, and in a kernel job from its timed calls on
    hwm = high_water_mark_mib()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 if hwm is None else hwm
    result["figures"]["process_max_rss_mib"] = rss
    if roofline and rules(spec.kind).roofline:
        result["roofline"] = _roofline(spec)
    return result


def _roofline(spec: JobSpec) -> dict[str, Any]:
    """The device's ceilings for the job's dtype, or ``{"error": ...}`` (never raises)."""
    from .roofline import measure_roofline

    try:
        check_device(spec.device.value)
        return measure_roofline(spec.device.value, spec.dtype.value, min_run_time=0.5)
    except Exception as exc:  # the ceiling is context for the tables, never a reason to lose a record
        return {"error": classify(exc)[1]}


def torch_gpu_info(device: int | None = None) -> dict[str, object]:
    """Name, memory and compute capability of the current CUDA device, as torch sees it.

    Initialises CUDA: call it only in a process that runs CUDA work (a CUDA job).
    """
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    return {
        "gpu_name": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "gpu_capability": f"{props.major}.{props.minor}",
        "gpu_count": torch.cuda.device_count(),
    }


def min_bytes(w: Workload, inp: Inputs) -> int:
    """Bytes one forward call must move at least: read q, K and V (``Hkv`` heads: the K/V cache of a
    decoding step) and the bias, write the output. The key padding mask (one byte per key) is left out.
    """
    elem = inp.q.element_size()
    qo = w.batch * w.heads * w.nq * (w.head_dim + w.v_head_dim)  # q read, output written
    kv = w.batch * w.hkv * w.nk * (w.head_dim + w.v_head_dim)  # the whole K and V, read once
    bias = 0 if inp.bias is None else inp.bias.numel() * inp.bias.element_size()
    return (qo + kv) * elem + bias


def precheck(spec: JobSpec, variant: AttentionVariant) -> dict[str, Any] | None:
    """A finished result if the job cannot run at all (unavailable / unsupported), else None.

    Cheap, so the parent does it before spawning a child.
    """
    try:
        check_device(spec.device.value)
        check_threads(spec)
        if rules(spec.kind).checks_workload:
            variant.check(spec.workload())
    except (Unavailable, Unsupported) as exc:
        status, reason = classify(exc)
        return {"status": status, "reason": reason, "variant": variant.describe(), "figures": {}}
    return None


def measure_kernel(spec: JobSpec, result: dict[str, Any]) -> None:
    """A kernel job: build the variant and inputs, check the output (and gradients) against the
    float64 oracle, time the mode, count FLOPs and bytes, measure peak memory; fills ``result``."""
    device = spec.device.value
    check_device(device)
    torch.set_num_threads(job_threads(spec))
    w = spec.workload()
    dtype, nq, nk, dv, backward = w.dtype, w.nq, w.nk, w.v_head_dim, w.backward
    forget_compiled_code()  # one process may run many jobs (isolate=false)
    torch.manual_seed(spec.seed)
    variant = build_variant(spec.variant).to(device=device)
    if any(True for _ in variant.parameters()):
        variant = variant.to(dtype=dtype)
    result["variant"] = variant.describe()
    variant.check(w)  # Unsupported before any work
    inp = make_inputs(
        w.batch,
        w.heads,
        nq,
        nk,
        w.head_dim,
        dv,
        dtype=dtype,
        device=device,
        padding=spec.padding,
        seed=spec.seed,
        requires_grad=backward,
        kv_heads=w.kv_heads,
        scale=spec.scale,
        bias=spec.bias,
        causal=spec.causal,
        documents=spec.documents,
    )
    q, k, v = inp.tensors()
    kw = inp.kwargs(spec.causal, spec.cross)
    fig = result["figures"]
    # only outside timed windows: the CUDA timers enqueue every repetition without waiting
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    # first call: includes compilation for compiled variants, so it is timed on its own
    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = variant(q, k, v, **kw)
    sync()
    fig["first_call_s"] = time.perf_counter() - t0
    result["busy_start"] = snapshot()  # see measure(): the machine's load is read from here on
    if variant.compiled:
        fig["compile_s"] = fig["first_call_s"]
    result["variant"] = variant.describe()  # now it knows which backend/operator ran
    if not torch.isfinite(out).all():
        result["status"], result["reason"] = "nan", "output has NaN or Inf"
        return

    # a decoding step on a prefilled state answers the same queries as the forward over the cache: its
    # output is checked against the same oracle rows (the step's own path, not only the forward's)
    step = None
    if _decodes_with_state(variant, w):
        if spec.padding:  # the padded keys are the last ones (inputs.py), the new tokens' own among them
            fig["step_skipped"] = f"padding={spec.padding}: the padded keys are the newest, no decoding step"
        elif spec.documents > 1:  # a step would carry the earlier documents' keys in its state
            fig["step_skipped"] = (
                f"documents={spec.documents}: a decoding step continues one sequence, not packed documents"
            )
        else:
            step = _step_call(variant, inp, w)

    # correctness first: figures of a wrong result are marked invalid
    check_bytes = variant.oracle_bytes(w, rows=spec.accuracy_rows)
    # the general oracle (a softmax over the checked rows) always runs, as it did before there was a
    # budget: at issue 34's GPU shape (B=4, H=16, D=128, N=65536) its float64 inputs alone are 12 GiB
    if getattr(variant, "oracle_forward", None) is not None and check_bytes > FULL_ORACLE_BYTES:
        fig["accuracy_skipped"] = (
            f"float64 oracle {check_bytes / 2**20:.0f} MiB > {FULL_ORACLE_BYTES >> 20} MiB for this length"
        )
        valid = True
    else:
        also = {} if step is None else {"step": step()[0]}  # step: (output, state after)
        fig.update(output_accuracy(variant, q, k, v, out, kw, max_rows=spec.accuracy_rows, also=also))
        valid = all(within_tolerance(fig, name, tolerance(dtype)) for name in ("out", *also))
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(spec.seed + 1))
    grad_out = grad_out.to(device=device, dtype=out.dtype)
    params = [p for p in variant.parameters() if p.requires_grad]
    inputs = [q, k, v] if backward else []
    grads = None
    if backward:
        # no retain_graph: it would keep every recompute of checkpointed variants alive (O(N^2))
        grads = torch.autograd.grad(out, inputs, grad_out)
        if not all(torch.isfinite(g).all() for g in grads):
            result["status"], result["reason"] = "nan", "gradient has NaN or Inf"
            return
        block = gradient_block(variant, w, spec.grad_check_scores)
        if isinstance(block, int):
            t_check = time.perf_counter()
            fig.update(gradient_accuracy(variant, q, k, v, grads, grad_out, kw, block=block))
            fig["grad_check_s"] = time.perf_counter() - t_check
            valid = valid and within_tolerance(fig, "grad", grad_tolerance(dtype))
        else:  # said in the record: a gradient not checked is not a gradient found right
            fig["grad_check_skipped"] = block
    fig["valid"] = bool(valid)
    if not valid:
        result["reason"] = "correctness check failed: speed and memory figures are invalid"

    # from here on the process's resident high-water mark is the calls' (process_max_rss_mib), not
    # the float64 oracle's above, whose freed buffers the C allocator would keep
    release_free_heap()
    reset_high_water_mark()

    # timing
    min_t = spec.min_run_time

    def fwd() -> torch.Tensor:
        return variant(q, k, v, **kw)

    def fwd_nograd() -> None:
        with torch.no_grad():
            fwd()

    def fwd_bwd() -> None:
        o = fwd()
        torch.autograd.grad(o, inputs + params, grad_out, allow_unused=True)

    def bwd(graph: torch.Tensor) -> None:  # backward alone, on a fresh graph each time
        torch.autograd.grad(graph, inputs + params, grad_out, allow_unused=True)

    if backward:
        fig.update(_timing_fields("fwd", time_call(fwd, device, min_t)))
        fig.update(_timing_fields("bwd", time_backward(fwd, bwd, device, min_t)))
        fig.update(_timing_fields("fwd_bwd", time_call(fwd_bwd, device, min_t)))
        measured, mode_fn = fig["fwd_bwd_median_s"], fwd_bwd
    else:
        fig.update(_timing_fields("fwd", time_call(fwd_nograd, device, min_t)))
        measured, mode_fn = fig["fwd_median_s"], fwd_nograd

    # throughput from the variant's own count of useful pairs (packed documents: those within one)
    flops = variant.flops(w, spec.mode.value)
    if spec.documents > 1:
        fig["pairs_kept"] = w.pair_share
    fig["flops"] = flops
    fig["gflops_per_s"] = flops / measured / 1e9
    fig["tokens_per_s"] = w.batch * nq / measured
    # the bytes a forward call cannot avoid moving: decoding is bound by them, not by FLOPs
    fig["min_bytes"] = min_bytes(w, inp)
    fig["bytes_per_s"] = fig["min_bytes"] / fig["fwd_median_s"]
    if device == "cpu":  # calls repeat back to back: bytes that fit in it come from the cache (CUDA's
        # timer empties its L2 before each call instead)
        fig["cache_bytes"] = last_level_cache_bytes()
    # what one decoding sequence keeps per layer: the K/V cache, or a fixed-size state
    fig["state_bytes"] = variant.state_bytes(w)
    if step is not None:
        fig.update(_timing_fields("step", time_call(step, device, min_t)))

    # peak memory above the inputs (and the kept graph, for bwd) during one call of the mode
    out = grads = None  # free the kept graph and gradients: they are not part of the next call
    fig["peak_bytes"] = peak_bytes(mode_fn, device)
    fig["peak_mib"] = fig["peak_bytes"] / 2**20
    fig["threads"] = torch.get_num_threads()

    # last: a capture that fails can leave the stream unusable for what would follow
    if device == "cuda" and not backward and spec.cuda_graph:
        graph_t, why = time_cuda_graph(fwd_nograd, min_t)
        fig.update(_timing_fields("fwd_graph", graph_t))
        if why is not None:
            fig["fwd_graph_skipped"] = why


def _decodes_with_state(variant: AttentionVariant, w: Workload) -> bool:
    """Whether the job decodes (causal, fewer queries than keys, forward) with a variant that carries
    a fixed-size state: then the decoding step is timed too (without padding), which is what such a
    variant costs per token (its forward over the cache re-reads the context, which decoding never
    does)."""
    return variant.supports_state and w.causal and w.nq < w.nk and not w.backward


def _step_call(variant: AttentionVariant, inp: Inputs, w: Workload) -> Callable[[], object]:
    """A no-argument call of one decoding step: the last ``Nq`` keys and values onto the state of the
    ``Nk - Nq`` before them (prefilled once, outside the timing); the state is not advanced, so every
    call does the same work. ``(B, H, Nq, Dv)`` out; O(state) time, independent of ``Nk``."""
    q, k, v = inp.tensors()
    ctx = w.nk - w.nq
    with torch.no_grad():
        state = variant.prefill(k[:, :, :ctx], v[:, :, :ctx], scale=w.scale, heads=w.heads)

    def step() -> object:
        with torch.no_grad():
            return variant.step(q, k[:, :, ctx:], v[:, :, ctx:], state)

    return step


def kernel_summary(figures: dict[str, Any], config: dict[str, Any]) -> str:
    """A kernel job's terminal text: the time of its mode with its IQR (and whether it was unstable or
    measured beside other work, as the tables mark it), peak memory, error against the oracle, and
    INVALID when the output failed that check."""
    key = "fwd_bwd" if config["mode"] == "fwd_bwd" else "fwd"
    bits = [f"{key} {figures[f'{key}_median_s'] * 1e3:.3g} ms (IQR {figures[f'{key}_iqr_s'] * 1e3:.2g})"]
    if figures.get(f"{key}_unstable"):
        bits[0] += " unstable"
    others, beside = figures.get("others_cpu_cores") or 0, figures.get("concurrent_jobs") or 0
    if others > LOADED_CORES or beside:
        bits[0] += f" beside other work ({others:.1f} other cores busy, {beside} other job(s) of the suite)"
    bits.append(f"peak {figures['peak_mib']:.3g} MiB")
    if "out_rel_err" in figures:
        bits.append(f"rel err {figures['out_rel_err']:.1e}")
    if not figures.get("valid", True):
        bits.append("INVALID (correctness check failed)")
    return ", ".join(bits)
