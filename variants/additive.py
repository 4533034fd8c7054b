"""``additive``: Bahdanau (additive, "concat") attention with learned per-head parameters.

Bahdanau, Cho & Bengio, "Neural Machine Translation by Jointly Learning to Align and Translate"
(ICLR 2015). For head ``h`` the score of query ``i`` and key ``j`` is

    e_hij = w_h^T tanh(W_q,h q_i + W_k,h k_j)          (no 1/sqrt(D) scale)

with ``W_q,h, W_k,h: (hidden, D)`` and ``w_h: (hidden,)``; then a masked softmax over ``j`` and a
weighted sum of ``v``. Shapes: ``q (B, H, Nq, D)``, ``k (B, H, Nk, D)``, ``v (B, H, Nk, Dv)`` ->
``(B, H, Nq, Dv)``; ``D`` and ``H`` are fixed at construction because the parameters depend on them.

The naive form materialises a ``(B, H, Nq, Nk, hidden)`` tensor. Here queries are processed in chunks
so only ``(B, H, chunk, Nk, hidden)`` exists at a time, and each chunk is wrapped in
``torch.utils.checkpoint`` so backward recomputes it instead of keeping every chunk's tanh alive.
Time ``O(B H Nq Nk hidden)``; memory ``O(B H (chunk Nk hidden + (Nq + Nk) hidden + Nq Dv))``, forward
and backward alike: one chunk's tanh tensor, the projected queries and keys, the output. With the
automatic chunk the first term is at most a quarter of one ``(B, H, Nq, Nk)`` score tensor (measured
at B=1, H=8, N=1024, D=64 fp32: peak 0.45x of that tensor forward, 1.35x forward+backward).
Low-precision inputs are computed in float32 and cast back.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .base import AttentionVariant, Unsupported, Workload
from .masks import safe_softmax
from .registry import register

# a chunk's hidden tensor may always hold this many elements (16 MiB in fp32)
MIN_CHUNK_ELEMS = 2**22


def _chunk_attention(
    qp: torch.Tensor,
    kp: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """Additive attention of projected queries ``qp (B,H,c,hid)`` over ``kp (B,H,nk,hid)``.

    ``w`` is ``(H, hid)``, ``v`` is ``(B,H,nk,Dv)``, ``allowed`` broadcasts to ``(B,H,c,nk)``.
    Returns ``(B, H, c, Dv)``.
    """
    # (B,H,c,1,hid) + (B,H,1,nk,hid) -> (B,H,c,nk,hid): the one big tensor; tanh in place halves it
    t = torch.tanh_(qp.unsqueeze(3) + kp.unsqueeze(2))
    # (B,H,c,nk,hid) @ (1,H,1,hid,1) -> (B,H,c,nk,1) -> (B,H,c,nk); a matmul, not (t * w).sum(-1),
    # so no second tensor of the big size is created
    scores = (t @ w[None, :, None, :, None]).squeeze(-1)
    return safe_softmax(scores, allowed) @ v  # (B, H, c, Dv)


@register("additive")
class AdditiveAttention(AttentionVariant):
    """Bahdanau attention ``w^T tanh(W_q q + W_k k)`` per head, chunked over queries."""

    has_params = True
    # several chunks (5 does not divide the test lengths) and one chunk; the automatic size (1 query
    # at test lengths) is tested on its own: per-chunk overhead would dominate the registry tests
    example_knobs = ({"hidden": 16, "chunk": 5}, {"hidden": 8, "chunk": 64})

    def __init__(
        self, heads: int = 8, head_dim: int = 64, hidden: int = 64, chunk: int | None = None
    ) -> None:
        super().__init__()
        if heads < 1 or head_dim < 1 or hidden < 1:
            raise ValueError(f"heads, head_dim and hidden must be >= 1; got {heads}, {head_dim}, {hidden}")
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1 or None (automatic), got {chunk}")
        self.heads = heads
        self.head_dim = head_dim
        self.hidden = hidden
        self.chunk = chunk
        self.w_q = nn.Parameter(torch.empty(heads, hidden, head_dim))  # W_q,h: (hidden, D) per head
        self.w_k = nn.Parameter(torch.empty(heads, hidden, head_dim))  # W_k,h: (hidden, D) per head
        self.w = nn.Parameter(torch.empty(heads, hidden))  # w_h: (hidden,) per head
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform per head (deterministic given torch's global seed).

        Done head by head: xavier on the 3-D tensor would read (H, hidden, D) as a conv weight and
        get the fans wrong.
        """
        with torch.no_grad():
            for h in range(self.heads):
                nn.init.xavier_uniform_(self.w_q[h])
                nn.init.xavier_uniform_(self.w_k[h])
                nn.init.xavier_uniform_(self.w[h : h + 1])  # (1, hidden): fan_in=hidden, fan_out=1

    def knobs(self) -> dict[str, object]:
        return {"heads": self.heads, "head_dim": self.head_dim, "hidden": self.hidden, "chunk": self.chunk}

    def check(self, w: Workload) -> None:
        super().check(w)
        if w.head_dim != self.head_dim:
            raise Unsupported(
                f"additive was built for head_dim={self.head_dim} (its parameters are (hidden, D)); "
                f"q/k head size is {w.head_dim}"
            )
        if w.heads != self.heads:
            raise Unsupported(
                f"additive was built for heads={self.heads} (one parameter set per head); input has "
                f"{w.heads} heads"
            )

    def query_chunk(self, nq: int, row_elems: int = 0) -> int:
        """Queries per chunk: the knob, or so that ``chunk * hidden <= Nq / 4``.

        Then one chunk's ``(B,H,chunk,Nk,hidden)`` tensor has at most a quarter of the elements of a
        ``(B,H,Nq,Nk)`` score tensor. ``row_elems`` (``B*H*Nk*hidden``, one query's share) lets short
        sequences take bigger chunks, up to ``MIN_CHUNK_ELEMS`` elements or half a score tensor: there,
        per-chunk overhead, not memory, is what matters (the quarter rule gives 1 query a chunk at 256).
        """
        if self.chunk is not None:
            return self.chunk
        # the floor never lets a chunk pass half a score tensor, so the memory bound still holds
        floor = min(MIN_CHUNK_ELEMS // row_elems, nq // (2 * self.hidden)) if row_elems else 0
        return max(1, min(nq, max(nq // (4 * self.hidden), floor)))

    def flops(self, w: Workload, mode: str = "fwd") -> int:
        """Useful FLOPs: the additive score costs ``4 * hidden`` per pair, not ``2 * D``.

        Per (query, key) pair: add ``hidden``, tanh ``hidden`` (counted as one op each), the dot with
        ``w`` ``2 * hidden``, then ``2 * Dv`` for ``p @ v``; plus the projections
        ``2 * D * hidden * (Nq + Nk)`` per batch and head. Backward counts 2.5x forward as elsewhere.
        """
        pairs = self.num_pairs(w.nq, w.nk, w.causal)
        per_pair = 4 * self.hidden + 2 * w.v_head_dim
        proj = 2 * w.head_dim * self.hidden * (w.nq + w.nk)
        fwd = w.batch * w.heads * (pairs * per_pair + proj)
        factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
        return int(fwd * factor)

    def _work_dtype(self, x: torch.dtype) -> torch.dtype:
        # fp16/bf16 inputs (or parameters) are computed in float32; float64 stays float64
        return torch.promote_types(torch.promote_types(x, self.w.dtype), torch.float32)

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        work = self._work_dtype(q.dtype)
        b, h, nq, _ = q.shape
        # projections once for all chunks: (B,H,N,D) x (H,hid,D) -> (B,H,N,hid)
        qp = torch.einsum("bhnd,hed->bhne", q.to(work), self.w_q.to(work))
        kp = torch.einsum("bhnd,hed->bhne", k.to(work), self.w_k.to(work))
        wv = self.w.to(work)  # (H, hid)
        vv = v.to(work)  # (B, H, Nk, Dv)
        kpm = None if key_padding_mask is None else key_padding_mask[:, None, None, :]  # (B,1,1,Nk)
        am = attn_mask
        if am is not None:
            while am.dim() < 4:
                am = am.unsqueeze(0)  # (B|1, H|1, Nq|1, Nk)
        grad = torch.is_grad_enabled() and (
            any(t.requires_grad for t in (q, k, v)) or any(p.requires_grad for p in self.parameters())
        )
        step = self.query_chunk(nq, q.shape[0] * q.shape[1] * k.shape[2] * self.hidden)
        outs: list[torch.Tensor] = []
        # without autograd, chunks are written into one preallocated output: keeping each chunk's
        # small result alive between the big per-chunk temporaries fragments glibc's heap, and the
        # process RSS then grew by hundreds of MiB (seen in VmHWM) though torch held ~15 MiB
        out = None if grad else torch.empty(b, h, nq, v.shape[-1], dtype=work, device=q.device)
        for qs in range(0, nq, step):
            qe = min(qs + step, nq)
            # under causal, keys after the chunk's last query are never visible: don't compute them
            ke = qe if causal else k.shape[2]
            allowed = None
            if causal:
                rows = torch.arange(qs, qe, device=q.device)[:, None]  # (c, 1)
                allowed = torch.arange(ke, device=q.device)[None, :] <= rows  # (c, ke)
            if kpm is not None:
                part = kpm[..., :ke]  # (B, 1, 1, ke)
                allowed = part if allowed is None else allowed & part
            if am is not None:
                part = am[..., qs:qe, :ke] if am.shape[-2] > 1 else am[..., :ke]  # (B|1,H|1,c|1,ke)
                allowed = part if allowed is None else allowed & part
            args = (qp[:, :, qs:qe], kp[:, :, :ke], vv[:, :, :ke], wv, allowed)
            if out is None:
                outs.append(checkpoint(_chunk_attention, *args, use_reentrant=False))
            else:
                out[:, :, qs:qe] = _chunk_attention(*args)  # (B, H, c, Dv)
        if out is None:
            out = torch.cat(outs, dim=2)  # (B, H, Nq, Dv)
        return out.to(q.dtype)

    def reference_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The naive float64 form: the full ``(B, H, Nq, Nk, hidden)`` tensor, then the dot with ``w``."""
        qp = torch.einsum("bhnd,hed->bhne", q.double(), self.w_q.double())  # (B, H, Nq, hid)
        kp = torch.einsum("bhnd,hed->bhne", k.double(), self.w_k.double())  # (B, H, Nk, hid)
        # rows in slices only so a long-sequence accuracy check stays within ~128 MiB per slice
        b, h, nq, hid = qp.shape
        step = max(1, 2**24 // max(1, b * h * kp.shape[2] * hid))
        parts = []
        for s in range(0, nq, step):
            t = torch.tanh(qp[:, :, s : s + step, None, :] + kp[:, :, None, :, :])  # (B, H, r, Nk, hid)
            parts.append(torch.einsum("bhqke,he->bhqk", t, self.w.double()))  # (B, H, r, Nk)
        return torch.cat(parts, dim=2)  # (B, H, Nq, Nk)
