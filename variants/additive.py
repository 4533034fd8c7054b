"""``additive``: Bahdanau (additive, "concat") attention with learned per-head parameters.

Bahdanau, Cho & Bengio, "Neural Machine Translation by Jointly Learning to Align and Translate"
(ICLR 2015). For head ``h`` the score of query ``i`` and key ``j`` is

    e_hij = w_h^T tanh(W_q,h q_i + W_k,h k_j)          (no 1/sqrt(D) scale)

with ``W_q,h, W_k,h: (hidden, D)`` and ``w_h: (hidden,)``; then a masked softmax over ``j`` and a
weighted sum of ``v``. Shapes: ``q (B, H, Nq, D)``, ``k (B, H, Nk, D)``, ``v (B, H, Nk, Dv)`` ->
``(B, H, Nq, Dv)``; ``D`` and ``H`` are fixed at construction because the parameters depend on them.

The naive form materialises a ``(B, H, Nq, Nk, hidden)`` tensor. Here queries are processed in chunks
so only ``(B, H, chunk, Nk, hidden)`` exists at a time, and a hand-written autograd function keeps
only the projected queries and keys, ``v`` and the output for backward, which recomputes each chunk
once and applies the chain rule by hand. ``tanh(x)`` is evaluated as ``2 sigmoid(2x) - 1``
(see ``_Sigmoids``): the same function, rounded differently (a few units of rounding), 3-4x cheaper
on the CPU. Time ``O(B H Nq Nk hidden)``; memory ``O(B H (chunk Nk hidden + (Nq + Nk) hidden + Nq Dv))``,
forward and backward alike: one chunk's hidden tensor, the projected queries and keys (and their
exponentials), the output and the gradients of the same sizes. With the automatic chunk the first term
is at most a quarter of one ``(B, H, Nq, Nk)`` score tensor (measured at B=1, H=8, N=1024, D=64,
hidden=64 fp32, chunk 8: peak 0.84x of that tensor forward, 1.33x forward+backward). Low-precision
inputs are computed in float32 and cast back. Not twice differentiable.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from .base import AttentionVariant, Unsupported, Workload, first_order_only
from .masks import safe_softmax
from .registry import register

# a chunk's hidden tensor may always hold this many elements (16 MiB in fp32)
MIN_CHUNK_ELEMS = 2**22


class _Masks(NamedTuple):
    """What limits the keys a query sees; ``allowed`` builds one chunk's boolean mask from it."""

    causal: bool
    kpm: torch.Tensor | None  # (B, 1, 1, Nk)
    am: torch.Tensor | None  # (B|1, H|1, Nq|1, Nk)
    offset: int = 0  # query i is position i + offset (Nk - Nq: bottom-right causal)

    def keys_end(self, qe: int, nk: int) -> int:
        """Keys the queries before ``qe`` can see at all: causal ones see none past their position."""
        return min(nk, qe + self.offset) if self.causal else nk

    def allowed(self, qs: int, qe: int, ke: int, device: torch.device) -> torch.Tensor | None:
        """Mask of queries ``qs:qe`` over keys ``:ke``, broadcastable to ``(B, H, qe - qs, ke)``."""
        allowed = None
        if self.causal:
            rows = torch.arange(qs + self.offset, qe + self.offset, device=device)[:, None]  # (c, 1)
            allowed = torch.arange(ke, device=device)[None, :] <= rows  # (c, ke)
        if self.kpm is not None:
            part = self.kpm[..., :ke]  # (B, 1, 1, ke)
            allowed = part if allowed is None else allowed & part
        if self.am is not None:
            am = self.am
            part = am[..., qs:qe, :ke] if am.shape[-2] > 1 else am[..., :ke]  # (B|1, H|1, c|1, ke)
            allowed = part if allowed is None else allowed & part
        return allowed


