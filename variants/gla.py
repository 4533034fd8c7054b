"""``gla``: gated linear attention (Yang et al. 2024, "Gated Linear Attention Transformers with
Hardware-Efficient Training").

A learned decay per head, position and key feature: with the scale ``s`` (default ``1/sqrt(D)``),

    S_t = diag(a_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T (s q_t),   a_t = exp(g_t),
    g_t = max(logsigmoid(k_t W1_h W2_h + b_h) / 16, -1)

(the paper's gate: a low-rank projection, rank ``gate_rank`` = 16, and its normaliser 16, so a decay
stays near 1; here of the key, since the core is handed ``q, k, v``). The floor ``g >= -1`` (a
feature decays by at most ``e^-1`` a token) keeps the chunked form's ``e^{-G}`` within float32 over a
chunk of at most 64 positions (``variants/gated_core.py``); the paper's gate reaches it only for
``logsigmoid < -16``. Parameters per head: ``W1 (D, r)``, ``W2 (r, D)``, ``b (D,)``: ``H (2 D r +
D)``, shrunk by ``gate_rank`` in a task model's parameter budget. flash-linear-attention's
``naive_recurrent_gla(q, k, v, gk)`` takes these ``g`` as ``gk`` in its ``(B, N, H, D)`` layout (it
has no pure-PyTorch chunked form).

Causal only, bottom-right for ``Nq <= Nk``; a padded key neither writes nor decays. ``O(N chunk (D +
Dv) + N D Dv)`` time, a ``D x Dv`` state per head when decoding. Shapes as for every variant; 16-bit
inputs in float32.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as fn

from .base import Workload
from .gated_core import GatedRecurrence, init_uniform_
from .gated_reference import Gate
from .registry import register

NORMALISER = 16.0  # the paper's: g = logsigmoid(.) / 16
FLOOR = -1.0  # the smallest log decay a token may apply
MAX_CHUNK = 64  # e^{-G} <= e^{64} inside a chunk


def vector_decay(k: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``max(logsigmoid(k W1_h W2_h + b_h) / 16, -1)``: ``(B, H, N, D)`` for ``k (B, H, N, D)``,
    ``w1 (H, D, r)``, ``w2 (H, r, D)``, ``b (H, D)``."""
    x = torch.einsum("bhnr,hrd->bhnd", torch.einsum("bhnd,hdr->bhnr", k, w1), w2) + b[:, None]
    return (fn.logsigmoid(x) / NORMALISER).clamp(min=FLOOR)


def vector_decay_reference(
    k: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """The same gate in float64, its log-sigmoid written out: ``log(1 / (1 + e^-x)) = -log1p(e^-x)``.
    The two products as matrix products: a broadcast product summed over ``D`` would hold ``(B, H, N,
    D, r)`` float64 (64 GiB for 128k keys on 32 heads of 128)."""
    x = k.double() @ w1.double()[None]  # (B, H, N, D) @ (1, H, D, r) -> (B, H, N, r)
    x = x @ w2.double()[None] + b.double()[:, None]  # (B, H, N, r) @ (1, H, r, D) -> (B, H, N, D)
    logsig = torch.where(x < -30, x, -torch.log1p(torch.exp(-torch.clamp(x, min=-30))))
    return torch.maximum(logsig / NORMALISER, torch.tensor(FLOOR, dtype=torch.float64))


@register("gla")
class GatedLinearAttention(GatedRecurrence):
    """``S_t = diag(a_t) S_{t-1} + k_t v_t^T`` with a learned decay per key feature."""

    size_knob = "gate_rank"
    vector_gate = True
    example_knobs = (
        {"chunk": 5, "gate_rank": 2},
        {"chunk": 1, "gate_rank": 4},
        {"chunk": 64, "gate_rank": 16},
    )

    def __init__(self, heads: int = 8, head_dim: int = 64, gate_rank: int = 16, chunk: int = 64) -> None:
        super().__init__()
        if heads < 1 or head_dim < 1 or gate_rank < 1 or not 1 <= chunk <= MAX_CHUNK:
            raise ValueError(
                f"heads, head_dim, gate_rank must be >= 1 and chunk in 1..{MAX_CHUNK} (the chunked form's "
                f"e^-G must stay in float32); got {heads}, {head_dim}, {gate_rank}, {chunk}"
            )
        self.heads, self.head_dim, self.gate_rank, self.chunk = heads, head_dim, gate_rank, chunk
        self.w1 = nn.Parameter(torch.empty(heads, head_dim, gate_rank))
        self.w2 = nn.Parameter(torch.empty(heads, gate_rank, head_dim))
        self.b = nn.Parameter(torch.empty(heads, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W1``, ``W2`` uniform within ``1/sqrt(fan_in)``; ``b`` uniform in [1, 5], so a decay starts
        at ``sigmoid(b)^(1/16)``: 0.98-0.9996 a token (deterministic given torch's global seed)."""
        init_uniform_(self.w1, self.head_dim**-0.5)
        init_uniform_(self.w2, self.gate_rank**-0.5)
        with torch.no_grad():
            self.b.uniform_(1.0, 5.0)

    def knobs(self) -> dict[str, object]:
        return {"gate_rank": self.gate_rank, "chunk": self.chunk}

    def _gates(self, k):
        return vector_decay(k, self.w1.to(k.dtype), self.w2.to(k.dtype), self.b.to(k.dtype)), None

    def _gate_flops(self, w: Workload) -> int:
        per = 2 * w.head_dim * self.gate_rank * 2 + 5 * w.head_dim  # two products, bias, logsigmoid, clamp
        return w.batch * w.heads * w.nk * per

    def _reference_gates(self) -> tuple[Gate, Gate]:
        def gates(keys: torch.Tensor) -> torch.Tensor:  # a block of keys per query head, float64
            return vector_decay_reference(keys, self.w1, self.w2, self.b)

        return gates, None
