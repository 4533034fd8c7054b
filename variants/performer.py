"""``performer``: FAVOR+ (Choromanski et al. 2021, "Rethinking Attention with Performers").

Softmax attention ``exp(s q . k)`` is approximated by positive orthogonal random features: with
``sqrt(s) q`` and ``sqrt(s) k`` as ``x`` and ``W (m, D)`` orthogonal random directions (blocks of
a random orthogonal matrix, each row rescaled to the length of a Gaussian vector),

    phi(x) = exp(W x - |x|^2 / 2) / sqrt(m),    E[phi(q) . phi(k)] = exp(s q . k),

and the output row is ``sum_j phi(q_i) . phi(k_j) v_j / sum_j phi(q_i) . phi(k_j)`` over the keys
query ``i`` may see, through the core of ``variants/linear_core.py`` (one pass non-causal, the
chunked prefix form causal, a ``m x (Dv + 1)`` state per K/V head when decoding). ``W`` is drawn once per
head size from ``seed`` (records are reproducible; one draw shared by all heads, as in the paper's
code) and its deviation from softmax attention falls as ``features`` (m) grows.

Numerically stabilised, so no exponent overflows (bf16, or |q|, |k| of 10): a query's features are
divided by their largest one (a factor per query, which cancels in the ratio); a key's by its own
largest one, ``exp(l_j)``, kept as its log weight ``l_j`` and folded back in relative to the running
maximum of ``l`` over the keys so far, so each weight is at most 1 and no key is weighed against a
future one (causal outputs and the decoding state never see a future key). The stabilisers carry no
gradient: the output does not depend on them. Time ``O(N m (D + Dv))`` non-causal, plus
``O(N chunk (m + Dv))`` causal; memory ``O(N (m + chunk) + (N / chunk) m Dv)``. Shapes as for every
variant; 16-bit inputs are computed in float32.
"""

from __future__ import annotations

import math

import torch

from .base import Unsupported, Workload
from .linear_core import KernelizedAttention, work_dtype
from .reference import performer_reference
from .registry import register


def orthogonal_features(m: int, d: int, seed: int) -> torch.Tensor:
    """FAVOR+'s ``W (m, D)`` float64: stacked ``D x D`` Haar-random orthogonal blocks (QR of Gaussian
    matrices; the last block cut to ``m``), row ``r`` rescaled to the norm of a Gaussian vector in
    ``R^D`` (so each row is marginally Gaussian while the rows of a block stay orthogonal)."""
    g = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(math.ceil(m / d)):
        qr, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        # LAPACK's Householder QR fixes the signs of R's diagonal, which biases Q's entries (its first
        # column's first entry is always <= 0, and the kernel estimate with it: 0.46 for 0.41 at 10^5
        # features); R's diagonal signs moved into Q make Q Haar-distributed (Mezzadri 2007)
        qr = qr * torch.sign(torch.diagonal(r))  # (D, D), columns rescaled by +-1
        blocks.append(qr.T)  # (D, D): orthonormal rows
    norms = torch.randn(m, d, generator=g, dtype=torch.float64).norm(dim=1)  # (m,): chi(D) lengths
    return torch.cat(blocks)[:m] * norms[:, None]  # (m, D)