class _Sigmoids:
    """``s = sigmoid(2 (qp_i + kp_j))`` for a block of queries and keys: ``tanh(x) = 2 sigmoid(2x) - 1``.

    Why not ``tanh``: torch's CPU ``tanh`` costs about 2 ns per element on 2 threads here, 3.5x its
    ``sigmoid``; it was 60-70% of the old forward. With ``a = exp(-2 qp)`` and ``b = exp(-2 kp)``
    computed once (``O(N hidden)``), ``sigmoid(2 (qp_i + kp_j)) = 1 / (1 + a_i b_j)``: one fused
    multiply-add and a reciprocal per element, half the time of an add then a sigmoid. It is exact in
    exact arithmetic and well conditioned in floating point (relative error a few units of rounding,
    no cancellation), but ``a_i b_j`` can overflow or underflow: it is used only when every ``|2 qp|``
    and ``|2 kp|`` is at most ``0.45 ln(max)`` of the dtype (40 in fp32, 319 in fp64), so each factor
    and each product stays finite and normal; otherwise the add then ``sigmoid`` path runs. Off the
    CPU that path always runs: checking the bound reads a device value on the host, which stalls the
    stream and cannot be captured in a CUDA graph.
    """

    def __init__(self, qp: torch.Tensor, kp: torch.Tensor, step: int) -> None:
        limit = 0.45 * math.log(torch.finfo(qp.dtype).max)  # 40 in fp32: e^80 < 3.4e38, e^-80 > 1.2e-38
        on_cpu = qp.device.type == "cpu"
        self.fast = on_cpu and bool(qp.abs().amax() <= limit / 2) and bool(kp.abs().amax() <= limit / 2)
        if self.fast:
            self.a = torch.exp(-2 * qp)  # (B, H, Nq, hid)
            self.b = torch.exp(-2 * kp)  # (B, H, Nk, hid)
            self.one = torch.ones((), dtype=qp.dtype, device=qp.device)
        else:
            self.a = 2 * qp  # (B, H, Nq, hid)
            self.b = 2 * kp  # (B, H, Nk, hid)
        b, h, _, hid = qp.shape
        # one buffer for every chunk: a fresh allocation of this size is a fresh mmap from glibc, and
        # faulting its pages in made the pass that writes it up to 5x slower (3.0 vs 0.6 ms at N=1024)
        self.buf = torch.empty(
            b * h * min(step, qp.shape[2]) * kp.shape[2] * hid, dtype=qp.dtype, device=qp.device
        )

    def block(self, qs: int, qe: int, ke: int) -> torch.Tensor:
        """``(B, H, qe - qs, ke, hid)``, contiguous, in a buffer the next call overwrites."""
        a = self.a[:, :, qs:qe, None, :]  # (B, H, c, 1, hid)
        b = self.b[:, :, None, :ke, :]  # (B, H, 1, ke, hid)
        shape = (*a.shape[:3], ke, a.shape[-1])
        # out= into a contiguous view: callers view the result, and a broadcast result could otherwise
        # take a permuted layout from the strided inputs
        s = self.buf[: math.prod(shape)].view(shape)  # (B, H, c, ke, hid)
        if self.fast:
            return torch.addcmul(self.one, a, b, out=s).reciprocal_()  # 1 / (1 + a_i b_j), in place
        return torch.add(a, b, out=s).sigmoid_()


def _scores(s: torch.Tensor, w2: torch.Tensor, wsum: torch.Tensor) -> torch.Tensor:
    """``sum_e w_e tanh(x_e) = 2 (s . w) - sum(w)`` for ``s (B,H,c,nk,hid)``: ``(B,H,c,nk)``.

    ``w2`` is ``2 w`` as ``(B H, 1, hid)``, ``wsum`` is ``sum(w)`` as ``(1, H, 1, 1)`` (see ``_weights``).

    As ``w (1, hid) @ s^T (hid, c nk)`` per batch and head: ``s @ w[..., None]`` took 0.75 ns per
    element of ``s`` here (2 threads), this 0.10-0.19; einsum picks this form for B=1 but copies ``s``
    first for B > 1 (1.1 ns).
    """
    b, h, c, nk, hid = s.shape
    e = torch.bmm(w2, s.view(b * h, c * nk, hid).transpose(1, 2))  # (B H, 1, c nk)
    return e.view(b, h, c, nk) - wsum  # (B, H, c, nk)


