"""``retention``: RetNet's retention (Sun et al. 2023, "Retentive Network"), causal only.

For head ``h`` with decay ``gamma_h = 1 - 2^(-5-h)`` (RetNet's, one per head) and the scale ``s``
(default ``1/sqrt(D)``), the output at position ``i`` is

    o_i = sum_{j <= i} gamma_h^(i - j) (s q_i . k_j) v_j

(flash-linear-attention's ``naive_retention`` is this formula; RetNet's group norm and gate belong to
the layer around it). No softmax and no normalisation. The decay is over positions: a padded key
still takes its position but is in no sum; a query that sees no key gives zeros. Bottom-right causal
for ``Nq <= Nk``. Non-causal attention is refused: the formula is a decay over the past.

Three forms, one output: the parallel form (one chunk of all ``N`` positions, the ``N x N`` decayed
score matrix: ``chunk >= N``), the chunked form (``chunk`` positions at a time, ``O(N chunk (D + Dv)
+ N D Dv)``) and the recurrent form (``chunk=1``; and :meth:`step`, token by token with the ``D x Dv``
state per head, constant in the context length). All of them are the core of
``variants/linear_core.py`` with log weights ``l_j = j lambda_h``, ``r_t = t lambda_h``,
``lambda_h = -log gamma_h``. Shapes: ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)``
-> ``(B, H, Nq, Dv)``; 16-bit inputs are summed in float32, positions in float64.
"""

from __future__ import annotations

import torch

from .base import Unsupported, Workload
from .linear_core import KernelizedAttention
from .reference import retention_reference
from .registry import register


def decay_rates(heads: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``lambda_h = -log(gamma_h)``, ``gamma_h = 1 - 2^(-5-h)``, for ``h < heads``: ``(H,)`` float64."""
    h = torch.arange(heads, dtype=torch.float64, device=device)
    return -torch.log1p(-torch.exp2(-5.0 - h))


@register("retention")
class Retention(KernelizedAttention):
    """``sum_{j <= i} gamma_h^(i-j) (s q_i . k_j) v_j`` through the chunked decayed state."""

    supports_noncausal = False  # refused in check with the reason
    supports_cross = False  # the decay needs the queries' positions among the keys' (Nq <= Nk)
    weighted = True
    # the chunked form over several chunks, the recurrent form (chunk 1), the parallel form (one chunk)
    example_knobs = ({"chunk": 5}, {"chunk": 1}, {"chunk": 64})

    def __init__(self, chunk: int = 64) -> None:
        super().__init__()
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunk = chunk

    def knobs(self) -> dict[str, object]:
        return {"chunk": self.chunk}

    def check(self, w: Workload) -> None:
        if not w.causal and not w.cross:  # (cross: refused as such by the base class)
            raise Unsupported(
                "retention is causal only: its decay gamma^(i-j) weighs the past of each query "
                "(pass causal=True)"
            )
        super().check(w)

    def oracle_forward(
        self, q, k, v, *, causal=True, key_padding_mask=None, attn_mask=None, scale=None, rows=None
    ) -> torch.Tensor:
        """Float64 retention written densely (``retention_reference``), ``(B, H, R, Dv)`` for
        the query ``rows`` (all ``Nq`` when None)."""
        if attn_mask is not None:
            raise Unsupported("retention never forms the (Nq, Nk) scores an attn_mask would mask")
        return retention_reference(
            q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, rows=rows
        )

    def _features(self, q, k, scale, valid, start, ref0, causal):
        pos = torch.arange(start, start + k.shape[2], dtype=torch.float64, device=k.device)  # (Nk,)
        log_pos = (decay_rates(k.shape[1], k.device)[:, None] * pos)[None]  # (1, H, Nk): t lambda_h
        kf, log_k = k, log_pos
        if valid is not None:  # a padded key keeps its position but is in no sum
            kf = torch.where(valid[..., None], k, 0.0)  # (B, H, Nk, D)
            log_k = torch.where(valid, log_pos, float("-inf"))  # (B, H, Nk)
        return None if q is None else q * scale, kf, log_k, log_pos

    def _state_dims(self, w: Workload) -> tuple[int, int, int]:
        return w.head_dim, w.v_head_dim, 8  # the reference is a float64 log position

    def _feature_flops(self, w: Workload) -> int:
        return w.batch * w.heads * w.nq * w.head_dim  # the scale on q
