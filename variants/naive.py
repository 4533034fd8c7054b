"""``naive``: textbook ``softmax(Q K^T / sqrt(D)) V`` that materialises the full score matrix.

The baseline every other variant is compared with (Vaswani et al., 2017).
Time ``O(B H Nq Nk D)``, memory ``O(B H Nq Nk)`` (scores and probabilities both live at once).
"""

from __future__ import annotations

from .base import AttentionVariant
from .masks import combined_mask, safe_softmax
from .registry import register


@register("naive")
class NaiveAttention(AttentionVariant):
    """Dense scaled dot-product attention, written out in three tensor ops."""

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        # scale q first: in fp16, q k^T can overflow before a division
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (B, H, Nq, Nk)
        mask = combined_mask(
            q.shape[0],
            q.shape[2],
            k.shape[2],
            causal=causal,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            device=q.device,
        )
        return safe_softmax(scores, mask) @ v  # (B, H, Nq, Dv)
