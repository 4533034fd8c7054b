"""The float64 oracle: dense attention restricted to a variant's own pattern.

Kept apart from ``naive`` on purpose: it is the yardstick tests and accuracy measurements use, written
for clarity, never for speed. Memory ``O(B * H * Nq * Nk)`` float64.
"""

from __future__ import annotations

import torch

from .base import AttentionVariant, repeat_kv
from .masks import combined_mask, safe_softmax


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    allowed: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(scores + bias) @ v`` in float64 with ``scores = q k^T * scale`` unless given
    (``scale`` defaults to ``1/sqrt(D)``).

    ``k``, ``v`` may have fewer heads than ``q`` (grouped: each is repeated here, written plainly).
    ``allowed`` (bool, broadcastable to ``(B, H, Nq, Nk)``) restricts the softmax; an empty row
    gives zeros. Returns ``(B, H, Nq, Dv)`` float64.
    """
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # (B, H, Nk, D|Dv)
    if scores is None:
        s = q.shape[-1] ** -0.5 if scale is None else scale
        scores = (q.double() @ k.double().transpose(-2, -1)) * s
    if bias is not None:
        scores = scores.double() + bias.double()
    p = safe_softmax(scores.double(), allowed)
    return p @ v.double()


def _rows_of(mask: torch.Tensor | None, rows: torch.Tensor | None, nq: int) -> torch.Tensor | None:
    """``mask`` restricted to query ``rows`` (when it has a query dimension)."""
    if mask is None or rows is None or mask.dim() < 2 or mask.shape[-2] != nq:
        return mask
    return mask[..., rows, :]


def oracle(
    variant: AttentionVariant,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 output ``variant`` should produce: full attention over its pattern and the masks.

    ``rows`` (1-D indices) limits the result to those query rows, ``(B, H, len(rows), Dv)``, so long
    sequences can be checked in ``O(rows * Nk)``. A variant that is not a restricted softmax
    (``axial``: rows then columns) defines ``oracle_forward`` built from :func:`reference_attention`.
    """
    custom = getattr(variant, "oracle_forward", None)
    if custom is not None:
        extra = {k_: x for k_, x in (("scale", scale), ("bias", bias)) if x is not None}
        out = custom(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask, **extra)
        return out if rows is None else out[:, :, rows]
    nq, nk = q.shape[2], k.shape[2]
    allowed = variant.pattern(nq, nk, causal).to(q.device)  # (Nq, Nk)
    allowed = _rows_of(allowed, rows, nq)[None, None]  # (1, 1, R, Nk)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(q.device)[:, None, None, :]  # (B, 1, R, Nk)
    if attn_mask is not None:
        allowed = allowed & _rows_of(attn_mask.to(q.device), rows, nq)
    q_rows = q if rows is None else q[:, :, rows]
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])  # (B, H, Nk, D|Dv)
    scores = variant.reference_scores(q_rows, k, **({} if scale is None else {"scale": scale}))
    if bias is not None:
        bias = _rows_of(bias.to(q.device), rows, nq)
    return reference_attention(q_rows, k, v, allowed=allowed, scores=scores, bias=bias)


def full_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 full softmax attention with the call's masks, scale and bias (what approximations
    deviate from).

    ``rows`` limits the result to those query rows, as in :func:`oracle`.
    """
    nq, nk = q.shape[2], k.shape[2]
    allowed = combined_mask(
        q.shape[0], nq, nk, causal=causal, key_padding_mask=key_padding_mask, device=q.device
    )
    allowed = _rows_of(allowed, rows, nq)
    if attn_mask is not None:
        am = _rows_of(attn_mask.to(q.device), rows, nq)
        allowed = am if allowed is None else allowed & am
    if bias is not None:
        bias = _rows_of(bias.to(q.device), rows, nq)
    q_rows = q if rows is None else q[:, :, rows]
    return reference_attention(q_rows, k, v, allowed=allowed, scale=scale, bias=bias)
