"""``chunked``: exact attention in O(N) memory, pure PyTorch (Rabe & Staats, 2021).

Queries are split into chunks; each chunk walks over the keys chunk by chunk with an online softmax
(running max, running sum, running weighted sum), so no ``Nq x Nk`` matrix ever exists. In backward
each query chunk is recomputed (``torch.utils.checkpoint``), so memory stays linear there too.
Time ``O(B H Nq Nk D)``; memory ``O(B H (Nq Dv + q_chunk * k_chunk))``. Low-precision inputs are
accumulated in float32, as the fused kernels do.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .base import AttentionVariant
from .registry import register


def _query_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kpm: torch.Tensor | None,
    am: torch.Tensor | None,
    q_start: int,
    k_chunk: int,
    causal: bool,
) -> torch.Tensor:
    """Attention of ``q (B,H,cq,D)`` (rows from ``q_start``) over all ``k``, ``v``: ``(B,H,cq,Dv)``."""
    b, h, cq, _ = q.shape
    nk = k.shape[2]
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q = q.to(work) * q.shape[-1] ** -0.5
    m = torch.full((b, h, cq, 1), float("-inf"), dtype=work, device=q.device)  # running max
    s = torch.zeros((b, h, cq, 1), dtype=work, device=q.device)  # running sum of exp
    acc = torch.zeros((b, h, cq, v.shape[-1]), dtype=work, device=q.device)  # running sum of p v
    rows = torch.arange(q_start, q_start + cq, device=q.device)[:, None]  # (cq, 1)
    k_end = min(nk, q_start + cq) if causal else nk  # keys after the last query are never seen
    for ks in range(0, k_end, k_chunk):
        ke = min(ks + k_chunk, k_end)
        scores = q @ k[:, :, ks:ke].to(work).transpose(-2, -1)  # (B, H, cq, ck)
        allowed = None
        if causal:
            allowed = torch.arange(ks, ke, device=q.device)[None, :] <= rows  # (cq, ck)
        if kpm is not None:
            pad = kpm[:, None, None, ks:ke]  # (B, 1, 1, ck)
            allowed = pad if allowed is None else allowed & pad
        if am is not None:
            part = am[..., ks:ke]
            allowed = part if allowed is None else allowed & part
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        # the max only stabilises exp: detached, since the result does not depend on it
        m_new = torch.maximum(m, scores.detach().amax(dim=-1, keepdim=True))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(scores - m_safe)  # (B, H, cq, ck); masked entries are exactly 0
        corr = torch.exp(m - m_safe)  # rescales what was summed under the old max
        s = s * corr + p.sum(dim=-1, keepdim=True)
        acc = acc * corr + p @ v[:, :, ks:ke].to(work)
        m = m_new
    return acc / torch.where(s > 0, s, torch.ones_like(s))  # empty rows: 0 / 1 = 0


@register("chunked")
class ChunkedAttention(AttentionVariant):
    """Memory-efficient exact attention: online softmax over key chunks, per query chunk."""

    example_knobs = ({"query_chunk": 5, "key_chunk": 7},)

    def __init__(self, query_chunk: int = 512, key_chunk: int = 512) -> None:
        super().__init__()
        if query_chunk < 1 or key_chunk < 1:
            raise ValueError(
                f"chunk sizes must be >= 1, got query_chunk={query_chunk}, key_chunk={key_chunk}"
            )
        self.query_chunk = query_chunk
        self.key_chunk = key_chunk

    def knobs(self) -> dict[str, object]:
        return {"query_chunk": self.query_chunk, "key_chunk": self.key_chunk}

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        nq = q.shape[2]
        am = None
        if attn_mask is not None:
            am = attn_mask
            while am.dim() < 4:
                am = am.unsqueeze(0)  # (B|1, H|1, Nq|1, Nk)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        outs = []
        for qs in range(0, nq, self.query_chunk):
            qe = min(qs + self.query_chunk, nq)
            am_c = None if am is None else (am[..., qs:qe, :] if am.shape[-2] > 1 else am)
            args = (q[:, :, qs:qe], k, v, key_padding_mask, am_c, qs, self.key_chunk, causal)
            if grad:
                out = checkpoint(_query_chunk, *args, use_reentrant=False)
            else:
                out = _query_chunk(*args)
            outs.append(out)
        return torch.cat(outs, dim=2).to(q.dtype)  # (B, H, Nq, Dv)
