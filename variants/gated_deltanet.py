"""``gated_deltanet``: the gated delta rule (Yang et al. 2025, "Gated Delta Networks"), the core of
Qwen3-Next's and Kimi Linear's linear-attention layers.

The delta rule of ``deltanet`` with ``ssd``'s scalar decay in front: with L2-normalised keys and the
scale ``s`` (default ``1/sqrt(D)``),

    S_t = (I - beta_t k_t k_t^T) (a_t S_{t-1}) + beta_t k_t v_t^T,   o_t = S_t^T (s q_t)
    a_t = exp(g_t),  g_t = -exp(A_h) softplus(k_t . w_h + b_h),  beta_t = sigmoid(k_t . w'_h + b'_h)

(the issue's ``a_t S_{t-1} (I - beta k k^T) + beta v k^T`` transposed; both gates are projections of
the raw key). Parameters per head: ``H (2 D + 3)``. flash-linear-attention's
``naive_chunk_gated_delta_rule(q, k, v, g, beta)`` computes the same on normalised keys. The chunked
form is the WY representation with the decay inside each chunk (``variants/gated_core.py``).

Causal only, bottom-right for ``Nq <= Nk``; a padded key neither writes nor decays. ``O(N chunk (D +
Dv) + N D Dv)`` time, a ``D x Dv`` state per head when decoding. Shapes as for every variant; 16-bit
inputs in float32.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .base import Workload
from .deltanet import write_strength, write_strength_reference
from .gated_core import GatedRecurrence, dt_init, init_uniform_
from .gated_reference import Gate
from .registry import register
from .ssd import scalar_decay, scalar_decay_reference


@register("gated_deltanet")
class GatedDeltaNet(GatedRecurrence):
    """The delta rule after a learned scalar decay per head and position."""

    delta = True
    example_knobs = ({"chunk": 5}, {"chunk": 1}, {"chunk": 64})

    def __init__(self, heads: int = 8, head_dim: int = 64, chunk: int = 64) -> None:
        super().__init__()
        self._keep_sizes(heads, head_dim, chunk)
        self.w = nn.Parameter(torch.empty(heads, head_dim))  # the decay's time step
        self.b = nn.Parameter(torch.empty(heads))
        self.a_log = nn.Parameter(torch.empty(heads))
        self.w_beta = nn.Parameter(torch.empty(heads, head_dim))  # the write strength
        self.b_beta = nn.Parameter(torch.empty(heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The decay as ``ssd``'s (Mamba-2's), the write strength as ``deltanet``'s."""
        init_uniform_(self.w, self.head_dim**-0.5)
        init_uniform_(self.w_beta, self.head_dim**-0.5)
        with torch.no_grad():
            self.b.copy_(dt_init(self.heads))
            self.a_log.copy_(torch.log(torch.empty(self.heads).uniform_(1.0, 16.0)))
            self.b_beta.zero_()

    def _gates(self, k):
        g = scalar_decay(k, self.w.to(k.dtype), self.b.to(k.dtype), self.a_log.to(k.dtype))
        return g, write_strength(k, self.w_beta.to(k.dtype), self.b_beta.to(k.dtype))

    def _gate_flops(self, w: Workload) -> int:
        return w.batch * w.heads * w.nk * (4 * w.head_dim + 10)

    def _reference_gates(self) -> tuple[Gate, Gate]:
        def gates(keys: torch.Tensor) -> torch.Tensor:  # a block of keys per query head, float64
            return scalar_decay_reference(keys, self.w, self.b, self.a_log)

        def strength(keys: torch.Tensor) -> torch.Tensor:
            return write_strength_reference(keys, self.w_beta, self.b_beta)

        return gates, strength
