"""Numerical error of a variant against the float64 oracle (its own pattern) and full attention.

Errors are max and mean absolute error plus the reference's scale (max absolute value), so a reader
can judge them relative to the output. For long sequences only a subset of query rows is checked:
the oracle is O(Nq * Nk) float64.
"""

from __future__ import annotations

import torch

from variants import AttentionVariant, full_attention_reference, oracle

# relative error (max abs error / output scale) above which a result is called wrong
TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 1e-2,
}


#: a row is judged against its own scale, but no less than this fraction of the whole output's: one
#: near zero by cancellation is not divided by ~0
ROW_SCALE_FLOOR = 1e-2
#: a row the float64 reference holds at zero, below this fraction of the whole scale (no average of
#: values gets there: causal rows at N=65536 are ~0.4%), is zero by structure: a query that sees no
#: key has no output, one that sees a single key no gradient (dS = P (dP - D) = 0 when P = 1). The
#: variant's rounding there (~1e-8 in float32) is judged against the whole scale: against the floor
#: it grows with N as the scale falls (sdpa's causal dq, row 0: 4.4e-5 of the floor at N=1024, B=1,
#: H=8, D=64, 3e-4 at 16384 in a check over 64 rows, over the gradient's float32 tolerance of 2e-4)
ZERO_ROW = 1e-9


def error_stats(out: torch.Tensor, ref: torch.Tensor, prefix: str) -> dict[str, float]:
    """``{prefix}_max_err``, ``_mean_err``, ``_scale``, ``_rel_err`` and ``_row_rel_err`` of ``out``
    against ``ref`` (``(..., rows, E)``).

    ``_rel_err`` is the largest error over the largest reference value. ``_row_rel_err`` is the worst
    row's largest error over that row's own largest value (at least :data:`ROW_SCALE_FLOOR` of the
    whole scale): causal attention's late rows average thousands of values and are 10-100x smaller
    than its first rows, so an error confined to them (a split-K merge dropping a block, rows left at
    zero) hides under ``_rel_err``'s whole-output scale: 7/8 of the rows zeroed at N=16384 gave
    ``_rel_err`` 0.037, within bf16's 0.05, and a ``_row_rel_err`` of 1. A row the reference holds at
    zero by structure (:data:`ZERO_ROW`) is judged against the whole scale."""
    diff = (out.double() - ref.double()).abs()
    if not diff.numel():
        return {f"{prefix}_{k}": 0.0 for k in ("max_err", "mean_err", "scale", "rel_err", "row_rel_err")}
    size = ref.abs()
    scale, mx = float(size.max()), float(diff.max())
    own = size.amax(-1)  # (..., rows)
    row_scale = torch.where(own < ZERO_ROW * scale, scale, own.clamp(min=ROW_SCALE_FLOOR * scale))
    row = float((diff.amax(-1) / row_scale).max()) if scale > 0 else mx
    return {
        f"{prefix}_max_err": mx,
        f"{prefix}_mean_err": float(diff.mean()),
        f"{prefix}_scale": scale,
        f"{prefix}_rel_err": mx / scale if scale > 0 else mx,
        f"{prefix}_row_rel_err": row,
    }


def check_rows(nq: int, limit: int) -> torch.Tensor | None:
    """Evenly spaced query rows to check (first and last included), or None for all of them."""
    if nq <= limit:
        return None
    return torch.linspace(0, nq - 1, limit).round().long().unique()


def output_accuracy(
    variant: AttentionVariant,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    kw: dict[str, object],
    max_rows: int = 256,
    also: dict[str, torch.Tensor] | None = None,
) -> dict[str, object]:
    """Error of ``out`` (the variant's output on q, k, v) against the oracle, on up to ``max_rows`` rows.

    ``also`` names other outputs for the same queries (a decoding step's, ``(B, H, Nq, Dv)``): each
    gets its own ``{name}_*`` figures against the same oracle rows. For approximate variants also the
    deviation from full attention on the same inputs.
    """
    rows = check_rows(q.shape[2], max_rows)
    with torch.no_grad():
        q64, k64, v64 = (t.detach().double() for t in (q, k, v))
        ref = oracle(variant, q64, k64, v64, rows=rows, **kw)
        got = {  # (B, H, rows, Dv) each
            name: o.detach() if rows is None else o.detach()[:, :, rows.to(o.device)]
            for name, o in {"out": out, **(also or {})}.items()
        }
        stats: dict[str, object] = {}
        for name, g in got.items():
            if g.shape != ref.shape:  # broadcasting would compare other rows than the oracle's
                raise ValueError(
                    f"the {name} output {tuple(g.shape)} does not match the oracle's {tuple(ref.shape)}"
                )
            stats.update(error_stats(g, ref, name))
        stats["checked_rows"] = int(q.shape[2] if rows is None else rows.numel())
        if not variant.exact:
            full = full_attention_reference(q64, k64, v64, rows=rows, **kw)
            stats.update(error_stats(got["out"], full, "dev_full"))
    return stats


