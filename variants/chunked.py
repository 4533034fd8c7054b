"""``chunked``: exact attention in O(N) memory, pure PyTorch (Rabe & Staats, 2021; the backward
follows FlashAttention-2, Dao 2023).

Forward: queries are split into chunks; each chunk walks over the keys chunk by chunk with an online
softmax (running max, running sum, running weighted sum), so no ``Nq x Nk`` matrix ever exists
(soft-capping, ``softcap=c``, is applied to each block's scores, its slope in the backward). It
keeps the output and each row's log-sum-exp ``L``. Backward recomputes the probabilities of one
(query chunk, key chunk) block at a time from ``L`` (``P = exp(S - L)``) and accumulates the
gradients of the query, key and value chunks, so backward memory stays linear too, with nothing kept
per block between the passes.

Packed documents (``documents=`` ids) on the CPU: each block is masked by the ids, and a block that
holds no pair of one document is skipped, forward and backward, as causal skips the blocks past the
diagonal, so memory stays linear (no ``Nq x Nk`` mask); the Triton path takes them as a mask.

Time ``O(B H Nq Nk D)`` (backward about 2.5x forward: it recomputes ``S``); memory
``O(B H (Nq (D + Dv) + q_chunk * k_chunk))``. Low-precision inputs are accumulated in float32, as the
fused kernels do. A float ``bias`` is added block by block (no gradient for it); causal with
``Nq < Nk`` is aligned bottom-right.

On CUDA (``impl=auto`` or ``triton``) the same algorithm runs as three Triton kernels of the suite's
own (:mod:`variants.chunked_triton`: forward, dK/dV per key tile, dQ per query tile), with every mask,
bias, soft cap and grouped K/V heads read in place; ``impl=reference`` keeps the loop above. The
record's ``impl_ran`` says which ran and ``impl_note`` why ``auto`` did not take the kernels (a dtype or
head size they refuse, chunk sizes set by hand, or kernels that did not build for the GPU).

Decoding (fewer queries than keys, no gradient) runs a split-K kernel (flash-decoding, Dao et al.
2023: each K/V head's keys split into ranges, one task per (head, range), every grouped query head
reading each cached row once, the ranges merged by log-sum-exp), where ``decode=auto`` (default)
finds one that takes the call:

- on the CPU, a C kernel (:mod:`variants.decode_kernel`; float32, causal masking only, sink logits
  as one more range of its merge), built on first use with the system's C compiler; where it cannot
  be built, the PyTorch path above runs;
- on the Triton path (CUDA), a Triton kernel (:mod:`variants.decode_triton`; every mask, bias and cap
  the Triton path takes, up to 16-64 query rows per K/V head by dtype and head size).

The record's ``decode_ran`` says which ran (``kernel``, ``torch`` for the general path; None when the
call is not a decode), ``decode_note`` why the kernel did not. ``decode=torch`` never runs a decode
kernel; ``decode=kernel`` refuses what the kernel cannot take instead of falling back. ``query_chunk``
and ``key_chunk`` size the PyTorch path: set by hand, they send ``decode=auto``'s decodes there too
(as ``impl=auto`` on CUDA); with ``decode=kernel`` they size only the calls that are not decodes.
"""

from __future__ import annotations

from typing import Any

import torch

from . import chunked_triton, decode_kernel, decode_triton
from .base import (
    AttentionVariant,
    Unavailable,
    Unsupported,
    Workload,
    first_order_only,
    repeat_kv,
    sinks_as_first_key,
)
from .masks import document_bounds, document_starts
from .registry import register

DECODE = ("auto", "kernel", "torch")
IMPLS = ("auto", "reference", "triton")
CHUNK = 512  # the reference path's default query and key chunk


