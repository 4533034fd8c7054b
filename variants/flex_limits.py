"""What FlexAttention's kernels refuse, in one place for ``flex`` and the pattern variants that route
their pattern to it (``local_window`` and ``sparse`` with ``impl=flex`` or ``auto`` on CUDA).

Facts, checked on torch 2.13 CPU and torch 2.11 on an H100: compiled kernels refuse float64; there is
no backward on the CPU; the CUDA (Triton) kernel refuses head sizes below 16 ("NYI: embedding
dimension of the query, key, and value must be at least 16") and block-mask tiles narrower than its
own (128 covers every GPU's configuration; 64 is refused on an H100).
"""

from __future__ import annotations

import torch

from .base import Workload

CUDA_TILE = 128  # a block-mask tile every GPU's Triton kernel configuration divides
MIN_HEAD_DIM_CUDA = 16


def fits_cuda_tile(block: int) -> bool:
    """Whether a layout of ``block``-wide blocks can be a FlexAttention block mask on CUDA: exactly
    (``block`` a multiple of the tile) or through its predicate inside tiles (``block`` divides it)."""
    return CUDA_TILE % block == 0 or block % CUDA_TILE == 0


def flex_refusal(w: Workload, compiled: bool = True) -> str | None:
    """Why FlexAttention cannot run ``w`` (a short reason), or None if it can."""
    if compiled and w.dtype == torch.float64:
        return "does not support float64 (compiled kernels)"
    if w.backward and w.device == "cpu":
        return "has no backward on the CPU (FlexAttention)"
    if compiled and w.device == "cuda" and min(w.head_dim, w.v_head_dim) < MIN_HEAD_DIM_CUDA:
        return (
            f"needs head sizes of at least {MIN_HEAD_DIM_CUDA} on CUDA (the Triton kernel); "
            f"got D={w.head_dim}, Dv={w.v_head_dim}"
        )
    return None
