"""The float64 oracle: dense attention restricted to a variant's own pattern.

Kept apart from ``naive`` on purpose: it is the yardstick tests and accuracy measurements use, written
for clarity, never for speed. Memory ``O(B * H * Nq * Nk)`` float64.
"""

from __future__ import annotations

import torch

from .base import AttentionVariant
from .masks import combined_mask, safe_softmax


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    allowed: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(scores) @ v`` in float64 with ``scores = q k^T / sqrt(D)`` unless given.

    ``allowed`` (bool, broadcastable to ``(B, H, Nq, Nk)``) restricts the softmax; an empty row
    gives zeros. Returns ``(B, H, Nq, Dv)`` float64.
    """
    if scores is None:
        scores = (q.double() @ k.double().transpose(-2, -1)) / q.shape[-1] ** 0.5
    p = safe_softmax(scores.double(), allowed)
    return p @ v.double()


def oracle(
    variant: AttentionVariant,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 output ``variant`` should produce: full attention over its pattern and the masks.

    A variant that is not a restricted softmax (``axial``: rows then columns) defines
    ``oracle_forward`` built from :func:`reference_attention`.
    """
    custom = getattr(variant, "oracle_forward", None)
    if custom is not None:
        return custom(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    nq, nk = q.shape[2], k.shape[2]
    allowed = variant.pattern(nq, nk, causal).to(q.device)[None, None]  # (1, 1, Nq, Nk)
    extra = combined_mask(
        q.shape[0], nq, nk, key_padding_mask=key_padding_mask, attn_mask=attn_mask, device=q.device
    )
    if extra is not None:
        allowed = allowed & extra
    return reference_attention(q, k, v, allowed=allowed, scores=variant.reference_scores(q, k))


def full_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 full (exact) softmax attention with the call's masks: what approximations deviate from."""
    allowed = combined_mask(
        q.shape[0],
        q.shape[2],
        k.shape[2],
        causal=causal,
        key_padding_mask=key_padding_mask,
        attn_mask=attn_mask,
        device=q.device,
    )
    return reference_attention(q, k, v, allowed=allowed)
