"""``linformer``: softmax attention over keys and values projected along the sequence (Wang et al.
2020, "Linformer: Self-Attention with Linear Complexity").

With learned length projections ``E, F (P, max_len)`` (``P = proj_len``) cut to their first ``Nk``
columns:

    out = softmax(Q (E K)^T * scale) (F V)            E K: (P, D), F V: (P, Dv)

so each query scores ``P`` projected keys instead of ``Nk`` keys. One ``E``, ``F`` pair serves every
head (the paper's headwise sharing, as in lucidrains' ``linformer``); keys and values keep separate
projections (no key-value sharing). Each instance has its own parameters: a model builds one per
layer, as the task models do. The parameters are drawn from torch's global generator (reproducible
given its seed, different per layer), Xavier-uniform with gain ``1/sqrt(2)`` over ``(P, max_len)``,
as the paper's fairseq code initialises its ``compress_k`` / ``compress_v`` layers.

Defaults: ``proj_len = 256``, the paper's main setting (its tables show quality close to full
attention from ``k = 128-256``); ``max_len = 16384``, the longest length of the suite's CPU sweeps
(``experiment=scaling``), so the variant runs there at its defaults. It costs ``2 P max_len``
parameters, 8.4M (32 MiB in fp32) per instance: a trained model sets ``max_len`` to its own length.
``Nk > max_len`` is refused: the projections have no column for those keys.

Key padding: padded keys and values are zeroed before projecting, so no sum ``E K``, ``F V`` includes
them; a sequence with no real key projects to zeros and outputs zeros. No causal form (every
projected key mixes the whole sequence, future included) and no ``attn_mask`` (the ``Nq x Nk`` scores
are never formed). ``Nq != Nk`` is fine (each query reads the same projected keys); with ``Nq < Nk``
the projections are recomputed over the whole cache at every call. Grouped K/V heads are projected
once per K/V head and read by SDPA's own grouping (no copy).

Shapes: ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` -> ``(B, H, Nq, Dv)``. Time
``O(B (Hkv Nk + H Nq) P (D + Dv))``, memory ``O(B H Nq P)``: linear in ``N``. fp16/bf16 inputs are
computed in float32 (the projections sum ``Nk`` terms).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import AttentionVariant, Unsupported, Workload
from .reference import linformer_reference
from .registry import register


@register("linformer")
class LinformerAttention(AttentionVariant):
    """Softmax attention to ``proj_len`` learned projections of the keys and values along N."""

    exact = False  # a different operator from full attention: rank at most proj_len
    has_params = True
    size_knob = "proj_len"
    supports_causal = False
    supports_attn_mask = False
    native_gqa = True
    native_scale = True
    # fewer projected keys than keys, and more than keys (P = 32 > N = 24: rank still at most N); the
    # first also fits the regression gates' N = 256
    example_knobs = (
        {"proj_len": 8, "max_len": 256},
        {"proj_len": 32, "max_len": 24},
    )

    def __init__(self, proj_len: int = 256, max_len: int = 16384) -> None:
        super().__init__()
        if proj_len < 1 or max_len < 1:
            raise ValueError(f"proj_len and max_len must be >= 1; got {proj_len}, {max_len}")
        self.proj_len = proj_len
        self.max_len = max_len
        self.e = nn.Parameter(torch.empty(proj_len, max_len))  # E: projects the keys along N
        self.f = nn.Parameter(torch.empty(proj_len, max_len))  # F: projects the values along N
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform with gain ``1/sqrt(2)`` (fairseq's Linformer), from torch's global generator."""
        with torch.no_grad():
            for p in (self.e, self.f):
                nn.init.xavier_uniform_(p, gain=1 / math.sqrt(2))

    def knobs(self) -> dict[str, object]:
        return {"proj_len": self.proj_len, "max_len": self.max_len}

    def check(self, w: Workload) -> None:
        if w.causal:
            raise Unsupported(
                "linformer has no causal form: each projected key E K mixes every key of the sequence, "
                "later ones included"
            )
        if w.attn_mask:
            raise Unsupported(
                "linformer cannot take an arbitrary attn_mask: queries score proj_len projected keys, "
                "never the Nq x Nk pairs a mask selects"
            )
        super().check(w)
        if w.nk > self.max_len:
            raise Unsupported(
                f"linformer was built with max_len={self.max_len} (E, F are proj_len x max_len): "
                f"Nk={w.nk} keys have no projection columns; build it with max_len >= {w.nk}"
            )

    def oracle_graph_bytes(self, w: Workload, rows: int | None = None) -> int:
        """The gradient check's peak: four float64 ``(N, proj_len)`` tensors per query head (its scores
        against the projected keys, their softmax and the gradients; the profiler: 0.8-1.0x this at
        N=128-1024), and float64 q, k, v and their gradients. It grows as ``N``, not ``N^2``; every row
        is counted whatever ``rows`` (an upper bound: small beside the budget at any N). ``O(1)``."""
        return 4 * 8 * w.batch * w.heads * w.nq * self.proj_len + 2 * self._oracle_input_bytes(w)

    def flops(self, w: Workload, mode: str = "fwd") -> int:
        """FLOPs of the algorithm: the projections ``E K``, ``F V`` (``2 P Nk (D + Dv)`` per K/V head)
        and the two ``Nq x P`` products (``2 Nq P (D + Dv)`` per query head). Backward counts 2.5x."""
        p = self.proj_len
        proj = w.hkv * 2 * p * w.nk * (w.head_dim + w.v_head_dim)
        attend = w.heads * 2 * w.nq * p * (w.head_dim + w.v_head_dim)
        fwd = w.batch * (proj + attend)
        factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
        return int(fwd * factor)

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None):
        nk = k.shape[2]
        # fp16/bf16 inputs or parameters -> float32; float64 stays float64
        work = torch.promote_types(torch.promote_types(q.dtype, self.e.dtype), torch.float32)
        k, v = k.to(work), v.to(work)
        if key_padding_mask is not None:
            real = key_padding_mask[:, None, :, None]  # (B, 1, Nk, 1)
            k, v = k.masked_fill(~real, 0), v.masked_fill(~real, 0)  # padded keys add nothing to E K
        k_proj = torch.einsum("pn,bhnd->bhpd", self.e[:, :nk].to(work), k)  # (B, Hkv, P, D)
        v_proj = torch.einsum("pn,bhnd->bhpd", self.f[:, :nk].to(work), v)  # (B, Hkv, P, Dv)
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        out = F.scaled_dot_product_attention(q.to(work), k_proj, v_proj, scale=scale, **gqa)  # (B,H,Nq,Dv)
        return out.to(q.dtype)

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
        """The float64 formula written separately (:func:`variants.reference.linformer_reference`)."""
        self.check(
            Workload.of(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        )
        return linformer_reference(
            q, k, v, self.e, self.f, key_padding_mask=key_padding_mask, scale=scale, rows=rows
        )
