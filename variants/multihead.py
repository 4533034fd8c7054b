"""Multi-head attention layer whose attention core is any registered variant.

The standard layer of Vaswani et al. (2017): project the inputs to queries, keys and values, split
the model dimension into ``heads`` heads, attend per head with the chosen variant, merge the heads and
project back. Shapes: ``x_q (B, Nq, E)``, ``x_kv (B, Nk, Ekv)`` -> ``(B, Nq, E)``; the core sees
``(B, H, N, E / H)``. Time and memory are the projections' ``O(B N E (E + Ekv))`` plus the core's.

Masks follow the suite's convention (True = may attend; ``key_padding_mask`` is True for a real key),
the opposite of ``torch.nn.MultiheadAttention``.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import AttentionVariant
from .registry import build


class MultiHeadAttention(nn.Module):
    """Q/K/V/output projections around an attention variant (not registered: it is a layer).

    ``variant`` is a registered name, built with ``heads``, ``head_dim = embed_dim // heads`` (passed
    only to variants that take them) and ``**knobs``; or an already built variant (then no knobs).
    """

    def __init__(
        self,
        embed_dim: int,
        heads: int,
        variant: str | AttentionVariant = "sdpa",
        kv_dim: int | None = None,
        bias: bool = True,
        **knobs: object,
    ) -> None:
        super().__init__()
        if embed_dim < 1 or heads < 1 or embed_dim % heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of heads ({heads})")
        self.embed_dim = embed_dim
        self.heads = heads
        self.head_dim = embed_dim // heads
        self.kv_dim = embed_dim if kv_dim is None else kv_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(self.kv_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.kv_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        if isinstance(variant, AttentionVariant):
            if knobs:
                raise TypeError(f"knobs {sorted(knobs)} given with an already built variant")
            self.core = variant
        else:
            self.core = build(variant, heads=heads, head_dim=self.head_dim, **knobs)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform projection weights and zero biases, as ``nn.MultiheadAttention`` does."""
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        # (B, N, E) -> (B, N, H, Dh) -> (B, H, N, Dh)
        return x.view(b, n, self.heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x_q: torch.Tensor,
        x_kv: torch.Tensor | None = None,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        cross: bool = False,
    ) -> torch.Tensor:
        """Attend ``x_q (B, Nq, E)`` to ``x_kv (B, Nk, Ekv)`` (default: ``x_q``); returns ``(B, Nq, E)``.
        ``cross=True``: ``x_kv`` is another sequence (an encoder's memory), not the queries' own past,
        so a pattern core does not place the queries at its last positions (the core's ``cross``)."""
        if x_kv is None:
            x_kv = x_q
        b, nq, _ = x_q.shape
        q = self._split(self.q_proj(x_q))  # (B, H, Nq, Dh)
        k = self._split(self.k_proj(x_kv))  # (B, H, Nk, Dh)
        v = self._split(self.v_proj(x_kv))  # (B, H, Nk, Dh)
        kw = {"cross": True} if cross else {}
        out = self.core(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask, **kw)
        # (B, H, Nq, Dh) -> (B, Nq, H, Dh) -> (B, Nq, E)
        out = out.transpose(1, 2).reshape(b, nq, self.embed_dim)
        return self.out_proj(out)
