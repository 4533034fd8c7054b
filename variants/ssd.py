"""``ssd``: Mamba-2's state-space duality core (Dao and Gu 2024), flash-linear-attention's ``simple_gla``.

One scalar decay per head and position, learned: with the scale ``s`` (default ``1/sqrt(D)``),

    S_t = a_t S_{t-1} + k_t v_t^T,   o_t = S_t^T (s q_t),   a_t = exp(g_t),
    g_t = -exp(A_h) softplus(k_t . w_h + b_h)

(Mamba-2's ``a_t = exp(dt_t A)`` with ``dt_t = softplus(x_t W + dt_bias)`` and ``A = -exp(A_log)``,
one ``A`` per head; here the time step is a projection of the key, since the core is handed ``q, k,
v``). Mamba-2 also multiplies the write by the time step (``dt_t B_t x_t``); this core writes
``k_t v_t^T`` as ``simple_gla`` does, leaving that factor to whatever makes ``k`` or ``v``.
Parameters per head: ``w (D,)``, ``b`` (Mamba's time-step bias: ``softplus(b)`` log-uniform in
``[0.001, 0.1]``) and ``A`` (``exp(A)`` uniform in ``[1, 16]``, Mamba-2's range): ``H (D + 2)`` in
all. flash-linear-attention's ``naive_chunk_simple_gla(q, k, v, g)`` takes these ``g`` in its
``(B, N, H)`` layout.

Causal only (the decay runs over the past), bottom-right for ``Nq <= Nk``; a padded key neither
writes nor decays. The chunked form of ``variants/gated_core.py``: ``O(N chunk (D + Dv) + N D Dv)``
time, a ``D x Dv`` state per head when decoding, whatever the context. Shapes: ``q (B, H, Nq, D)``,
``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` -> ``(B, H, Nq, Dv)``; 16-bit inputs in float32.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as fn

from .base import Workload
from .gated_core import GatedRecurrence, dt_init, init_uniform_
from .gated_reference import Gate, softplus_reference
from .registry import register


def scalar_decay(k: torch.Tensor, w: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
    """``g = -exp(A_h) softplus(k . w_h + b_h)``: ``(B, H, N)`` for ``k (B, H, N, D)``, ``w (H, D)``,
    ``b, a_log (H,)``."""
    dt = fn.softplus(torch.einsum("bhnd,hd->bhn", k, w) + b[:, None])  # (B, H, N)
    return -a_log.exp()[:, None] * dt


def scalar_decay_reference(
    k: torch.Tensor, w: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor
) -> torch.Tensor:
    """The same gate in float64, written with the reference's softplus."""
    x = (k.double() * w.double()[:, None, :]).sum(-1) + b.double()[:, None]  # (B, H, N)
    return -a_log.double().exp()[:, None] * softplus_reference(x)


@register("ssd")
class StateSpaceDuality(GatedRecurrence):
    """``S_t = a_t S_{t-1} + k_t v_t^T`` with a learned scalar decay per head and position."""

    example_knobs = ({"chunk": 5}, {"chunk": 1}, {"chunk": 64})

    def __init__(self, heads: int = 8, head_dim: int = 64, chunk: int = 64) -> None:
        super().__init__()
        self._keep_sizes(heads, head_dim, chunk)
        self.w = nn.Parameter(torch.empty(heads, head_dim))  # the time step's projection of the key
        self.b = nn.Parameter(torch.empty(heads))  # the time-step bias
        self.a_log = nn.Parameter(torch.empty(heads))  # A = -exp(a_log)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Mamba-2's: ``softplus(b)`` log-uniform in [0.001, 0.1], ``exp(A)`` uniform in [1, 16]; ``w``
        uniform within ``1/sqrt(D)`` (deterministic given torch's global seed)."""
        init_uniform_(self.w, self.head_dim**-0.5)
        with torch.no_grad():
            self.b.copy_(dt_init(self.heads))
            self.a_log.copy_(torch.log(torch.empty(self.heads).uniform_(1.0, 16.0)))

    def _gates(self, k):
        return scalar_decay(k, self.w.to(k.dtype), self.b.to(k.dtype), self.a_log.to(k.dtype)), None

    def _gate_flops(self, w: Workload) -> int:
        return w.batch * w.heads * w.nk * (2 * w.head_dim + 6)  # the projection, softplus, exp, scale

    def _reference_gates(self) -> tuple[Gate, Gate]:
        def gates(keys: torch.Tensor) -> torch.Tensor:  # a block of keys per query head, float64
            return scalar_decay_reference(keys, self.w, self.b, self.a_log)

        return gates, None
