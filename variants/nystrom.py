"""``nystrom``: the Nystrom approximation of softmax attention (Xiong et al. 2021, "Nystromformer: A
Nystrom-Based Algorithm for Approximating Self-Attention").

With the scaled queries ``Q`` (``scale`` defaults to ``1/sqrt(D)``), keys ``K`` and ``m`` landmarks
``Q~``, ``K~`` (means of segments of the sequence), the paper's eq. (15) is

    out = softmax(Q K~^T) @ pinv(softmax(Q~ K~^T)) @ softmax(Q~ K^T) @ V
        =        F        @          A^+           @       B        @ V

with ``A^+`` the Moore-Penrose pseudo-inverse computed by the paper's iteration (Razavi et al. 2014)
``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4`` from ``Z0 = A^T / (||A||_1 ||A||_inf)``,
``pinv_iters`` times (the paper's 6). ``||A||_1 ||A||_inf`` is taken per batch element and head (the
paper's coefficient); the official code and lucidrains' ``nystrom-attention`` take one maximum over
the whole batch, which would make one sequence's output depend on the others'. When every token is
its own landmark (``landmarks >= N``), ``F = A = B = softmax(Q K^T)`` and ``F A^+ B = softmax(Q K^T)``:
full attention, once the iteration has converged.

Segments: ``l = ceil(N / landmarks)`` tokens each and ``ceil(N / l)`` of them, laid out from the end
of the sequence, so when ``landmarks`` does not divide ``N`` the first segment is the short one. This
is lucidrains' layout (it pads the front of the sequence with masked tokens up to ``landmarks * l``)
without its segments made only of that padding; the official code requires ``landmarks`` to divide
``N``. The landmark count is then at most ``landmarks`` (``N`` when ``landmarks >= N``).

Key padding: each row lays its segments out over its own real tokens, as that row alone would (so a
sequence's output does not depend on how far a batch pads it), padded positions are left out of
the landmark means and of every softmax (unused landmark slots as columns of ``F`` and rows and
columns of ``A``, padded keys as columns of ``B``), so padding reaches no output. ``A`` is then
block-diagonal with a zero block, which the iteration keeps zero: the result is that of the real
landmarks alone. A sequence with no real key outputs zeros.

Self-attention only: ``Nq = Nk``, no causal form (a landmark averages keys from the whole sequence),
no decoding (the query landmarks need every query), no ``attn_mask`` (no query-key score matrix is
formed). Grouped K/V heads are read through a grouped view of the queries (no copy of K or V).

Shapes: ``q (B, H, N, D)``, ``k (B, Hkv, N, D)``, ``v (B, Hkv, N, Dv)`` -> ``(B, H, N, Dv)``. Time
``O(B H (N m (D + Dv) + m^2 (D + Dv) + pinv_iters m^3))``, memory ``O(B H N m)`` (``F`` and ``B``):
linear in ``N``. fp16/bf16 inputs are computed in float32 (the iteration in half precision diverges).
"""

from __future__ import annotations

import math

import torch

from .base import AttentionVariant, Unsupported, Workload
from .masks import safe_softmax
from .reference import nystrom_reference
from .registry import register


def segment_layout(n: int, landmarks: int) -> tuple[int, int]:
    """``(l, s)``: ``s`` segments of ``l = ceil(n / landmarks)`` tokens cover ``n``, the first one short
    by ``s * l - n`` tokens."""
    seg = math.ceil(n / landmarks)
    return seg, math.ceil(n / seg)


def segment_means(x: torch.Tensor, seg: int, segs: int) -> torch.Tensor:
    """Means of ``x (B, H, N, E)`` over the segments of ``seg`` tokens (the first one short by ``seg *
    segs - N``): ``(B, H, s, E)``. ``O(B H N E)``."""
    b, h, n, e = x.shape
    pad = seg * segs - n  # positions in front of the sequence: the first segment is short
    sums = torch.nn.functional.pad(x, (0, 0, pad, 0)).view(b, h, segs, seg, e).sum(3)  # (B, H, s, E)
    counts = torch.full((segs,), seg, dtype=x.dtype, device=x.device)
    counts[0] -= pad
    return sums / counts[:, None]