def oracle_calls(nq: int, block: int, pattern: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """The runs of query rows ``[start, stop)`` a blocked gradient check hands the oracle, in order,
    covering all ``nq``: ``block`` rows each where a call of ``block`` rows against every key is
    what fits; over a ``pattern`` (``(Nq, Nk)``) a run doubles while its rows times the keys they
    reach stay within those ``block * Nk`` pairs. A window's rows reach few keys: at N=16384, w=128,
    where a count allows 32 rows against all keys, runs of 512 rows against their ~770; sparse's global query
    block reaches every key and keeps its runs short, its other rows share long ones. Each call also
    passes over the whole inputs' gradients, which at 32 rows a call took most of the check's time.
    ``O(Nq * Nk * log(Nq / block))`` over a pattern."""
    calls, start = [], 0
    while start < nq:
        rows = block
        if pattern is not None:
            budget = block * pattern.shape[1]
            while start + rows < nq:
                wider = min(2 * rows, nq - start)
                if wider * int(pattern[start : start + wider].any(0).sum()) > budget:
                    break
                rows = wider
        calls.append((start, min(start + rows, nq)))
        start += rows
    return calls


def oracle_gradients(
    variant: AttentionVariant,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    kw: dict[str, object],
    block: int | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], int]:
    """The float64 oracle's dq, dk and dv (shaped as ``q``, ``k``, ``v``) of its output on q, k, v
    under the upstream gradient ``grad_out`` (``(B, H, Nq, Dv)``), and how many oracle calls it took.

    ``block``: the rows a call may take against every key (None: all in one call); over a pattern,
    more where the rows reach fewer keys (:func:`oracle_calls`). Every row is computed, a call at a
    time, its gradients summed into dq, dk and dv: the same gradients as one call (each row's output
    is a function of its own), the graph held one call's. The float64 work is the same, ``O(B * H *
    pairs * D)``; a call's keys are those its rows reach (:func:`variants.oracle`), and the pattern is
    built once for all calls."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    up = grad_out.double()
    nq = q.shape[2]
    if block is None or block >= nq:
        return torch.autograd.grad(oracle(variant, q64, k64, v64, **kw), (q64, k64, v64), up), 1
    pattern = None
    if getattr(variant, "oracle_forward", None) is None:
        # (Nq, Nk), moved once: the oracle would copy it to a GPU at every call
        pattern = variant.pattern(nq, k.shape[2], bool(kw.get("causal", False))).to(q.device)
        kw = {**kw, "pattern": pattern}
    calls = oracle_calls(nq, block, pattern)
    for start, stop in calls:
        rows = torch.arange(start, stop, device=q.device)
        out = oracle(variant, q64, k64, v64, rows=rows, **kw)  # (B, H, R, Dv)
        torch.autograd.backward(out, up[:, :, rows])  # summed into q64.grad, k64.grad, v64.grad
    grads = tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in (q64, k64, v64))
    return grads, len(calls)


def gradient_accuracy(
    variant: AttentionVariant,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grads: tuple[torch.Tensor, ...],
    grad_out: torch.Tensor,
    kw: dict[str, object],
    block: int | None = None,
) -> dict[str, object]:
    """Error of the variant's gradients w.r.t. q, k, v (``grads``, of its output under ``grad_out``)
    against the float64 oracle's (:func:`oracle_gradients`, ``block`` rows a call against every key),
    and ``grad_check_calls``, how many oracle calls that took."""
    ref_grads, calls = oracle_gradients(variant, q, k, v, grad_out, kw, block)
    stats: dict[str, object] = {"grad_check_calls": calls}
    worst = worst_row = 0.0
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        s = error_stats(g, r, f"grad_{name}")
        stats.update(s)
        worst = max(worst, s[f"grad_{name}_rel_err"])
        worst_row = max(worst_row, s[f"grad_{name}_row_rel_err"])
    stats["grad_rel_err"], stats["grad_row_rel_err"] = worst, worst_row
    return stats


def within_tolerance(stats: dict[str, object], prefix: str, limit: float) -> bool:
    """Whether ``stats``' error ``{prefix}_rel_err`` and its worst row's ``{prefix}_row_rel_err``
    (:func:`error_stats`) are both within ``limit``."""
    return stats[f"{prefix}_rel_err"] <= limit and stats[f"{prefix}_row_rel_err"] <= limit


#: the gradients' check allows this many times the output's tolerance: a backward sums over keys and
#: queries and cancels in its softmax step. The committed records' worst gradient errors were 3.4e-6
#: in float32, 0.016 in bf16 (naive, N=1024) and 8e-4 in fp16, all within 1x; it was 10x, under which
#: a bf16 dV 45% off passed as valid
GRAD_TOLERANCE_FACTOR = 2


def tolerance(dtype: torch.dtype) -> float:
    """The relative error of a variant's output above which its result is called wrong."""
    return TOLERANCE.get(dtype, 1e-4)


def grad_tolerance(dtype: torch.dtype) -> float:
    """The same for its gradients (:data:`GRAD_TOLERANCE_FACTOR` times :func:`tolerance`)."""
    return GRAD_TOLERANCE_FACTOR * tolerance(dtype)
