"""The kernelized-attention core that ``linear``, ``performer`` and ``retention`` share.

All three compute, for query ``i`` at position ``t_i``,

    out_i = sum_{j visible to i} exp(l_j - r_{t_i}) (qf_i . kf_j) v_j                        (*)

with feature vectors ``qf (F,)``, ``kf (F,)`` (the variant's feature maps; ``F`` features), values
``v (E,)`` (a normalised variant appends a column of ones, so the last output column is the
denominator) and optional log weights: ``l_j`` per key and a reference ``r_t`` per position, with
``l_j <= r_t`` whenever key ``j`` is visible at position ``t``, so every weight is at most 1.

- ``linear``: no weights (``l = r = 0``).
- ``retention``: ``l_j = j lambda_h``, ``r_t = t lambda_h`` with ``lambda_h = -log gamma_h``, so the
  weight is ``gamma_h^(t - j)``, the decay.
- ``performer``: ``l_j`` is key ``j``'s own log scale (its features are stored divided by it, so none
  overflows) and ``r_t`` the running maximum of ``l`` up to ``t``: a stabiliser that cancels in the
  normalised ratio and reads no future key, so causal outputs and the decoding state never see one.

The sums run through a state ``kv (F, E) = sum_j exp(l_j - ref) kf_j v_j^T`` held relative to one
reference ``ref``: its size is independent of ``N``. Non-causal: one pass builds it, each query reads
it (:func:`global_attention`, ``O(N F E)``). Causal: the chunked form (:func:`causal_attention`): within
a chunk of ``c`` positions the ``(c, c)`` products (quadratic in ``c`` only), across chunks the state
carried from the chunks before, ``O(N c (F + E) + N F E)`` time, never an ``N x N`` tensor. A key
excluded by padding has ``kf = 0`` and ``l = -inf``: it is in no sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as fn

from .base import AttentionVariant, Unsupported, Workload, repeat_kv
from .masks import document_starts

NEG_INF = float("-inf")


@dataclass
class KernelState:
    """What a kernelized variant keeps while decoding, for ``B`` sequences and ``Hs`` heads of state:
    the ``H`` query heads, or the ``Hkv`` K/V heads where a group's query heads share one
    (:attr:`KernelizedAttention.native_gqa`). Its size does not depend on how many positions it has
    consumed.
    """

    kv: torch.Tensor  # (B, Hs, F, E): sum_j exp(l_j - ref) kf_j [v_j, 1]^T
    ref: torch.Tensor | None  # (B|1, Hs): the log reference of kv; None where there are no weights
    length: int  # positions consumed, padded ones included (they still take a position)
    scale: float  # the score scale, fixed at prefill

    def bytes_per_sequence(self) -> int:
        """Bytes of one sequence's share of the state (what :meth:`state_bytes` predicts)."""
        ref = 0 if self.ref is None else self.ref[:1].nbytes
        return self.kv[:1].nbytes + ref


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the sums run in: float32 for 16-bit inputs (a state summed over thousands of keys
    in bf16 would lose the small terms), the input's own otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def refuse_pairwise(who: str, w: Workload) -> None:
    """Raise :class:`Unsupported` for what needs the ``(Nq, Nk)`` scores the family never forms."""
    if w.attn_mask:
        raise Unsupported(
            f"{who} never forms the (Nq, Nk) scores, so an arbitrary attn_mask cannot be applied "
            "(key padding and causal can)"
        )
    if w.bias:
        raise Unsupported(f"{who} never forms the (Nq, Nk) scores a bias would be added to")