def real_segments(real: torch.Tensor, landmarks: int) -> torch.Tensor:
    """Each token's segment when each row lays its segments out over its own real tokens, as it would
    alone: the ``r``-th real token of a row with ``L`` of them is in segment ``(r + s l - L) // l``
    with :func:`segment_layout` ``(l, s)`` of ``L``; a padded token gets ``min(landmarks, N)`` (no
    segment). ``real (B, N)`` bool -> ``(B, N)`` int64, segments below ``min(landmarks, N)``."""
    n = real.shape[1]
    length = real.sum(-1).clamp_min(1)  # (B,); a row with no real token has no segment anyway
    seg = -(-length // landmarks)  # (B,): ceil
    segs = -(-length // seg)  # (B,)
    rank = real.long().cumsum(-1) - 1  # (B, N): how many real tokens come before, for a real one
    ids = (rank + (segs * seg - length)[:, None]) // seg[:, None]  # (B, N)
    return torch.where(real, ids, min(landmarks, n))


def masked_segment_means(x: torch.Tensor, ids: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Means of ``x (B, H, N, E)`` over the tokens of each of ``slots`` segments, by ``ids (B, N)`` from
    :func:`real_segments` (``slots``: padding, dropped): the means ``(B, H, slots, E)`` (zero for a
    segment with no token) and the counts ``(B, slots)``. ``O(B H N E)``."""
    b, h, n, e = x.shape
    index = ids[:, None, :, None].expand(b, h, n, e)  # (B, H, N, E)
    sums = x.new_zeros(b, h, slots + 1, e).scatter_add_(2, index, x)[:, :, :slots]  # (B, H, slots, E)
    counts = ids.new_zeros(b, slots + 1).scatter_add_(1, ids, torch.ones_like(ids))[:, :slots]  # (B, slots)
    return sums / counts.clamp_min(1)[:, None, :, None].to(x.dtype), counts


def iterative_pinv(a: torch.Tensor, iters: int) -> torch.Tensor:
    """The paper's iterative Moore-Penrose pseudo-inverse of each ``(m, m)`` matrix of ``a (..., m, m)``.

    ``Z0 = A^T / (||A||_1 ||A||_inf)`` (max column sum times max row sum, per matrix: ``A`` is a
    softmax, nonnegative, so no absolute values), then ``iters`` times
    ``Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4``. An all-zero matrix gives zeros.
    ``O(iters m^3)`` per matrix (four products an iteration).
    """
    norm = a.sum(-2).amax(-1) * a.sum(-1).amax(-1)  # (...): ||A||_1 ||A||_inf
    norm = torch.where(norm > 0, norm, torch.ones_like(norm))  # an empty A: Z0 = 0 whatever it is
    z = a.transpose(-1, -2) / norm[..., None, None]  # (..., m, m)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


@register("nystrom")
class NystromAttention(AttentionVariant):
    """Softmax attention through ``m`` segment-mean landmarks and an iterative pseudo-inverse."""

    exact = False  # an approximation of full attention (exact only at landmarks >= N, converged)
    supports_causal = False
    supports_attn_mask = False
    supports_cross = False
    supports_decode = False
    native_gqa = True
    native_scale = True
    # segments of 6 tokens at N=24; 5 does not divide 24 (a short first segment); 64 > N: every token
    # its own landmark (the default at these lengths)
    example_knobs = ({"landmarks": 4}, {"landmarks": 5, "pinv_iters": 3}, {})

    def __init__(self, landmarks: int = 64, pinv_iters: int = 6) -> None:
        super().__init__()
        if landmarks < 1 or pinv_iters < 0:
            raise ValueError(f"landmarks must be >= 1 and pinv_iters >= 0; got {landmarks}, {pinv_iters}")
        self.landmarks = landmarks
        self.pinv_iters = pinv_iters

    def knobs(self) -> dict[str, object]:
        return {"landmarks": self.landmarks, "pinv_iters": self.pinv_iters}

    def check(self, w: Workload) -> None:
        if w.causal:
            raise Unsupported(
                "nystrom has no causal form: each landmark is a mean over a segment of the whole "
                "sequence, so every output row would see later tokens"
            )
        if w.nq < w.nk and not w.cross:  # (cross: refused as such by the base class)
            raise Unsupported(
                f"nystrom cannot decode against a cache (Nq={w.nq} < Nk={w.nk}): its query landmarks "
                "are means over every query of the sequence, which a K/V cache does not keep"
            )
        if w.attn_mask:
            raise Unsupported(
                "nystrom cannot take an arbitrary attn_mask: it forms no query-key score matrix to "
                "mask, only scores against landmarks"
            )
        super().check(w)

    def oracle_graph_bytes(self, w: Workload, rows: int | None = None) -> int:
        """The gradient check's peak: four float64 ``(N, m)`` tensors per query head (``F`` and ``B``
        with their gradients, ``m`` the landmarks) and 64 ``(m, m)`` ones (the pseudo-inverse's
        iterations and their graph; the profiler: 0.7-1.0x this at N=128-1024), and float64 q, k, v and
        their gradients. It grows as ``N``, not ``N^2``, and counts every row whatever ``rows`` (the
        landmarks are means over all queries: every row's graph is held). ``O(1)``."""
        m = min(self.landmarks, w.nq, w.nk)
        per_head = 4 * max(w.nq, w.nk) * m + 64 * m * m
        return 8 * w.batch * w.heads * per_head + 2 * self._oracle_input_bytes(w)

    def flops(self, w: Workload, mode: str = "fwd") -> int:
        """FLOPs of the algorithm (matrix products and landmark sums; softmaxes not counted, as in the
        base convention).

        Per query head, with ``m`` the landmarks used: ``F = Q K~^T`` ``2 N m D``, ``B = Q~ K^T``
        ``2 m N D``, ``A = Q~ K~^T`` ``2 m^2 D``, the pseudo-inverse ``8 m^3`` an iteration, then
        ``B V`` ``2 m N Dv``, ``A^+ (B V)`` ``2 m^2 Dv``, ``F (A^+ B V)`` ``2 N m Dv``; the landmark
        sums ``N D`` per query head and per K/V head. Backward counts 2.5x forward.
        """
        n, d, dv = w.nk, w.head_dim, w.v_head_dim
        _, m = segment_layout(n, self.landmarks)
        per_head = 2 * n * m * (2 * d + 2 * dv) + 2 * m * m * (d + dv) + 8 * m**3 * self.pinv_iters + n * d
        fwd = w.batch * (w.heads * per_head + w.hkv * n * d)
        factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
        return int(fwd * factor)

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None):
        b, h, n, d = q.shape
        hkv, dv = k.shape[1], v.shape[3]
        g = h // hkv
        work = torch.promote_types(q.dtype, torch.float32)  # fp16/bf16 -> float32; float64 stays
        s = d**-0.5 if scale is None else scale
        qw, kw, vw = (q.to(work) * s), k.to(work), v.to(work)  # scaling q scales its landmarks too
        kpm = key_padding_mask
        f_allowed = a_allowed = b_allowed = None  # no padding: every segment has real tokens
        if kpm is None:
            seg, segs = segment_layout(n, self.landmarks)
            ql, kl = segment_means(qw, seg, segs), segment_means(kw, seg, segs)  # (B, H|Hkv, m, D)
        else:  # each row's segments over its own real tokens: a padded row is the row alone
            segs = min(self.landmarks, n)  # every row's count fits (a row may use fewer)
            ids = real_segments(kpm, self.landmarks)  # (B, N)
            ql, counts = masked_segment_means(qw, ids, segs)  # (B, H, m, D), (B, m)
            kl, _ = masked_segment_means(kw, ids, segs)  # (B, Hkv, m, D)
            has = counts > 0  # (B, m): landmarks with a real token
            f_allowed = has[:, None, None, None, :]  # (B, 1, 1, 1, m)
            a_allowed = has[:, None, None, :, None] & f_allowed  # (B, 1, 1, m, m)
            b_allowed = has[:, None, None, :, None] & kpm[:, None, None, None, :]  # (B, 1, 1, m, N)

        # a K/V head's G query heads are one longer sequence: one plain matmul per K/V head, no copy
        qg = qw.reshape(b, hkv, g * n, d)  # (B, H, N, D) -> (B, Hkv, G*N, D)
        qlg = ql.reshape(b, hkv, g * segs, d)  # (B, H, m, D) -> (B, Hkv, G*m, D)
        klt = kl.transpose(-2, -1)  # (B, Hkv, D, m)
        f = safe_softmax((qg @ klt).view(b, hkv, g, n, segs), f_allowed)  # (B, Hkv, G, N, m)
        a = safe_softmax((qlg @ klt).view(b, hkv, g, segs, segs), a_allowed)  # (B, Hkv, G, m, m)
        bm = safe_softmax((qlg @ kw.transpose(-2, -1)).view(b, hkv, g, segs, n), b_allowed)  # (B,Hkv,G,m,N)
        # F (A^+ (B V)): m^2 Dv + N m Dv, cheaper than (F A^+) (B V)'s N m^2 when Dv < N
        bv = (bm.view(b, hkv, g * segs, n) @ vw).view(b, hkv, g, segs, dv)  # (B, Hkv, G, m, Dv)
        out = f @ (iterative_pinv(a, self.pinv_iters) @ bv)  # (B, Hkv, G, N, Dv)
        return out.reshape(b, h, n, dv).to(q.dtype)  # (B, Hkv, G, N, Dv) -> (B, H, N, Dv)

    def oracle_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The float64 formula written separately (:func:`variants.reference.nystrom_reference`)."""
        self.check(
            Workload.of(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        )
        return nystrom_reference(
            q,
            k,
            v,
            landmarks=self.landmarks,
            pinv_iters=self.pinv_iters,
            key_padding_mask=key_padding_mask,
            scale=scale,
            rows=rows,
        )
