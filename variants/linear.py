"""``linear``: kernelized linear attention (Katharopoulos et al. 2020, "Transformers are RNNs").

With a feature map ``phi`` and the scale ``s`` (default ``1/sqrt(D)``), output row ``i`` is

    out_i = sum_j (s phi(q_i)) . phi(k_j) v_j   [ / sum_j (s phi(q_i)) . phi(k_j)  when normalize ]

over the keys query ``i`` may see (causal: bottom-right aligned; key padding: real keys only; a query
that sees no key gives zeros). ``phi``: ``elu1`` = elu(x) + 1 (the paper's, positive), ``relu``, or
``identity`` (then, with ``normalize=False``, it is flash-linear-attention's
``chunk_linear_attn(q, k, v, scale)``). The sums never form the ``(Nq, Nk)`` scores: non-causal, one
pass through the ``D x Dv`` state ``sum_j phi(k_j) v_j^T``; causal, the chunked form of
``variants/linear_core.py`` (quadratic inside a chunk of ``chunk`` positions, the running state across
chunks). Time ``O(N D Dv)`` non-causal, ``O(N chunk (D + Dv) + N D Dv)`` causal; memory ``O(N (chunk +
D Dv / chunk))``. Decoding keeps the ``D x (Dv + 1)`` state per K/V head (its query heads share it),
whatever the context length.
Shapes: ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` -> ``(B, H, Nq, Dv)``;
16-bit inputs are summed in float32. A normalised row whose denominator is 0 (relu features all 0, no
key) is 0; with ``identity`` the denominator can be any sign, and near 0 the ratio is large: that is
the formula, not guarded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as fn

from .base import Unsupported, Workload
from .linear_core import KernelizedAttention
from .reference import linear_attention_reference
from .registry import register

#: feature map -> (function, FLOPs per element)
FEATURE_MAPS = {
    "elu1": (lambda x: fn.elu(x).add_(1.0), 3),  # compare, exp, add (in place: elu saves its input)
    "relu": (torch.relu, 1),
    "identity": (lambda x: x, 0),
}


@register("linear")
class LinearAttention(KernelizedAttention):
    """``phi(q) (sum_j phi(k_j) v_j^T)``, normalised by ``phi(q) . sum_j phi(k_j)``."""

    native_gqa = True  # phi(k) is the key's alone: keys mapped on their K/V heads, one state a group
    # several chunks at the tests' 24 tokens (5 divides none of their lengths), and one chunk
    example_knobs = (
        {"feature_map": "elu1", "normalize": True, "chunk": 5},
        {"feature_map": "relu", "normalize": True, "chunk": 64},
        {"feature_map": "identity", "normalize": False, "chunk": 8},
    )

    def __init__(self, feature_map: str = "elu1", normalize: bool = True, chunk: int = 64) -> None:
        super().__init__()
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {', '.join(FEATURE_MAPS)}; got {feature_map!r}")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.feature_map = feature_map
        self.normalize = normalize
        self.chunk = chunk
        # normalised weights are divided by their sum, in which a scale cancels: there is none to set
        self.supports_scale = not normalize

    def check(self, w: Workload) -> None:
        # the default scale, spelled out (a decoding state carries it), asks for nothing
        if self.normalize and w.scale is not None and w.scale != w.head_dim**-0.5:
            raise Unsupported(
                f"linear with normalize=True divides each row's weights by their sum, in which a scale "
                f"cancels (scale={w.scale:g} would change nothing): leave scale unset, or pass "
                "normalize=False for a scaled, unnormalised kernel"
            )
        super().check(w)

    def knobs(self) -> dict[str, object]:
        return {"feature_map": self.feature_map, "normalize": self.normalize, "chunk": self.chunk}

    def oracle_forward(
        self, q, k, v, *, causal=False, key_padding_mask=None, attn_mask=None, scale=None, rows=None
    ) -> torch.Tensor:
        """Float64 linear attention written densely (``linear_attention_reference``), ``(B, H, R, Dv)`` for
        the query ``rows`` (all ``Nq`` when None)."""
        if attn_mask is not None:
            raise Unsupported("linear attention never forms the (Nq, Nk) scores an attn_mask would mask")
        return linear_attention_reference(
            q,
            k,
            v,
            feature_map=self.feature_map,
            normalize=self.normalize,
            causal=causal,
            key_padding_mask=key_padding_mask,
            scale=scale,
            rows=rows,
        )

    def _features(self, q, k, scale, valid, start, ref0, causal):
        phi = FEATURE_MAPS[self.feature_map][0]
        kf = phi(k)  # (B, H, Nk, D)
        if valid is not None:
            kf = torch.where(valid[..., None], kf, 0.0)  # padded keys: in no sum
        return None if q is None else phi(q) * scale, kf, None, None

    def _state_dims(self, w: Workload) -> tuple[int, int, int]:
        return w.head_dim, w.v_head_dim + int(self.normalize), 0

    def _feature_flops(self, w: Workload) -> int:
        per = FEATURE_MAPS[self.feature_map][1]
        maps = w.batch * (w.heads * w.nq + self.state_heads(w) * w.nk) * w.head_dim * per
        scale = w.batch * w.heads * w.nq * w.head_dim
        divide = w.batch * w.heads * w.nq * w.v_head_dim if self.normalize else 0
        return maps + scale + divide