def _weight(log_diff: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp(log_diff)`` in ``dtype``; NaN (``-inf - -inf``: no real key yet, the sum it scales is
    zero) counts as ``-inf``, weight 0. The log weights carry no gradient, so neither does this."""
    return torch.exp(torch.where(log_diff.isnan(), NEG_INF, log_diff)).to(dtype)


def absorb(
    kf: torch.Tensor,
    v: torch.Tensor,
    log_k: torch.Tensor | None,
    ref_end: torch.Tensor | None,
    kv0: torch.Tensor | None,
    ref0: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The state after keys ``kf (B, H, N, F)``, ``v (B, H, N, E)`` (log weights ``log_k (B|1, H, N)``)
    are added to ``kv0 (B, H, F, E)`` (reference ``ref0 (B|1, H)``; None: empty), held relative to
    ``ref_end (B|1, H)``: ``exp(ref0 - ref_end) kv0 + sum_j exp(l_j - ref_end) kf_j v_j^T``.
    ``O(N F E)``; returns ``(kv, ref_end)``."""
    if log_k is not None:
        w = _weight(log_k - ref_end[..., None], kf.dtype)  # (B|1, H, N)
        kf = kf * w[..., None]  # (B, H, N, F)
    kv = kf.transpose(-1, -2) @ v  # (B, H, F, E)
    if kv0 is not None:
        carry = 1.0 if ref0 is None else _weight(ref0 - ref_end, kv.dtype)[..., None, None]
        kv = kv + carry * kv0
    return kv, ref_end


def chunk_segments(
    starts: torch.Tensor, m: int, c: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """How packed documents cut ``m`` chunks of ``c`` positions, from ``starts (B, m c)`` (True where a
    document begins): ``(same (B, 1, m, c, c): a pair within one segment of its chunk, first (B, 1, m,
    c): a position that reads the state before its chunk, last (B, 1, m, c): one whose key the state
    after it holds, keep (B, 1, m): the state before carries through the chunk)``. ``O(B m c^2)``."""
    seg = starts.view(starts.shape[0], 1, m, c).cumsum(3)  # (B, m c) -> (B, 1, m, c): segment in chunk
    first = seg == 0
    return seg[..., :, None] == seg[..., None, :], first, seg == seg[..., -1:], first[..., -1]


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """``v (B, H, N, E)`` with a column of ones, ``(B, H, N, E + 1)``: (*) then also sums the
    denominator of a normalised variant."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1)


def global_attention(
    qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, log_k: torch.Tensor | None, den: bool = False
) -> torch.Tensor:
    """Non-causal (*): every query reads every key. ``qf (B, H, Nq, F)``, ``kf (B, Hk, Nk, F)``,
    ``v (B, Hk, Nk, E)``, ``log_k (B|1, Hk, Nk)`` or None -> ``(B, H, Nq, E)`` (``E + 1`` with ``den``:
    the denominator, summed as a vector beside the values); ``Hk`` divides ``H``, query head ``h``
    reading key head ``h // (H / Hk)``. One pass through the ``(F, E)`` state of each key head,
    ``O(H Nq F E + Hk Nk F E)``. The state is held relative to the largest ``l``, so each weight is at
    most 1 and the common factor ``exp(-max l)`` is one a normalised variant divides out."""
    if log_k is not None:
        kf = kf * _weight(log_k - log_k.amax(-1, keepdim=True), kf.dtype)[..., None]  # (B, Hk, Nk, F)
    b, h, nq, f = qf.shape
    qg = qf.reshape(b, kf.shape[1], -1, f)  # (B, H, Nq, F) -> (B, Hk, g Nq, F), g = H / Hk: a group as rows
    out = qg @ (kf.transpose(-1, -2) @ v)  # (B, Hk, g Nq, E)
    if den:
        out = torch.cat([out, qg @ kf.sum(-2)[..., None]], -1)  # (B, Hk, g Nq, E + 1)
    return out.view(b, h, nq, -1)  # (B, Hk, g Nq, E') -> (B, H, Nq, E')


def causal_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    chunk: int,
    log_k: torch.Tensor | None = None,
    log_ref: torch.Tensor | None = None,
    kv0: torch.Tensor | None = None,
    ref0: torch.Tensor | None = None,
    den: bool = False,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Causal (*) in chunks of ``chunk`` positions, bottom-right aligned.

    ``qf (B, H, Nq, F)`` are the last ``Nq`` of the ``Nk`` positions of ``kf (B, Hk, Nk, F)``,
    ``v (B, Hk, Nk, E)``; ``Hk`` divides ``H``, query head ``h`` reading key head ``h // g``
    (``g = H / Hk``); ``log_k``, ``log_ref (B|1, Hk, Nk)`` (both or neither) are per position;
    ``kv0 (B, Hk, F, E)``, ``ref0 (B|1, Hk)`` a state the keys follow (decoding), or None. The first
    ``Nk - Nq`` keys go straight into the state (:func:`absorb`); then, per chunk, the intra-chunk
    ``(c, c)`` products masked to ``j <= i`` and the state from the chunks before, scaled to each
    query's reference. Returns ``(out (B, H, Nq, E), kv, ref)``: the state after all ``Nk`` keys, one
    per key head. ``den``: the output gets the denominator as column ``E + 1`` (and so does the
    state, except on the unweighted path from an empty state, whose state is then the values' alone).
    A group's ``g`` query heads share their key head's chunk states and weights: they are its
    ``(g c, c)`` chunk products' rows (:func:`_group_rows`), never ``g`` copies of the keys.
    Time ``O(H Nq c (F + E) + Hk Nk F E)``; memory ``O(H Nq c + Hk (Nq / c) F E)`` per batch (the
    state before each chunk is kept for the queries and for backward). With weights the state is
    carried chunk by chunk (a loop over ``Nq / c`` chunks of ``O(F E)`` work each); without, by a sum.

    ``starts (B, Nk)`` boolean (no ``kv0``): True where a packed document begins; a position then sums
    only its own document's keys. A start inside a chunk splits it into segments, as in
    ``gated_core.chunked_recurrence``: pairs within a segment, the state before the chunk read by its
    first segment only, the state after it holding its last segment's keys, and the state carried
    through a chunk only where no document begins in it (the unweighted path's prefix sum over the
    chunks then restarts there: a segmented sum).
    """
    b, h, nq, _ = qf.shape
    hk, nk, e = kf.shape[1], kf.shape[2], v.shape[-1]
    group = h // hk
    if starts is not None and kv0 is not None:
        raise ValueError("packed documents start from an empty state: no kv0 beside starts")
    weighted = log_k is not None
    if den and (weighted or kv0 is not None or nk != nq):
        v, den = with_ones(v), False  # the general path sums the denominator as a column of ones
        e += 1
    off = nk - nq
    if off:  # keys before the first query: state only
        log_off = log_k[..., :off] if weighted else None  # (B|1, H, off)
        k_off = kf[:, :, :off]  # (B, Hk, off, F)
        if starts is not None:  # only the document the first query follows from
            docs = starts[:, :off].cumsum(-1)  # (B, off): each key's document among them
            follows = (docs == docs[:, -1:])[:, None]  # (B, 1, off)
            if weighted:
                log_off = torch.where(follows, log_off, NEG_INF)  # (B, Hk|1, off)
            else:
                k_off = k_off * follows[..., None]  # (B, Hk, off, F): the others' features zeroed
            starts = starts[:, off:]  # (B, Nq)
        kv0, ref0 = absorb(
            k_off,
            v[:, :, :off],
            log_off,
            log_ref[..., off - 1] if weighted else None,
            kv0,
            ref0,
        )
        kf, v = kf[:, :, off:], v[:, :, off:]  # (B, Hk, Nq, F|E)
        if weighted:
            log_k, log_ref = log_k[..., off:], log_ref[..., off:]  # (B|1, Hk, Nq)
    c = max(1, min(chunk, nq))
    n = -(-nq // c)
    pad = n * c - nq
    if pad:  # zero features after the end: they change no earlier output and add nothing to the state
        qf, kf, v = (fn.pad(x, (0, 0, 0, pad)) for x in (qf, kf, v))  # (B, H|Hk, n c, F|E)
        if weighted:
            log_k = fn.pad(log_k, (0, pad), value=NEG_INF)  # (B|1, Hk, n c)
            log_ref = torch.cat([log_ref, log_ref[..., -1:].expand(*log_ref.shape[:-1], pad)], -1)
        if starts is not None:
            starts = fn.pad(starts, (0, pad))  # (B, n c)
    qc = _group_rows(qf, hk, n, c)  # (B, Hk, n, g c, F): a group's queries as one chunk's rows
    kc = kf.view(b, hk, n, c, -1)  # (B, Hk, n c, F) -> (B, Hk, n, c, F)
    vc = v.view(b, hk, n, c, e)  # (B, Hk, n, c, E)
    if not weighted:
        segments = None if starts is None else chunk_segments(starts, n, c)
        out, state = _plain_chunks(qc, kc, vc, kv0, den, segments)
        return _ungroup_rows(out, group, c)[:, :, :nq], state, None
    lower = torch.ones(c, c, dtype=torch.bool, device=qf.device).tril()  # (c, c): key j <= query i
    lk = log_k.view(*log_k.shape[:2], n, c)  # (B|1, Hk, n c) -> (B|1, Hk, n, c)
    lr = log_ref.view(*log_ref.shape[:2], n, c)  # (B|1, Hk, n, c)
    first = keep = None  # packed documents: who reads the state before a chunk, whether it carries
    lk_out = lk  # the log weights of the keys the state after a chunk holds
    if starts is not None:
        same, first, last, keep = chunk_segments(starts, n, c)
        lower = lower & same  # (B, 1, n, c, c)
        lk_out = torch.where(last, lk, NEG_INF)  # (B, Hk|1, n, c): the last segment writes on

    # relative to the chunk's first reference before any float32 rounding: retention's absolute
    # log positions reach hundreds and more, where a float32 difference keeps ~4 significant digits
    base = lr[..., :1]
    base = torch.where(base.isfinite(), base, 0.0)  # (B|1, Hk, n, 1); -inf: no real key yet
    rel_k, rel_r = (lk - base).to(qf.dtype), (lr - base).to(qf.dtype)
    diff = rel_k[..., None, :] - rel_r[..., :, None]  # (B|1, Hk, n, c, c): l_j - r_i
    pair_w = _weight(diff.masked_fill(~lower, NEG_INF), qf.dtype).repeat(1, 1, 1, group, 1)  # (.., g c, c)
    scores = (qc @ kc.transpose(-1, -2)) * pair_w  # (B, Hk, n, g c, c)
    ends = lr[..., -1]  # (B|1, Hk, n): each chunk's state is held relative to its last reference
    kw = kc * _weight(lk_out - ends[..., None], qf.dtype)[..., None]  # (B, Hk, n, c, F)
    out = scores @ vc  # (B, Hk, n, g c, E): within each chunk
    chunk_kv = kw.transpose(-1, -2) @ vc  # (B, Hk, n, F, E): each chunk's own keys
    if kv0 is None:
        kv0 = qf.new_zeros(b, hk, qf.shape[-1], e)  # (B, Hk, F, E)
    state, ref = kv0, ref0 if ref0 is not None else torch.full_like(ends[..., 0], NEG_INF)
    befores, refs = [], []
    # unbind, not chunk_kv[:, :, t] in the loop: each indexing's backward would allocate the whole
    # (B, H, n, F, E) gradient, O(n^2 F E) over the loop; unbind's backward is one stack
    keeps = [None] * n if keep is None else keep.unbind(-1)  # (B, 1) each: no document begins in chunk t
    for kv_t, end_t, keep_t in zip(chunk_kv.unbind(2), ends.unbind(-1), keeps, strict=True):
        befores.append(state)  # the state before chunk t, then chunk t added: O(F E) a chunk
        refs.append(ref)
        carry = _weight(ref - end_t, qf.dtype)  # (B|1, H)
        state = (carry if keep_t is None else carry * keep_t)[..., None, None] * state + kv_t
        ref = end_t
    before = torch.stack(befores, 2)  # (B, Hk, n, F, E)
    # each query reads the state at its own reference: exp(ref_before - r_i) <= 1
    qscale = _weight(torch.stack(refs, -1)[..., None] - lr, qf.dtype)  # (B|1, Hk, n, c)
    if first is not None:
        qscale = qscale * first  # (B, Hk, n, c): only a chunk's first document reads the state before
    out = out + (qc * qscale.repeat(1, 1, 1, group)[..., None]) @ before  # (B, Hk, n, g c, E)
    return _ungroup_rows(out, group, c)[:, :, :nq], state, ref


def _group_rows(x: torch.Tensor, hk: int, n: int, c: int) -> torch.Tensor:
    """Queries ``x (B, Hk g, n c, F)`` as the rows of their key head's chunks, ``(B, Hk, n, g c, F)``:
    row ``r`` of chunk ``t`` is query head ``r // c`` of the group at position ``t c + r % c``, so a
    ``(c, c)`` mask or weight tiled ``g`` times along the rows fits. A copy only when ``g > 1``."""
    b, h, _, f = x.shape
    g = h // hk
    x = x.view(b, hk, g, n, c, f).transpose(2, 3)  # (B, Hk, g, n, c, F) -> (B, Hk, n, g, c, F)
    return x.reshape(b, hk, n, g * c, f)  # (B, Hk, n, g c, F)


def _ungroup_rows(x: torch.Tensor, g: int, c: int) -> torch.Tensor:
    """:func:`_group_rows` undone: ``(B, Hk, n, g c, E)`` -> ``(B, Hk g, n c, E)``."""
    b, hk, n, _, e = x.shape
    x = x.view(b, hk, n, g, c, e).transpose(2, 3)  # (B, Hk, n, g, c, E) -> (B, Hk, g, n, c, E)
    return x.reshape(b, hk * g, n * c, e)  # (B, H, n c, E)


class _ExclusivePrefixSum(torch.autograd.Function):
    """``out[:, t] = sum_{s < t} x[:, s]`` along dimension 1 of ``x (G, n, ...)``.

    On the CPU a loop of ``n - 1`` adds into one buffer: ``torch.cumsum`` along a middle dimension
    took 4x as long (14.6 against 3.7 ms for (8, 128, 64, 64), one thread), a quarter of the whole
    causal forward. Elsewhere (one kernel launch per add would dominate) ``cumsum(x) - x``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return x.cumsum(1) - x
        out = torch.empty_like(x)
        out[:, 0] = 0
        for t in range(1, x.shape[1]):
            torch.add(out[:, t - 1], x[:, t - 1], out=out[:, t])
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        # out[:, t] holds x[:, s] for every s < t, so x[:, s]'s gradient is the sum of g[:, t > s]
        if g.device.type != "cpu":
            return g.flip(1).cumsum(1).flip(1) - g
        gx = torch.empty_like(g)
        gx[:, -1] = 0
        for s in range(g.shape[1] - 2, -1, -1):
            torch.add(gx[:, s + 1], g[:, s + 1], out=gx[:, s])
        return gx


class _SegmentedExclusiveSum(torch.autograd.Function):
    """``out[:, 0] = 0``, ``out[:, t] = keep[:, t - 1] out[:, t - 1] + x[:, t - 1]`` along dimension 1
    of ``x (G, n, ...)``, ``keep (G, n)`` 0 or 1: :class:`_ExclusivePrefixSum` restarted after each
    ``t`` with ``keep[:, t] = 0`` (``x[:, t]`` itself still counts). A loop of ``n - 1`` adds on the
    CPU, as there; :func:`_exclusive_sum` writes it with cumsum elsewhere."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        k = keep.view(*keep.shape, *(1,) * (x.dim() - 2))  # (G, n, 1, ...)
        ctx.save_for_backward(k)
        out = torch.empty_like(x)
        out[:, 0] = 0
        for t in range(1, x.shape[1]):
            torch.addcmul(x[:, t - 1], k[:, t - 1], out[:, t - 1], out=out[:, t])
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        # G[t], the whole gradient reaching out[:, t], is g[t] + keep[t] G[t + 1]; x[:, s] reaches
        # out[:, s + 1] with weight 1, so its gradient is G[s + 1] (and x[:, n - 1] reaches nothing)
        (k,) = ctx.saved_tensors
        gx = torch.empty_like(g)
        gx[:, -1] = 0
        total = g[:, -1].clone()  # G[n - 1]
        for s in range(g.shape[1] - 2, -1, -1):
            gx[:, s] = total
            total = torch.addcmul(g[:, s], k[:, s], total)  # G[s]
        return gx, None


def _exclusive_sum(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The chunks' states summed over the chunks before each one: ``x (G, n, ...)`` ->
    ``(G, n, ...)``; with ``keep (G, n)`` (0 where a packed document begins inside a chunk) the sum
    restarts after each such chunk (see :class:`_SegmentedExclusiveSum`). ``O(G n |x[0, 0]|)``."""
    if keep is None:
        return _ExclusivePrefixSum.apply(x)
    if x.device.type == "cpu":
        return _SegmentedExclusiveSum.apply(x, keep)
    return _segmented_sum_by_cumsum(x, keep)


def _segmented_sum_by_cumsum(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """:class:`_SegmentedExclusiveSum` in a few launches, not one per chunk (for GPUs): ``out[:, t] =
    C[t - 1] - C[u - 1]`` for the last ``u < t`` with ``keep[:, u] = 0`` (else ``u = 0``; ``C`` the
    inclusive sum, ``C[-1] = 0``), the sum of ``x`` over ``u .. t - 1``; autograd differentiates it.
    ``C`` is summed in float64: a short document late in a long packed row is the difference of two
    large, nearly equal sums, which in float32 was 1000x off that document run alone at 128k tokens."""
    n = x.shape[1]
    idx = torch.arange(n, device=x.device).expand_as(keep)  # (G, n)
    reset = torch.where(keep == 0, idx, -1).cummax(1).values  # (G, n): the last u <= t with keep 0
    lo = fn.pad(reset, (1, 0), value=-1)[:, :n].clamp(min=0)  # (G, n): u for out[t] (0 if none)
    wide = x.double().cumsum(1)  # (G, n, ...)
    csum = fn.pad(wide, (0,) * (2 * (x.dim() - 2)) + (1, 0))  # (G, n + 1, ...): C[t - 1] at t
    at = lo.view(*lo.shape, *(1,) * (x.dim() - 2)).expand(-1, -1, *x.shape[2:])  # (G, n, ...)
    return (csum[:, :n] - csum.gather(1, at)).to(x.dtype)


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a @ b`` for ``acc (G, M, N)``, ``a (G, M, K)``, ``b (G, K, N)``: written into ``acc``
    when no gradient is recorded (a copy of ``acc`` fewer, ~5% of a causal forward), else a new tensor.
    ``out=`` rather than ``baddbmm_``: profilers and FLOP counters see the product either way."""
    if torch.is_grad_enabled() and (acc.requires_grad or a.requires_grad or b.requires_grad):
        return torch.baddbmm(acc, a, b)
    return torch.baddbmm(acc, a, b, out=acc)


def _plain_chunks(
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    kv0: torch.Tensor | None,
    den: bool,
    segments: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unweighted chunked form of (*): ``qc (B, Hk, n, g c, F)`` (a group's ``g`` query heads as
    rows, :func:`_group_rows`), ``kc (B, Hk, n, c, F)``, ``vc (B, Hk, n, c, E)``, the state ``kv0 (B,
    Hk, F, E)`` before (None: empty) -> ``(out (B, Hk, n, g c, E'), state (B, Hk, F, E))``; with
    ``den`` (only without ``kv0``) the output gets the denominator column (E' = E + 1), summed as a
    vector beside the values rather than as a column of ones inside every product: ``E = 64`` keeps
    the batched matrix products at their fast sizes, where ``65`` cost a third more time.

    Everything is a batched product over ``G = B Hk n`` chunks, the triangle masked in place; the
    state before each chunk is one exclusive prefix sum over the chunks' own states, per key head.
    With packed documents' ``segments`` (:func:`chunk_segments`: same, first, last, keep) the triangle
    keeps pairs within a segment, only a chunk's first segment reads the state before it, only its
    last writes the state after it, and the prefix sum restarts after a chunk where a document begins."""
    b, hk, n, rows, f = qc.shape
    c, e = kc.shape[3], vc.shape[-1]
    g = rows // c
    hidden = torch.ones(c, c, dtype=torch.bool, device=qc.device).triu(1)  # (c, c): key j > query i
    q_in, k_out, keep = qc, kc, None  # who reads the state before a chunk, writes the one after it
    if segments is not None:
        same, first, last, keep_b = segments  # (B, 1, n, c, c), (B, 1, n, c) x 2, (B, 1, n)
        hidden = hidden | ~same  # (B, 1, n, c, c)
        q_in, k_out = qc * first.repeat(1, 1, 1, g)[..., None], kc * last[..., None]  # (.., g c|c, F)
        keep = keep_b.expand(b, hk, n).reshape(b * hk, n).to(qc.dtype)  # (B Hk, n)
    hidden = hidden.repeat(*(1,) * (hidden.dim() - 2), g, 1)  # (.., g c, c): the tile for each row
    if segments is not None:
        hidden = hidden.expand(b, hk, n, rows, c).reshape(-1, rows, c)  # (G, g c, c)
    q2, k2 = qc.reshape(-1, rows, f), kc.reshape(-1, c, f)  # (B, Hk, n, g c|c, F) -> (G, g c|c, F)
    v2 = vc.reshape(-1, c, e)  # (G, c, E)
    scores = torch.bmm(q2, k2.transpose(1, 2)).masked_fill_(hidden, 0.0)  # (G, g c, c)
    kw = k_out.reshape(-1, c, f)  # (G, c, F)
    chunk_kv = torch.bmm(kw.transpose(1, 2), v2).view(b * hk, n, f, e)  # (G, F, E) -> (B Hk, n, F, E)
    before = _exclusive_sum(chunk_kv, keep)  # (B Hk, n, F, E): the chunks before each
    if kv0 is not None:  # (with documents: only up to the first chunk where one begins)
        reach = kv0.reshape(b * hk, 1, f, e)  # (B Hk, 1, F, E)
        if keep is not None:
            reach = reach * fn.pad(keep.cumprod(1), (1, 0), value=1.0)[:, :n, None, None]  # (B Hk, n, F, E)
        before = before + reach
    carry = before[:, -1] if keep is None else keep[:, -1, None, None] * before[:, -1]  # (B Hk, F, E)
    state = (carry + chunk_kv[:, -1]).view(b, hk, f, e)
    qs = q_in.reshape(-1, rows, f)  # (G, g c, F)
    out = _add_product(torch.bmm(scores, v2), qs, before.view(-1, f, e))  # (G, g c, E): intra + inter
    if den:
        ksum = _exclusive_sum(k_out.sum(3).view(b * hk, n, f, 1), keep)  # (B Hk, n, F, 1)
        d = _add_product(scores.sum(-1, keepdim=True), qs, ksum.view(-1, f, 1))  # (G, g c, 1)
        out = torch.cat([out, d], -1)  # (G, g c, E + 1)
    return out.view(b, hk, n, rows, -1), state  # (G, g c, E') -> (B, Hk, n, g c, E')


def decode_workload(
    variant: AttentionVariant,
    heads: int,
    k: torch.Tensor,
    v: torch.Tensor,
    kpm: torch.Tensor | None,
    scale: float | None,
) -> Workload:
    """The causal workload of a prefill of ``k (B, Hkv, N, D)``, ``v (B, Hkv, N, Dv)`` (any ``N``, 0
    included) for ``heads`` query heads, checked by ``variant``; a malformed input is one ``ValueError``."""
    if k.dim() != 4 or v.dim() != 4 or v.shape[:3] != k.shape[:3] or heads % k.shape[1]:
        raise ValueError(
            f"prefill needs k (B, Hkv, N, D), v (B, Hkv, N, Dv) and heads a multiple of Hkv; got "
            f"{tuple(k.shape)}, {tuple(v.shape)}, heads={heads}"
        )
    b, hkv, n, d = k.shape
    if kpm is not None and (kpm.dtype != torch.bool or tuple(kpm.shape) != (b, n)):
        raise ValueError(f"key_padding_mask must be boolean (B, N) = {(b, n)}")
    w = Workload(
        batch=b,
        heads=heads,
        nq=n,
        nk=n,
        head_dim=d,
        v_head_dim=v.shape[3],
        device=k.device.type,
        dtype=k.dtype,
        causal=True,
        key_padding=kpm is not None,
        kv_heads=hkv if hkv != heads else None,
        scale=scale,
    )
    variant.check(w)
    return w


def step_workload(
    variant: AttentionVariant,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    state: KernelState,
    grouped: bool = False,
) -> Workload:
    """The workload of a decoding step of ``q (B, H, T, D)``, ``k_new``, ``v_new (B, Hkv, T, D|Dv)`` after
    ``state``, checked by ``variant``; as many new keys as queries, and a state of the same batch,
    heads (``Hkv`` when ``grouped``, else ``H``) and work dtype, or one ``ValueError``."""
    w = Workload.of(q, k_new, v_new, causal=True, scale=state.scale)
    if w.nq != w.nk:
        raise ValueError(f"step takes as many new keys as queries; got {w.nq} queries, {w.nk} keys")
    variant.check(w)
    want = (w.batch, w.hkv if grouped else w.heads)
    if state.kv.shape[:2] != want or state.kv.dtype != work_dtype(w.dtype):
        raise ValueError(
            f"the state holds {tuple(state.kv.shape[:2])} (B, heads) in {state.kv.dtype}; the step's "
            f"q ({w.batch}, {w.heads}), k ({w.batch}, {w.kv_heads or w.heads}) in {w.dtype} need {want}"
        )
    return w


def core_flops(
    nq: int, nk: int, f: int, e: int, chunk: int, causal: bool, weighted: bool, group: int = 1
) -> int:
    """FLOPs of (*) for one batch element and key head with its ``group`` query heads, as the
    functions above compute it: what builds the state once per key head, what reads it per query head.

    Non-causal: the state ``2 Nk F E`` and its reading ``2 Nq F E`` per query head. Causal, in ``n``
    chunks of ``c = min(chunk, Nq)`` (``Nq`` padded to ``n c`` rows, as computed): per query head the
    intra-chunk products ``2 n c c (F + E)`` (the whole ``c x c`` block) and the reading ``2 n c F E``;
    per key head each chunk's state ``2 n c F E``, the carry ``n F E`` and the keys before the first
    query ``2 (Nk - Nq) F E``. With weights, the weights themselves (a difference and an exponential
    per weight: per key head) and the products with them (per query head, except the keys').
    """
    if not causal:
        return state_flops(nk, f, e, weighted) + group * 2 * nq * f * e
    c = max(1, min(chunk, nq))
    n = math.ceil(nq / c)
    rows = n * c  # the queries padded to whole chunks: every product runs on the padded rows
    per_query = 2 * rows * c * (f + e) + 2 * rows * f * e
    per_key = 2 * rows * f * e + n * f * e + state_flops(nk - nq, f, e, weighted)
    if weighted:
        # (c, c) weights and their product, key weights and products, query weights and products,
        # the carry's scale
        per_query += rows * c + rows * f
        per_key += 2 * rows * c + rows * (f + 2) + 2 * rows + n * f * e
    return group * per_query + per_key


def state_flops(n: int, f: int, e: int, weighted: bool) -> int:
    """FLOPs of summing ``n`` keys into an ``F x E`` state (:func:`absorb`): the products ``2 n F E``
    and, with weights, each key's weight and its product with the features ``n (F + 2)``."""
    return 2 * n * f * e + (n * (f + 2) if weighted else 0)


class KernelizedAttention(AttentionVariant):
    """What ``linear``, ``performer`` and ``retention`` share: the forward, the decoding state and
    its size, the FLOPs, the refusals; each supplies its feature maps and log weights
    (:meth:`_features`), its state's dimensions (:meth:`_state_dims`) and its feature maps' FLOPs.

    ``normalize``: values get a column of ones, so (*) also sums the denominator, and the output is
    the ratio (a row whose denominator is exactly 0, a query that sees no key, stays 0).
    """

    exact = False  # not softmax attention (performer approximates it)
    supports_attn_mask = False  # refused with the reason by refuse_pairwise
    native_scale = True  # the scale multiplies the features, not q before a feature map
    #: the dense float64 form's graph at the gradient check: 2.3-2.9x its weights (linear, retention)
    oracle_graph_copies = 3
    supports_state = True
    #: (*) has log weights (a decay, a stabiliser)
    weighted: ClassVar[bool] = False
    #: ``native_gqa`` here says the key features and log weights do not depend on the query head: the
    #: keys are mapped on their K/V heads and the query heads of a group share one decoding state, as
    #: they share sdpa's cache (Hkv states, not H). False where they do (retention's decay is per query
    #: head): the keys are repeated and each query head keeps its state.
    normalize: bool = False
    chunk: int = 64

    def check(self, w: Workload) -> None:
        who = self.name or type(self).__name__
        refuse_pairwise(who, w)
        if w.documents and not w.causal:
            raise Unsupported(
                f"{who} takes packed documents causal only: its non-causal form sums every key into "
                "one state, with no place where a document ends"
            )
        super().check(w)

    def native_documents(self, w: Workload) -> bool:
        # causal: the chunked form drops its state where a document begins (check refuses the rest)
        return True

    def _features(
        self,
        q: torch.Tensor | None,
        k: torch.Tensor,
        scale: float,
        valid: torch.Tensor | None,
        start: int,
        ref0: torch.Tensor | None,
        causal: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(qf (B, H, Nq, F), kf (B, H, Nk, F), log_k (B|1, H, Nk), log_ref (B|1, H, Nk))`` of (*)
        for ``q (B, H, Nq, D)`` (None: keys only) and ``k (B, H, Nk, D)`` in the work dtype; ``valid
        (B, 1, Nk)`` marks real keys (None: all), whose ``kf`` must be 0 and ``log_k`` ``-inf``
        otherwise; the keys are positions ``start ..``; ``ref0`` is the state's reference they follow;
        ``log_ref`` is needed only when ``causal``. The log weights carry no gradient."""
        raise NotImplementedError

    def _state_dims(self, w: Workload) -> tuple[int, int, int]:
        """``(F, E, ref bytes)`` of one head's state for ``w``."""
        raise NotImplementedError

    def _feature_flops(self, w: Workload) -> int:
        """FLOPs of the feature maps (and what else the variant adds to the core) for ``w``."""
        raise NotImplementedError

    def state_heads(self, w: Workload) -> int:
        """The heads the keys' features are taken on and one sequence's decoding state keeps: ``Hkv``
        where :attr:`native_gqa`, else ``H`` (the base class repeats the keys before the call)."""
        return w.hkv if self.native_gqa else w.heads

    def _values(self, v: torch.Tensor) -> torch.Tensor:
        """``v (B, H, N, Dv)`` with a column of ones when normalised (the decoding state's layout):
        ``(B, H, N, E)``."""
        return with_ones(v) if self.normalize else v

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        """``(B, H, N, E)`` sums -> ``(B, H, N, Dv)`` output (the ratio when normalised)."""
        if not self.normalize:
            return out
        num, den = out[..., :-1], out[..., -1:]  # (B, H, N, Dv), (B, H, N, 1)
        return num / torch.where(den == 0, 1.0, den)

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None, documents=None):
        work = work_dtype(q.dtype)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        valid = None if key_padding_mask is None else key_padding_mask[:, None, :]  # (B, 1, Nk)
        qf, kf, log_k, log_ref = self._features(q.to(work), k.to(work), scale, valid, 0, None, causal)
        vv, den = v.to(work), self.normalize  # (B, Hk, Nk, Dv); the denominator is summed beside
        starts = None if documents is None else document_starts(documents)  # (B, Nk)
        if not causal:
            return self._finish(global_attention(qf, kf, vv, log_k, den)).to(q.dtype)
        # grouped heads (native_gqa): a group's query heads read their key head's chunk states
        out, _, _ = causal_attention(qf, kf, vv, self.chunk, log_k, log_ref, None, None, den, starts)
        return self._finish(out).to(q.dtype)

    # ------------------------------------------------------------------ the decoding state
    def prefill(self, k, v, *, key_padding_mask=None, scale=None, heads=None) -> KernelState:
        """The state after the context (see :meth:`AttentionVariant.prefill`): one pass,
        ``O(N F E)``; ``N = 0`` gives the empty state."""
        heads = heads or k.shape[1]
        w = decode_workload(self, heads, k, v, key_padding_mask, scale)
        hs = self.state_heads(w)
        k, v = repeat_kv(k, hs), repeat_kv(v, hs)  # (B, Hs, N, D|Dv): Hs heads of state
        work = work_dtype(k.dtype)
        s = w.head_dim**-0.5 if scale is None else float(scale)
        valid = None if key_padding_mask is None else key_padding_mask[:, None, :]  # (B, 1, N)
        _, kf, log_k, log_ref = self._features(None, k.to(work), s, valid, 0, None, True)
        ref_end = None
        if log_ref is not None:  # an empty context has no position yet: reference -inf, weight 0
            ref_end = log_ref[..., -1] if w.nk else log_ref.new_full(log_ref.shape[:-1], NEG_INF)
        kv, ref = absorb(kf, self._values(v.to(work)), log_k, ref_end, None, None)
        return KernelState(kv, ref, w.nk, s)

    def step(self, q, k_new, v_new, state) -> tuple[torch.Tensor, KernelState]:
        """The causal output of the ``T`` new positions and the state after them (see
        :meth:`AttentionVariant.step`): the chunked form started from the state, ``O(T (c + F) E)``."""
        if state is None:
            state = self.prefill(k_new[:, :, :0], v_new[:, :, :0], heads=q.shape[1])
        w = step_workload(self, q, k_new, v_new, state, self.native_gqa)
        work = state.kv.dtype
        hs = state.kv.shape[1]  # heads of state: H, or Hkv when grouped
        k, v = repeat_kv(k_new, hs), repeat_kv(v_new, hs)  # (B, Hs, T, D|Dv)
        # the queries' features do not involve the keys': q keeps its H heads beside Hs of keys
        qf, kf, log_k, log_ref = self._features(
            q.to(work), k.to(work), state.scale, None, state.length, state.ref, True
        )
        vals = self._values(v.to(work))  # (B, Hs, T, E)
        group = w.heads // hs
        if group > 1 and w.nq == 1:
            # one new key: the query reads the state that holds it, each group's queries one state
            # (exp(ref0 - r) kv0 + exp(l - r) kf v^T at the new reference r, what the chunked form reads)
            end = None if log_ref is None else log_ref[..., -1]  # (B|1, Hkv): the new reference r
            kv, ref = absorb(kf, vals, log_k, end, state.kv, state.ref)
            b, f, e = w.batch, kv.shape[-2], kv.shape[-1]
            out = (qf.view(b, hs, group, f) @ kv).view(b, w.heads, 1, e)  # (B, Hkv, g, E) -> (B, H, 1, E)
        else:  # the chunked form from the state, a group's queries reading its one state
            out, kv, ref = causal_attention(qf, kf, vals, self.chunk, log_k, log_ref, state.kv, state.ref)
        return self._finish(out).to(q.dtype), KernelState(kv, ref, state.length + w.nk, state.scale)

    def state_bytes(self, w: Workload) -> int:
        """:meth:`state_heads` heads of an ``F x E`` state (and its reference): independent of ``w.nk``."""
        f, e, ref = self._state_dims(w)
        return self.state_heads(w) * (f * e * torch.empty((), dtype=work_dtype(w.dtype)).element_size() + ref)

    def flops(self, w: Workload, mode: str = "fwd") -> int:
        """The feature maps and the core's state updates and chunk products (:func:`core_flops`) for
        every batch element and head, not pairs; backward counts 2.5x forward as elsewhere."""
        f, e, _ = self._state_dims(w)
        hs = self.state_heads(w)  # the key heads the state is built on, each read by H / Hs query heads
        core = core_flops(w.nq, w.nk, f, e, self.chunk, w.causal, self.weighted, w.heads // hs)
        fwd = w.batch * hs * core + self._feature_flops(w)
        return int(fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode])
