"""``naive``: textbook ``softmax(Q K^T / sqrt(D) + bias) V`` that materialises the full score matrix.

Soft-capping (``softcap=c``: each scaled score ``s`` becomes ``c tanh(s / c)`` before bias and masks,
as Gemma2 does) is applied to the scores it holds anyway.

The baseline every other variant is compared with (Vaswani et al., 2017). Grouped K/V heads are read
through a grouped view of the queries (no copy of K or V).
Time ``O(B H Nq Nk D)``, memory ``O(B H Nq Nk)`` (scores and probabilities both live at once).
"""

from __future__ import annotations

import torch

from .base import AttentionVariant
from .masks import combined_mask, safe_softmax
from .registry import register


@register("naive")
class NaiveAttention(AttentionVariant):
    """Dense scaled dot-product attention, written out in three tensor ops."""

    supports_bias = True
    supports_sinks = True  # one more key in front (base.forward)
    supports_softcap = True
    bias_backward = True
    native_gqa = True
    native_scale = True

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None, bias=None, softcap=None):
        b, h, nq, d = q.shape
        hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
        # scale q first: in fp16, q k^T can overflow before a division. Grouped heads: the G query
        # heads of a K/V head are one longer query sequence, so each K/V head is read by one plain
        # batched matmul (a broadcast batch dim would copy K G times). One expression, so the scaled
        # q is freed before the softmax
        qg = (q * (d**-0.5 if scale is None else scale)).reshape(b, hkv, (h // hkv) * nq, d)  # (B,Hkv,G*Nq,D)
        scores = (qg @ k.transpose(-2, -1)).view(b, h, nq, nk)  # (B, Hkv, G*Nq, Nk) -> (B, H, Nq, Nk)
        del qg
        if softcap is not None:  # Gemma2's soft-capping, after the scale, before bias and masks
            scores = softcap * torch.tanh(scores / softcap)
        if bias is not None:
            scores = scores + bias
        mask = combined_mask(
            b, nq, nk, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask, device=q.device
        )
        p = safe_softmax(scores, mask).reshape(b, hkv, (h // hkv) * nq, nk)  # (B, Hkv, G*Nq, Nk)
        return (p @ v).view(b, h, nq, dv)  # (B, Hkv, G*Nq, Dv) -> (B, H, Nq, Dv)