def _weights(w: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w (H, hid)`` in the two forms ``_scores`` takes: ``2 w`` per (batch, head), ``sum(w)``."""
    h, hid = w.shape
    w2 = (2 * w)[None].expand(batch, h, hid).reshape(batch * h, 1, hid)  # (B H, 1, hid)
    return w2, w.sum(-1)[None, :, None, None]  # (1, H, 1, 1)


class _AdditiveFunction(torch.autograd.Function):
    """Chunked additive attention of projected ``qp (B,H,Nq,hid)``, ``kp (B,H,Nk,hid)`` -> ``(B,H,Nq,Dv)``.

    Keeps for backward only its inputs and output (``O(N (hidden + Dv))``): backward recomputes each
    chunk's sigmoid tensor once and applies the chain rule by hand, where ``torch.utils.checkpoint``
    re-ran the whole chunk forward and then autograd's backward of each op, several passes more over
    the ``(B, H, chunk, Nk, hidden)`` tensor. With ``x = qp_i + kp_j``, ``s = sigmoid(2x)``,
    ``t = tanh(x) = 2s - 1``, ``e_ij = w . t``: ``de/dx = 4 w s (1 - s)`` (``1 - t^2 = 4 s (1 - s)``)
    and ``de/dw = 2s - 1``; the softmax backward is ``p (dp - rowsum(p dp))`` with
    ``rowsum(p dp) = dout . out``, as in FlashAttention.
    """

    @staticmethod
    def forward(ctx, qp, kp, v, w, masks: _Masks, step: int):  # noqa: ANN001, ANN205
        b, h, nq, _ = qp.shape
        sig = _Sigmoids(qp, kp, step)
        ws = _weights(w, b)
        # one preallocated output: keeping each chunk's small result alive between the big per-chunk
        # temporaries fragmented glibc's heap, and the process RSS grew by hundreds of MiB (VmHWM)
        out = torch.empty(b, h, nq, v.shape[-1], dtype=qp.dtype, device=qp.device)
        for qs in range(0, nq, step):
            qe = min(qs + step, nq)
            ke = masks.keys_end(qe, kp.shape[2])  # causal: keys after the chunk are never visible
            scores = _scores(sig.block(qs, qe, ke), *ws)  # (B, H, c, ke)
            p = safe_softmax(scores, masks.allowed(qs, qe, ke, qp.device))
            out[:, :, qs:qe] = p @ v[:, :, :ke]  # (B, H, c, Dv)
        ctx.save_for_backward(qp, kp, v, w, out)
        ctx.masks, ctx.step = masks, step
        return out

    @staticmethod
    @first_order_only  # its gradients carry no graph: a second derivative is refused, never wrong
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        qp, kp, v, w, out = ctx.saved_tensors
        masks, step = ctx.masks, ctx.step
        nq = qp.shape[2]
        sig = _Sigmoids(qp, kp, step)
        ws = _weights(w, qp.shape[0])
        delta = (dout * out).sum(-1, keepdim=True)  # (B, H, Nq, 1): rowsum(p * dp)
        gq = torch.empty_like(qp)  # sum_j ds_ij s (1 - s), (B, H, Nq, hid)
        gk = torch.zeros_like(kp)  # sum_i ds_ij s (1 - s), (B, H, Nk, hid)
        dv = torch.zeros_like(v)
        gw = torch.zeros(w.shape[0], 1, w.shape[1], dtype=w.dtype, device=w.device)  # (H, 1, hid)
        ds_total = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)  # (H,): sum of ds
        for qs in range(0, nq, step):
            qe = min(qs + step, nq)
            ke = masks.keys_end(qe, kp.shape[2])
            s = sig.block(qs, qe, ke)  # (B, H, c, ke, hid)
            p = safe_softmax(_scores(s, *ws), masks.allowed(qs, qe, ke, qp.device))  # (B, H, c, ke)
            do = dout[:, :, qs:qe]  # (B, H, c, Dv)
            dv[:, :, :ke] += p.transpose(-1, -2) @ do  # (B, H, ke, Dv)
            ds = p * (do @ v[:, :, :ke].transpose(-1, -2) - delta[:, :, qs:qe])  # (B, H, c, ke)
            bb, hh, c = s.shape[:3]
            # sum over i, j of ds_ij s_ije: a (1, c ke) @ (c ke, hid) product per batch and head
            sw = ds.reshape(bb * hh, 1, c * ke) @ s.view(bb * hh, c * ke, -1)  # (B H, 1, hid)
            gw += sw.view(bb, hh, 1, -1).sum(0)  # (H, 1, hid)
            ds_total += ds.sum((0, 2, 3))
            # ds * s (1 - s) in place over s: one pass, no second tensor of the big size
            torch.ops.aten.sigmoid_backward.grad_input(ds[..., None].expand_as(s), s, grad_input=s)
            gq[:, :, qs:qe] = s.sum(3)  # (B, H, c, hid)
            gk[:, :, :ke] += s.sum(2)  # (B, H, ke, hid)
        w4 = 4 * w[None, :, None, :]  # (1, H, 1, hid)
        dw = 2 * gw.squeeze(1) - ds_total[:, None]  # (H, hid): de/dw = 2s - 1
        return gq * w4, gk * w4, dv, dw, None, None


@register("additive")
class AdditiveAttention(AttentionVariant):
    """Bahdanau attention ``w^T tanh(W_q q + W_k k)`` per head, chunked over queries."""

    exact = False  # another operator than softmax(q k^T) v: the record also holds its deviation from it
    #: its hidden layer's graph at the gradient check: up to 3x the layer (N=128; 1.1x from N=512)
    oracle_graph_copies = 3
    has_params = True
    size_knob = "hidden"
    supports_scale = False  # the score w^T tanh(...) has no 1/sqrt(D) to replace
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

    def oracle_bytes_per_pair(self) -> int:
        """Its reference scores hold ``tanh(W_q q + W_k k)``, ``hidden`` float64 values per pair."""
        return 8 * self.hidden

    def flops(self, w: Workload, mode: str = "fwd") -> int:
        """Useful FLOPs: the additive score costs ``4 * hidden`` per pair, not ``2 * D``.

        Per (query, key) pair: add ``hidden``, tanh ``hidden`` (counted as one op each), the dot with
        ``w`` ``2 * hidden``, then ``2 * Dv`` for ``p @ v``; plus the projections
        ``2 * D * hidden * (Nq + Nk)`` per batch and head. Backward counts 2.5x forward as elsewhere.
        """
        pairs = self.useful_pairs(w)
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
        step = self.query_chunk(nq, q.shape[0] * q.shape[1] * k.shape[2] * self.hidden)
        masks = _Masks(causal, kpm, am, k.shape[2] - nq)
        out = _AdditiveFunction.apply(qp, kp, vv, wv, masks, step)  # (B, H, Nq, Dv)
        return out.to(q.dtype)

    def reference_scores(self, q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """The naive float64 form: the full ``(B, H, Nq, Nk, hidden)`` tensor, then the dot with ``w``.
        ``scale`` is not used: the call takes only the default (``check``), which the scorer has no use
        for; the hook takes it as the base class's does, so the oracle can pass it."""
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