def _allowed(
    ks: int,
    ke: int,
    rows: torch.Tensor,
    causal: bool,
    kpm: torch.Tensor | None,
    am: torch.Tensor | None,
    docs: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Which pairs of a block of key columns ``[ks, ke)`` the query ``rows (cq, 1)`` may use, or
    None for all: broadcasts to ``(B, H, cq, ck)``. ``rows`` are positions in the keys' sequence
    (query index + ``Nk - Nq``), so causal is bottom-right aligned; ``docs (B, Nk)``, each position's
    packed document, keeps a query to its own."""
    allowed = None
    if causal:
        allowed = torch.arange(ks, ke, device=rows.device)[None, :] <= rows  # (cq, ck)
    if docs is not None:
        same = docs[:, rows[:, 0], None] == docs[:, None, ks:ke]  # (B, cq, ck)
        allowed = same[:, None] if allowed is None else allowed & same[:, None]  # (B, 1, cq, ck)
    if kpm is not None:
        pad = kpm[:, None, None, ks:ke]  # (B, 1, 1, ck)
        allowed = pad if allowed is None else allowed & pad
    if am is not None:
        part = am[..., ks:ke]  # (B|1, H|1, cq|1, ck)
        allowed = part if allowed is None else allowed & part
    return allowed


def _scores(q, kc, ks, rows, causal, kpm, am, bias, cap, docs=None):
    """Masked scores ``(B, H, cq, ck)`` of the (already scaled) query chunk against key chunk ``kc``,
    soft-capped to ``cap tanh(s / cap)`` when ``cap`` is set, plus the chunk's rows of ``bias (B|1,
    H|1, cq|1, Nk)``; and the cap's slope ``1 - tanh^2`` (None without a cap) for the backward."""
    s = q @ kc.transpose(-2, -1)  # (B, H, cq, ck)
    slope = None
    if cap is not None:
        t = torch.tanh(s / cap)
        s, slope = cap * t, 1 - t * t  # d(cap tanh(s / cap)) / ds
    if bias is not None:
        s = s + bias[..., ks : ks + kc.shape[2]]
    allowed = _allowed(ks, ks + kc.shape[2], rows, causal, kpm, am, docs)
    return (s if allowed is None else s.masked_fill(~allowed, float("-inf"))), slope


def _am_rows(am: torch.Tensor | None, qs: int, qe: int) -> torch.Tensor | None:
    """The rows ``[qs, qe)`` of a 4-D boolean mask (a mask broadcast over queries stays whole)."""
    return None if am is None else (am[..., qs:qe, :] if am.shape[-2] > 1 else am)


def _as_4d(t: torch.Tensor | None, nk: int) -> torch.Tensor | None:
    """A mask or bias broadcastable to ``(B, H, Nq, Nk)`` as a 4-D view ``(B|1, H|1, Nq|1, Nk)``: key
    chunks slice the last dim, so a broadcast one is expanded."""
    if t is None:
        return None
    t = t[(None,) * (4 - t.dim())]  # leading dims added
    return t.expand(*t.shape[:-1], nk)


def _key_chunks(
    nk: int, k_chunk: int, q_start: int, q_end: int, causal: bool, spans: list[tuple[int, int]] | None
) -> list[int]:
    """Start of every key chunk a query chunk at positions ``[q_start, q_end)`` sees: causal, none past
    it; with packed documents (``spans``: per position, the first and last position of its
    document, over every row of the batch), none that holds no key of the chunk's documents."""
    starts = range(0, min(nk, q_end) if causal else nk, k_chunk)
    if spans is None:
        return list(starts)
    lo, hi = spans[q_start][0], spans[q_end - 1][1]  # the chunk's documents lie within [lo, hi]
    return [ks for ks in starts if ks <= hi and min(ks + k_chunk, nk) > lo]


def document_spans(starts: torch.Tensor) -> list[tuple[int, int]]:
    """Per position of ``starts (B, Nk)`` (:func:`~variants.masks.document_starts`: True where a
    document begins), the first and last position of its document in any row: ``spans[p][0]`` the
    earliest start, and ``spans[p][1]`` the latest end, of the documents at ``p`` across the batch.
    Read on the host, once per call. ``O(B Nk)``."""
    first, last = document_bounds(starts)  # (B, Nk) x 2
    return list(zip(first.amin(0).tolist(), last.amax(0).tolist(), strict=True))


