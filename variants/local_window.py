"""``local_window``: sliding-window (banded) attention, computed block by block (Longformer's local
attention; Beltagy et al., 2020, "Longformer: The Long-Document Transformer").

Query ``i`` sees key ``j`` iff ``|i - j| <= window`` (and ``j <= i`` when causal). A window of ``N - 1``
or more is full attention. Queries are cut into blocks of ``block`` rows; a block starting at ``s``
can only see keys in ``[s - window, s + block - 1 + window]``, so each block is scored against that
span of ``block + 2 * window`` keys (``block + window`` when causal: later keys are never visible).
K and V are padded by ``window`` on both sides and to a multiple of ``block``, and the spans are
strided views of them (``unfold``; the batched matmul copies each span once, ``(block + 2 window) /
block`` times the size of K), so every block is scored in one batched matmul and no ``N x N``
matrix exists, forward or backward.

Shapes: ``q (B, H, N, D)``, ``k (B, H, N, D)``, ``v (B, H, N, Dv)`` -> ``(B, H, N, Dv)``; self-attention
only (``Nq == Nk``), with causal and key padding masks, no arbitrary ``attn_mask``.
Time ``O(B H N (block + 2 window) D)``; memory ``O(B H N (block + 2 window))`` for the blocked scores:
both linear in ``N`` at a fixed window. Low-precision inputs are accumulated in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionVariant
from .masks import softmax_blocked_, zero_empty_rows
from .registry import register


def band_pairs(nq: int, nk: int, window: int, causal: bool) -> int:
    """Number of pairs ``(i < nq, j < nk)`` with ``|i - j| <= window`` (and ``j <= i`` if causal).

    Summed diagonal by diagonal (``d = i - j``): diagonal ``d`` holds ``min(nq, nk + d) - max(0, d)``
    pairs, so the cost is ``O(window)``, not ``O(nq * nk)``.
    """
    lo = 0 if causal else -min(window, nk - 1)  # causal keeps d >= 0; diagonals past the edge are empty
    hi = min(window, nq - 1)
    return sum(max(0, min(nq, nk + d) - max(0, d)) for d in range(lo, hi + 1))


@register("local_window")
class LocalWindowAttention(AttentionVariant):
    """Sliding-window attention of radius ``window``, scored in query blocks of ``block`` rows."""

    exact = False  # an approximation of full attention; its oracle is the softmax over the band
    supports_attn_mask = False
    supports_cross = False
    example_knobs = ({"window": 3, "block": 4}, {"window": 5}, {"window": 2, "block": 5})

    def __init__(self, window: int = 128, block: int | None = None) -> None:
        super().__init__()
        if window < 0:
            raise ValueError(f"window must be >= 0 (a radius in tokens), got {window}")
        if block is not None and block < 1:
            raise ValueError(f"block must be >= 1 or None, got {block}")
        self.window = window
        self.block = block

    def knobs(self) -> dict[str, object]:
        return {"window": self.window, "block": self.block}

    def _block_size(self, n: int, window: int) -> int:
        # a block as wide as the window keeps the span (block + 2w) within 3x the useful band (2w + 1)
        # while the matmuls stay large; never wider than the sequence (padding would be wasted work)
        b = self.block if self.block is not None else max(window, 16)
        return max(1, min(b, n))

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        bsz, h, n, d = q.shape
        w = min(self.window, n - 1)  # a wider window sees nothing more
        b = self._block_size(n, w)
        nb = -(-n // b)  # number of query blocks
        n_pad = nb * b
        span = b + w if causal else b + 2 * w  # keys a query block can see
        right = n_pad - n + (0 if causal else w)  # so that unfold yields exactly nb spans

        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        # scale q before the matmul: in low precision q k^T could overflow first
        qs = q.to(work) * d**-0.5  # (B, H, N, D)
        if n_pad > n:  # (F.pad copies even when there is nothing to pad)
            qs = F.pad(qs, (0, 0, 0, n_pad - n))  # (B, H, Np, D)
        qb = qs.view(bsz, h, nb, b, d)  # (B, H, nb, b, D)
        kp = F.pad(k.to(work), (0, 0, w, right))  # (B, H, w + Np + right, D)
        vp = F.pad(v.to(work), (0, 0, w, right))  # (B, H, w + Np + right, Dv)
        # the span of block c holds padded positions [c*b, c*b + span), i.e. tokens c*b - w + t
        ku = kp.unfold(2, span, b)  # (B, H, nb, D, span): already K^T per block
        vu = vp.unfold(2, span, b).transpose(-2, -1)  # (B, H, nb, span, Dv)

        # query r of a block vs span slot t: i - j = r + w - t, independent of the block, so the
        # band is one (b, span) matrix shared by all blocks (True = blocked, to mask in place)
        r = torch.arange(b, device=q.device)[:, None]  # (b, 1)
        t = torch.arange(span, device=q.device)[None, :]  # (1, span)
        outside = (t < r) | (t > r + (w if causal else 2 * w))  # (b, span)
        # which span slots are not real keys (the padding added above, or key padding), per block
        absent = torch.ones(w + n_pad + right, dtype=torch.bool, device=q.device)  # (Lp,)
        absent[w : w + n] = False
        if key_padding_mask is not None:
            absent = absent | ~F.pad(key_padding_mask.to(q.device), (w, n_pad - n + right))  # (B, Lp)
        absent = absent.unfold(-1, span, b)  # (nb, span) or (B, nb, span)
        if absent.dim() == 3:
            blocked = outside | absent[:, None, :, None, :]  # (B, 1, nb, b, span)
        else:
            blocked = outside | absent[:, None, :]  # (nb, b, span)

        # the scores are not kept: softmax overwrites them, and only p is needed afterwards
        p = softmax_blocked_(qb @ ku, blocked)  # (B, H, nb, b, span)
        out = zero_empty_rows(p @ vu, blocked)  # (B, H, nb, b, Dv)
        out = out.reshape(bsz, h, n_pad, v.shape[-1])  # (B, H, Np, Dv)
        return out[:, :, :n].to(q.dtype)  # padded queries dropped

    def pattern(self, nq: int, nk: int, causal: bool = False) -> torch.Tensor:
        i = torch.arange(nq)[:, None]  # (Nq, 1)
        j = torch.arange(nk)[None, :]  # (1, Nk)
        allowed = (i - j).abs() <= self.window
        return allowed & (j <= i) if causal else allowed

    def num_pairs(self, nq: int, nk: int, causal: bool = False) -> int:
        return band_pairs(nq, nk, self.window, causal)