@register("performer")
class Performer(KernelizedAttention):
    """FAVOR+ positive orthogonal random features, normalised, through the linear-attention core."""

    weighted = True  # the keys' stabilisers are log weights of the core
    normalize = True  # it approximates softmax: always the ratio
    native_gqa = True  # one draw for all heads: keys mapped on their K/V heads, one state a group
    example_knobs = ({"features": 16, "seed": 0, "chunk": 5}, {"features": 32, "seed": 1, "chunk": 64})

    def __init__(self, features: int = 256, seed: int = 0, chunk: int = 64) -> None:
        super().__init__()
        if features < 1 or chunk < 1:
            raise ValueError(f"features and chunk must be >= 1; got {features}, {chunk}")
        self.features = features
        self.seed = seed
        self.chunk = chunk
        self._draws: dict[int, torch.Tensor] = {}  # head size -> W, drawn on first use
        # the draw in each (device, dtype) a call used: cast once, so a forward copies nothing from the
        # host (a CUDA graph cannot capture that copy)
        self._cast: dict[tuple, torch.Tensor] = {}

    def knobs(self) -> dict[str, object]:
        return {"features": self.features, "seed": self.seed, "chunk": self.chunk}

    def projection(self, head_dim: int) -> torch.Tensor:
        """``W (features, head_dim)`` float64 on the CPU, the same for a given seed and head size."""
        if head_dim not in self._draws:
            with torch.inference_mode(False):  # cached: a later call may need it for its backward
                self._draws[head_dim] = orthogonal_features(self.features, head_dim, self.seed)
        return self._draws[head_dim]

    #: its random features' graph at the gradient check: 1.4-1.6x the features and scores
    oracle_graph_copies = 2

    def oracle_bytes(self, w: Workload, rows: int | None = None) -> int:
        """The base count plus the reference's random features: two float64 ``(.., m)`` tensors (the
        projection and its exponential) per checked query row and query head and per key and K/V
        head."""
        features = w.batch * (w.heads * self.oracle_rows(w, rows) + w.hkv * w.nk)
        return super().oracle_bytes(w, rows) + 2 * 8 * self.features * features

    def oracle_forward(
        self, q, k, v, *, causal=False, key_padding_mask=None, attn_mask=None, scale=None, rows=None
    ) -> torch.Tensor:
        """Float64 FAVOR+ with this instance's draw, written densely (``performer_reference``),
        ``(B, H, R, Dv)`` for the query ``rows`` (all ``Nq`` when None)."""
        if attn_mask is not None:
            raise Unsupported("performer never forms the (Nq, Nk) scores an attn_mask would mask")
        return performer_reference(
            q,
            k,
            v,
            projection=self.projection(q.shape[-1]),
            causal=causal,
            key_padding_mask=key_padding_mask,
            scale=scale,
            rows=rows,
        )

    def _features(self, q, k, scale, valid, start, ref0, causal):
        where = (k.shape[-1], k.device, k.dtype)
        if where not in self._cast:
            with torch.inference_mode(False):  # cached: a later call may need it for its backward
                self._cast[where] = self.projection(k.shape[-1]).to(device=k.device, dtype=k.dtype)
        w = self._cast[where]  # (m, D)
        root = math.sqrt(scale)  # s q . k = (sqrt(s) q) . (sqrt(s) k)
        xk = k * root  # (B, H, Nk, D)
        # log of phi(k) * sqrt(m): W x - |x|^2 / 2 (the 1/sqrt(m) cancels in the ratio), the norm
        # term added by the product itself (one pass over the (Nk, m) features fewer)
        half_sq = xk.square().sum(-1, keepdim=True).mul_(-0.5)  # (B, H, Nk, 1)
        a = torch.matmul(xk, w.T).add_(half_sq)  # (B, H, Nk, m)
        if causal or valid is not None:
            log_k = a.detach().amax(-1)  # (B, H, Nk): each key's own largest feature, its log weight
        else:
            # every key is read at once: one largest feature per head is the stabiliser (a key's
            # weight exp(l_j - max l) folded into its features), so the core has no weights to apply
            log_k = None
            top = a.detach().amax((-2, -1), keepdim=True)  # (B, H, 1, 1)
        kf = a.sub_(top if log_k is None else log_k[..., None]).exp_()  # (B, H, Nk, m), each <= 1
        if valid is not None:
            kf = torch.where(valid[..., None], kf, 0.0)  # padded keys: in no sum
            log_k = torch.where(valid, log_k, float("-inf"))
        log_ref = None
        if causal:
            log_ref = log_k.cummax(-1).values  # (B, H, Nk): the largest weight so far
            if ref0 is not None:
                log_ref = torch.maximum(log_ref, ref0[..., None])
        qf = None
        if q is not None:
            # phi(q) up to a factor per query (exp(-|x|^2/2), its largest feature): cancels in the ratio
            pq = (q * root) @ w.T  # (B, H, Nq, m)
            qf = pq.sub_(pq.detach().amax(-1, keepdim=True)).exp_()
        return qf, kf, log_k, log_ref

    def _state_dims(self, w: Workload) -> tuple[int, int, int]:
        elem = torch.empty((), dtype=work_dtype(w.dtype)).element_size()
        return self.features, w.v_head_dim + 1, elem  # the reference: the running maximum, per head

    def _feature_flops(self, w: Workload) -> int:
        """Projections ``2 D m`` per row, the exponentials and maxima ``3 m`` per row, the keys' squared
        norms ``2 D`` per row, the division ``Dv`` per query."""
        m, d = self.features, w.head_dim
        hk = self.state_heads(w)
        rows = w.batch * (w.heads * w.nq + hk * w.nk)
        return rows * (2 * d * m + 3 * m + d) + w.batch * (hk * w.nk * 2 * d + w.heads * w.nq * w.v_head_dim)