class _ChunkedAttention(torch.autograd.Function):
    """``softmax(q k^T / sqrt(D) masked) v`` by chunks, with a block-recomputing backward."""

    @staticmethod
    def forward(
        ctx: Any,
        q,
        k,
        v,
        kpm,
        am,
        bias,
        causal: bool,
        q_chunk: int,
        k_chunk: int,
        scale: float,
        cap,
        docs,
        spans: list[tuple[int, int]] | None,
    ):
        b, h, nq, d = q.shape
        nk, dv = k.shape[2], v.shape[-1]
        off = nk - nq  # query i is position i + off (bottom-right causal)
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        qw, kw, vw = q.to(work) * scale, k.to(work), v.to(work)
        bw = None if bias is None else bias.to(work)
        out = torch.empty(b, h, nq, dv, dtype=work, device=q.device)
        lse = torch.empty(b, h, nq, 1, dtype=work, device=q.device)  # log-sum-exp of each row
        for qs in range(0, nq, q_chunk):
            qe = min(qs + q_chunk, nq)
            qc, am_c, b_c = qw[:, :, qs:qe], _am_rows(am, qs, qe), _am_rows(bw, qs, qe)  # (B, H, cq, D)
            rows = torch.arange(qs + off, qe + off, device=q.device)[:, None]  # (cq, 1) positions
            m = torch.full((b, h, qe - qs, 1), float("-inf"), dtype=work, device=q.device)  # running max
            s = torch.zeros((b, h, qe - qs, 1), dtype=work, device=q.device)  # running sum of exp
            acc = torch.zeros((b, h, qe - qs, dv), dtype=work, device=q.device)  # running sum of p v
            for ks in _key_chunks(nk, k_chunk, qs + off, qe + off, causal, spans):
                ke = min(ks + k_chunk, nk)
                sc, _ = _scores(
                    qc, kw[:, :, ks:ke], ks, rows, causal, kpm, am_c, b_c, cap, docs
                )  # (B, H, cq, ck)
                m_new = torch.maximum(m, sc.amax(dim=-1, keepdim=True))
                m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
                p = torch.exp(sc - m_safe)  # (B, H, cq, ck); masked entries are exactly 0
                corr = torch.exp(m - m_safe)  # rescales what was summed under the old max
                s = s * corr + p.sum(dim=-1, keepdim=True)
                acc = acc * corr + p @ vw[:, :, ks:ke]
                m = m_new
            out[:, :, qs:qe] = acc / torch.where(s > 0, s, torch.ones_like(s))  # empty rows: 0 / 1 = 0
            # empty rows get L = +inf, so that exp(S - L) = 0 for them in backward
            lse[:, :, qs:qe] = torch.where(s > 0, m + torch.log(s), torch.full_like(s, float("inf")))
        ctx.save_for_backward(q, k, v, out, lse, kpm, am, bw, docs)
        ctx.cfg = (causal, q_chunk, k_chunk, scale, cap, spans)
        return out.to(q.dtype)

    @staticmethod
    @first_order_only  # its gradients carry no graph: a second derivative is refused, never wrong
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, out, lse, kpm, am, bw, docs = ctx.saved_tensors
        causal, q_chunk, k_chunk, scale, cap, spans = ctx.cfg
        nq, nk = q.shape[2], k.shape[2]
        off = nk - nq
        work = out.dtype
        qw, kw, vw, do = q.to(work) * scale, k.to(work), v.to(work), grad_out.to(work)
        delta = (do * out).sum(dim=-1, keepdim=True)  # (B, H, Nq, 1): rowsum(dO * O) = rowsum(P * dP)
        dq, dk, dv = torch.zeros_like(qw), torch.zeros_like(kw), torch.zeros_like(vw)
        for qs in range(0, nq, q_chunk):
            qe = min(qs + q_chunk, nq)
            qc, am_c, b_c = qw[:, :, qs:qe], _am_rows(am, qs, qe), _am_rows(bw, qs, qe)  # (B, H, cq, D)
            rows = torch.arange(qs + off, qe + off, device=q.device)[:, None]  # (cq, 1) positions
            do_c, l_c, d_c = do[:, :, qs:qe], lse[:, :, qs:qe], delta[:, :, qs:qe]
            for ks in _key_chunks(nk, k_chunk, qs + off, qe + off, causal, spans):
                ke = min(ks + k_chunk, nk)
                kc, vc = kw[:, :, ks:ke], vw[:, :, ks:ke]  # (B, H, ck, D), (B, H, ck, Dv)
                sc, slope = _scores(qc, kc, ks, rows, causal, kpm, am_c, b_c, cap, docs)  # (B, H, cq, ck)
                p = torch.exp(sc - l_c)
                dv[:, :, ks:ke] += p.transpose(-2, -1) @ do_c  # (B, H, ck, Dv)
                ds = p * (do_c @ vc.transpose(-2, -1) - d_c)  # (B, H, cq, ck): dS = P (dP - delta)
                if slope is not None:  # through the cap, back to q k^T
                    ds = ds * slope
                dq[:, :, qs:qe] += ds @ kc
                dk[:, :, ks:ke] += ds.transpose(-2, -1) @ qc
        dq = dq * scale  # S = (q scale) k^T: dq = dS k scale; dk = dS^T (q scale) already
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 10)


