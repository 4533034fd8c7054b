"""``deltanet``: linear attention with the delta rule (Schlag et al. 2021; Yang et al. 2024,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length").

With L2-normalised keys ``k_t``, a learned write strength ``beta_t`` and the scale ``s`` (default
``1/sqrt(D)``), the state ``S (D, Dv)`` replaces what it holds for ``k_t`` by ``v_t``, in part:

    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (s q_t),   beta_t = sigmoid(k_t . w_h + b_h)

(the issue's ``S_{t-1} (I - beta k k^T) + beta v k^T`` is this state transposed; ``beta`` is a
projection of the raw key, before it is normalised). Parameters per head: ``w (D,)``, ``b``:
``H (D + 1)``. The chunked form is the WY representation (``variants/gated_core.py``: one batched
triangular solve per chunk); flash-linear-attention's ``delta_rule_chunkwise(q, k, v, beta)`` and
``naive_recurrent_gated_delta_rule`` (with ``g = 0``) compute the same on normalised keys, with
``q`` scaled by the caller.

Causal only, bottom-right for ``Nq <= Nk``; a padded key writes nothing. ``O(N chunk (D + Dv) + N D
Dv)`` time, a ``D x Dv`` state per head when decoding. Shapes as for every variant; 16-bit inputs in
float32.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .base import Workload
from .gated_core import GatedRecurrence, init_uniform_
from .gated_reference import Gate
from .registry import register


def write_strength(k: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``beta = sigmoid(k . w_h + b_h)``: ``(B, H, N)`` for ``k (B, H, N, D)``, ``w (H, D)``, ``b (H,)``."""
    return torch.sigmoid(torch.einsum("bhnd,hd->bhn", k, w) + b[:, None])


def write_strength_reference(k: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same in float64, written out: ``1 / (1 + e^-x)``."""
    x = (k.double() * w.double()[:, None, :]).sum(-1) + b.double()[:, None]  # (B, H, N)
    return 1.0 / (1.0 + torch.exp(-x))


@register("deltanet")
class DeltaNet(GatedRecurrence):
    """The delta rule: ``S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, unit keys."""

    delta = True
    example_knobs = ({"chunk": 5}, {"chunk": 1}, {"chunk": 64})

    def __init__(self, heads: int = 8, head_dim: int = 64, chunk: int = 64) -> None:
        super().__init__()
        self._keep_sizes(heads, head_dim, chunk)
        self.w_beta = nn.Parameter(torch.empty(heads, head_dim))
        self.b_beta = nn.Parameter(torch.empty(heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``w`` uniform within ``1/sqrt(D)``, ``b = 0`` (``beta`` near 1/2 to start)."""
        init_uniform_(self.w_beta, self.head_dim**-0.5)
        with torch.no_grad():
            self.b_beta.zero_()

    def _gates(self, k):
        return None, write_strength(k, self.w_beta.to(k.dtype), self.b_beta.to(k.dtype))

    def _gate_flops(self, w: Workload) -> int:
        return w.batch * w.heads * w.nk * (2 * w.head_dim + 4)

    def _reference_gates(self) -> tuple[Gate, Gate]:
        def strength(keys: torch.Tensor) -> torch.Tensor:  # a block of keys per query head, float64
            return write_strength_reference(keys, self.w_beta, self.b_beta)

        return None, strength