@register("chunked")
class ChunkedAttention(AttentionVariant):
    """Memory-efficient exact attention: online softmax over key chunks, per query chunk."""

    example_knobs = ({"query_chunk": 5, "key_chunk": 7},)
    supports_bias = True
    supports_sinks = True  # the Triton path's own (native_sinks); else one more key in front (base.forward)
    supports_softcap = True  # block by block, forward and backward
    native_scale = True
    native_gqa = True  # the decode kernel reads grouped K/V heads as they are; the PyTorch path repeats them

    def __init__(
        self, query_chunk: int = CHUNK, key_chunk: int = CHUNK, decode: str = "auto", impl: str = "auto"
    ) -> None:
        super().__init__()
        if query_chunk < 1 or key_chunk < 1:
            raise ValueError(
                f"chunk sizes must be >= 1, got query_chunk={query_chunk}, key_chunk={key_chunk}"
            )
        if decode not in DECODE:
            raise ValueError(f"chunked decode must be one of {', '.join(DECODE)}; got '{decode}'")
        if impl not in IMPLS:
            raise ValueError(f"chunked impl must be one of {', '.join(IMPLS)}; got '{impl}'")
        if impl == "triton" and (query_chunk, key_chunk) != (CHUNK, CHUNK):
            raise ValueError(
                "chunked impl=triton tiles by its own tile sizes: query_chunk and key_chunk size the "
                "reference path (impl=reference)"
            )
        if impl == "triton":  # what the Triton path takes (the tests read these facts)
            self.devices = frozenset({"cuda", "cpu"} if chunked_triton.interpreting() else {"cuda"})
            self.dtypes = frozenset(chunked_triton.DTYPES)
        self.query_chunk = query_chunk
        self.key_chunk = key_chunk
        # chunks set by hand size the PyTorch path: auto then runs it, for calls and for decodes
        self._chunks_set = (query_chunk, key_chunk) != (CHUNK, CHUNK)
        self.decode = decode
        self.impl = impl
        self.decode_ran: str | None = None
        self.decode_note: str | None = None
        self.impl_ran: str | None = None
        self.impl_note: str | None = None  # why auto did not take the Triton path on CUDA

    def knobs(self) -> dict[str, object]:
        return {
            "query_chunk": self.query_chunk,
            "key_chunk": self.key_chunk,
            "decode": self.decode,
            "impl": self.impl,
        }

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["decode_ran"] = self.decode_ran
        d["decode_note"] = self.decode_note
        d["impl_ran"] = self.impl_ran
        d["impl_note"] = self.impl_note
        return d

    def _path(self, w: Workload) -> str:
        """The path that runs ``w`` (``auto`` resolved: Triton on CUDA where it takes the call, else the
        reference, with ``impl_note`` saying why)."""
        if self.impl != "auto" or w.device != "cuda":
            return "reference" if self.impl == "auto" else self.impl
        if self._chunks_set:
            self.impl_note = "query_chunk/key_chunk were set: they size the reference path, which ran"
        else:
            self.impl_note = chunked_triton.refusal(w)
        return "reference" if self.impl_note else "triton"

    def native_sinks(self, w: Workload) -> bool:
        """The kernels take the sink logits as they are: the Triton path (each row's sums start from
        its sink; D=64 stays 64, where one more feature would pad it to 128) and the CPU decode kernel
        (the sink is one more range of its merge), so neither copies q, k and v (a decode step would
        copy the whole cache); the PyTorch path adds them as one more key."""
        if self._path(w) == "triton":
            return True
        return self.decode != "torch" and w.nq < w.nk and self._decode_kernel_refusal(w) is None

    def _decode_kernel_refusal(self, w: Workload) -> str | None:
        """Why a decode call ``w`` off the Triton path does not run the CPU decode kernel, or None:
        ``decode=auto`` leaves it to the PyTorch path when the chunks were set by hand (they size that
        path; the kernel splits the keys by its own ranges)."""
        if self.decode == "auto" and self._chunks_set:
            return "query_chunk/key_chunk were set: they size the PyTorch path, which ran"
        return decode_kernel.unusable(w)

    def native_documents(self, w: Workload) -> bool:
        """On the CPU the PyTorch path reads the documents itself: each block masked by the ids, the
        blocks between documents skipped (the spans read on the host once a call), no ``(Nq, Nk)``
        mask; the Triton path (CUDA) takes them as the mask ``forward`` makes."""
        return w.device == "cpu" and self._path(w) == "reference"

    def check(self, w: Workload) -> None:
        if self.impl == "triton" and (why := chunked_triton.refusal(w)):  # first: it says why
            raise (Unavailable if chunked_triton.IMPORT_ERROR else Unsupported)(f"chunked impl=triton: {why}")
        super().check(w)
        if self.decode != "kernel":
            return
        if self._path(w) == "triton":  # the decode kernel of the Triton path
            why = decode_triton.decode_refusal(w)
            if why is not None:
                raise Unsupported(f"chunked decode=kernel: {why}")
            return
        why = decode_kernel.refusal(w)  # sinks: the kernel takes them, as one more range of its merge
        if why is not None:
            raise Unsupported(f"chunked decode=kernel: {why}")
        if decode_kernel.kernel() is None:
            raise Unavailable(f"chunked decode=kernel: {decode_kernel.build_error()}")

    def _attend(
        self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None, bias=None, softcap=None,
        sinks=None, documents=None,
    ):  # fmt: skip
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        self.decode_ran = self.decode_note = self.impl_ran = self.impl_note = None
        am, bias4 = (_as_4d(t, k.shape[2]) for t in (attn_mask, bias))  # (B|1, H|1, Nq|1, Nk) each
        w = Workload.of(
            q, k, v, key_padding_mask=key_padding_mask, attn_mask=attn_mask, bias=bias, softcap=softcap,
            sinks=sinks, documents=documents,
        )  # fmt: skip  # sinks: a trained sink logit needs the path with a backward; documents: no kernel
        decoding = self.decode != "torch" and q.shape[2] < k.shape[2]
        self.impl_ran = self._path(w)
        if self.impl_ran == "triton":
            try:
                why = decode_triton.decode_refusal(w) if decoding else None
                if decoding:
                    self.decode_ran, self.decode_note = ("torch", why) if why else ("kernel", None)
                if decoding and why is None:
                    return decode_triton.decode(
                        q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=am, bias=bias4,
                        scale=scale, softcap=softcap, sinks=sinks,
                    )  # fmt: skip  # (B, H, Nq, Dv)
                return chunked_triton.attend(
                    q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=am, bias=bias4,
                    scale=scale, softcap=softcap, sinks=sinks,
                )  # fmt: skip  # (B, H, Nq, Dv)
            except chunked_triton.BUILD_ERRORS as exc:
                first = (str(exc).splitlines() or [repr(exc)])[0]
                why = f"the Triton kernels did not build for this GPU: {first}"
                if self.impl == "triton":
                    raise Unavailable(f"chunked impl=triton: {why}") from None
                if decoding and self.decode == "kernel":  # the decode kernel it asked for
                    raise Unavailable(f"chunked decode=kernel: {why}") from None
                self.impl_ran, self.impl_note = "reference", why
                self.decode_ran = self.decode_note = None
        if decoding:
            why = self._decode_kernel_refusal(w)
            if why is None:  # sinks as they are: one more range of its merge
                self.decode_ran, self.impl_ran = "kernel", None
                return decode_kernel.decode(
                    q, k, v, causal=causal, scale=scale, sinks=sinks
                )  # (B, H, Nq, Dv)
            self.decode_ran, self.decode_note = "torch", why
        if sinks is not None:  # the kernels took them as they are; the PyTorch path as one more key
            q, k, v, call = sinks_as_first_key(
                q, k, v, sinks, scale=scale, key_padding_mask=key_padding_mask, attn_mask=am, bias=bias4
            )  # (B, H|Hkv, N(+1), D+1), v: Dv
            key_padding_mask, am, bias4 = call["key_padding_mask"], call["attn_mask"], call["bias"]
        h = q.shape[1]
        k, v = repeat_kv(k, h), repeat_kv(v, h)  # (B, H, Nk, D|Dv): the PyTorch path's heads
        docs = spans = None
        if documents is not None:
            starts = document_starts(documents)  # (B, Nk): True where a document begins
            docs, spans = starts.cumsum(-1), document_spans(starts)  # (B, Nk): run index; per position
        chunks = (self.query_chunk, self.key_chunk)
        return _ChunkedAttention.apply(
            q, k, v, key_padding_mask, am, bias4, causal, *chunks, scale, softcap, docs, spans
        )  # (B, H, Nq, Dv)
