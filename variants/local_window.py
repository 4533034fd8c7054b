"""``local_window``: sliding-window (banded) attention, computed block by block (Longformer's local
attention; Beltagy et al., 2020, "Longformer: The Long-Document Transformer"), optionally with
StreamingLLM's attention sinks (Xiao et al., 2023, "Efficient Streaming Language Models with
Attention Sinks").

The query at position ``p = i + Nk - Nq`` (bottom-right: the queries are the last ``Nq`` positions)
sees key ``j`` iff ``|p - j| <= window`` or ``j < sink_tokens``, and in both cases ``j <= p`` when
causal; key padding applies on top. A key that is both in the band and among the sinks is one term of
the softmax, never two. ``sink_tokens`` (default 0: the plain band, every code path as without it)
keeps the first tokens of the sequence visible to every query, as StreamingLLM does (typically 4). It
is a constructor knob and has nothing to do with the ``sinks=`` argument of ``forward`` (a learned
logit per head that joins the softmax's denominator for a zero value, gpt-oss style), which this
variant refuses. A window of ``N - 1`` or more is full attention.

Queries are cut into blocks of ``block`` rows; a block starting at ``s`` can only see keys in ``[s -
window, s + block - 1 + window]``, so each block is scored against that span of ``block + 2 *
window`` keys (``block + window`` when causal: later keys are never visible).
K and V are padded by ``window`` on both sides and to a multiple of ``block``, and the spans are
strided views of them (``unfold``; the batched matmul copies each span once, ``(block + 2 window) /
block`` times the size of K), so every block is scored in one batched matmul and no ``N x N``
matrix exists, forward or backward. With sinks, the first ``sink_tokens`` keys and values are put in
front of every block's span (``sink_tokens`` more slots per block); a sink slot is masked for a query
whose band already holds that key (so it is counted once), for a query before it when causal, and
where the key is padding.

Four implementations of the same pattern, chosen by the ``impl`` knob (``impl_ran`` in the record):

- ``kernel``: the suite's C kernel (:mod:`variants.sparse_kernel`, built on first use with the system
  compiler) on blocks of ``block`` queries (:data:`KERNEL_BLOCK` when not given), each against the
  key blocks its band (and the sinks) touch, the band masked at token level, K/V and grouped heads
  read in place, forward and backward (recomputed from the saved log-sum-exp); float32 on the CPU.
- ``sdpa``: the spans are copied out (``(block + 2 window) / block`` times the size of K and V) and
  every block is one "head" of PyTorch's fused ``scaled_dot_product_attention`` with an additive band
  mask of shape ``(1, nb, block, sink_tokens + span)`` shared by all batch elements and heads (4-D,
  so the CPU picks its fused flash kernel; a 3-D mask sends it to the unfused math path, 2.6x slower
  here). Scores, softmax and the weighted sum stay inside the kernel, forward and backward.
- ``blocked``: the same spans scored with batched matmuls and an in-place softmax in plain PyTorch
  (the reference implementation: every step visible).
- ``flex``: FlexAttention's compiled kernel with the band OR the sinks as its block mask
  (:mod:`variants.flex_kernel`, the predicate from :mod:`variants.patterns`); no backward on the CPU;
  compiles once per shape.
- ``auto`` (default): on the CPU ``kernel`` where it takes the call (else ``sdpa``, and
  ``impl_note`` says why: another dtype, no compiler, or a single decoded query, for which
  one fused SDPA call on the keys in reach is faster); on CUDA ``flex`` (a Triton kernel that skips
  tiles outside the band).

Decoding (``Nq < Nk``, the queries the last ``Nq`` positions of the keys' sequence) reads only the
keys in reach: from ``lo = Nk - Nq - window`` on, plus the first ``sink_tokens`` (the two slices
concatenated: the rest of the cache is never touched, so a step costs ``O(window + sink_tokens)``, and
:meth:`LocalWindowAttention.cache_len` is ``min(Nk, window + sink_tokens)``). The concatenated cache
is itself a valid input: renumbered, its sinks stay the first keys and every band keeps its keys, so
a cache that holds only the sinks and the last ``window`` keys (StreamingLLM's rolling cache) gives
the same output as the whole one. A call's ``window=`` narrower than the knob narrows the band; the
sinks stay.

Packed documents (``documents=`` ids ``(B, Nk)``, each document one run) stop each query's band at
its document's edges, in every implementation: the C kernel reads, per position, the first and last
position of its document (a range test per key and query, as the band's), the ``sdpa`` and
``blocked`` spans are masked by the ids like key padding, ``flex`` puts them in its predicate. The
band's cost does not change (pairs across an edge are masked, not skipped). Refused beside
``sink_tokens``: each document would need its own first tokens as sinks.

Shapes: ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` -> ``(B, H, Nq, Dv)``;
self-attention only (``Nq <= Nk``), with causal, key padding and document masks, no arbitrary
``attn_mask``.
Time ``O(B H N (block + 2 window + sink_tokens) D)``; memory ``O(N (block + 2 window +
sink_tokens))`` for the shared mask (``O(B H N (block + 2 window + sink_tokens))`` with key padding,
or for the ``blocked`` scores): linear in ``N`` at a fixed window. ``blocked`` accumulates
low-precision inputs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import sparse_kernel
from .base import AttentionVariant, Unavailable, Unsupported, Workload, repeat_kv
from .flex_kernel import CUDA_TILE, FlexKernel, flex_refusal
from .masks import blocks_per_chunk, document_mask, sdpa_blocked, softmax_blocked_, zero_empty_rows
from .patterns import MaskMod, band_mask_mod, band_pairs, band_pattern
from .registry import register

IMPLS = ("auto", "kernel", "sdpa", "blocked", "flex")
KERNEL_BLOCK = 64  # the C kernel's query and key blocks when no block is given (its tasks are 64 queries)


@register("local_window")
class LocalWindowAttention(AttentionVariant):
    """Sliding-window attention of radius ``window``, scored in query blocks of ``block`` rows, plus the
    first ``sink_tokens`` keys visible to every query (StreamingLLM's attention sinks; 0: none).

    ``sink_tokens`` is a structural knob (which keys are seen), unrelated to the ``sinks=`` argument of
    ``forward`` (learned sink logits, refused here: ``supports_sinks`` is False)."""

    exact = False  # an approximation of full attention; its oracle is the softmax over the band
    supports_attn_mask = False
    supports_cross = False
    native_gqa = True  # K/V heads are repeated after the keys out of reach are cut off
    native_window = True  # a call's window (a model's sliding window): the narrower of the two
    example_knobs = (
        {"window": 3, "block": 4},
        {"window": 5},
        {"window": 2, "block": 5},
        {"window": 3, "block": 4, "impl": "blocked"},
        # StreamingLLM's sinks: the first keys outside the band at N=24 (sdpa, then the reference)
        {"window": 3, "block": 4, "sink_tokens": 2},
        {"window": 2, "block": 5, "sink_tokens": 3, "impl": "blocked"},
        # the fused-SDPA route, which auto takes on the CPU only where the C kernel cannot run
        {"window": 3, "block": 4, "sink_tokens": 2, "impl": "sdpa"},
    )

    def __init__(
        self, window: int = 128, block: int | None = None, impl: str = "auto", sink_tokens: int = 0
    ) -> None:
        super().__init__()
        if window < 0:
            raise ValueError(f"window must be >= 0 (a radius in tokens), got {window}")
        if sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0 (first keys every query sees), got {sink_tokens}")
        if block is not None and block < 1:
            raise ValueError(f"block must be >= 1 or None, got {block}")
        if impl not in IMPLS:
            raise ValueError(f"local_window impl must be one of {', '.join(IMPLS)}; got '{impl}'")
        self.window = window
        self.block = block
        self.impl = impl
        self.sink_tokens = sink_tokens
        self.impl_ran: str | None = None
        self.impl_note: str | None = None  # why auto did not take the kernel on the CPU
        self._rows: dict[tuple[int, int, bool], sparse_kernel.Layout] = {}
        self._narrower: dict[int, LocalWindowAttention] = {}  # for calls with a narrower window
        # tiles of 128 (or the block, if given): the band is the predicate, the tile only how much
        # the kernel can skip
        self._flex = FlexKernel(self._band, block or CUDA_TILE)

    def knobs(self) -> dict[str, object]:
        return {
            "window": self.window,
            "block": self.block,
            "impl": self.impl,
            "sink_tokens": self.sink_tokens,
        }

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["impl_ran"] = self.impl_ran
        d["impl_note"] = self.impl_note
        tiles = {"flex": self._flex.tile_ran, "kernel": self._kernel_block()}
        d["tile"] = tiles.get(self.impl_ran)  # the block mask's tile, or the C kernel's block
        return d

    def choose_impl(self, w: Workload) -> str:
        """The implementation that runs ``w`` (``auto`` resolved: on the CPU the C kernel where it
        takes the workload, on CUDA ``flex`` where its kernel does, else ``sdpa``)."""
        if self.impl != "auto":
            return self.impl
        if w.device == "cpu":
            return "kernel" if self._cpu_kernel_refusal(w) is None else "sdpa"
        return "flex" if w.device == "cuda" and flex_refusal(w) is None else "sdpa"

    @staticmethod
    def _cpu_kernel_refusal(w: Workload) -> str | None:
        """Why ``auto`` does not take the C kernel for ``w`` on the CPU, or None."""
        if w.nq == 1 and w.nk > 1:
            # a decoding step: the kernel's 64-query tile holds one query, and one fused SDPA call on
            # the keys in reach was faster (Llama shape, window 512: 92 against 103 us a layer)
            return "one query onto a cache: one fused SDPA call over the keys in reach"
        return sparse_kernel.unusable(w)

    def native_documents(self, w: Workload) -> bool:
        """Packed documents are one more token-level mask in every implementation (a query's band
        stops at its document's edges), without attention sinks: see :meth:`check`."""
        return not self.sink_tokens

    def check(self, w: Workload) -> None:
        if w.documents and self.sink_tokens:
            raise Unsupported(
                f"local_window with sink_tokens={self.sink_tokens} takes no packed documents: each "
                "document would need its own first tokens as sinks, which this variant does not place"
            )
        super().check(w)
        if self.choose_impl(w) == "flex" and (why := flex_refusal(w)):
            raise Unsupported(f"local_window impl=flex {why}")
        if self.impl == "kernel":
            if why := sparse_kernel.refusal(w):
                raise Unsupported(f"local_window impl=kernel: {why}")
            if sparse_kernel.kernel() is None:
                raise Unavailable(f"local_window impl=kernel: {sparse_kernel.build_error()}")

    def _block_size(self, n: int, window: int) -> int:
        # a block as wide as the window keeps the span (block + 2w) within 3x the useful band (2w + 1)
        # while the matmuls stay large; never wider than the sequence (padding would be wasted work)
        b = self.block if self.block is not None else max(window, 16)
        return max(1, min(b, n))

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, window=None, documents=None):
        if window is not None and window < self.window:  # the call's band lies inside this one
            narrower = self._narrower.get(window)
            if narrower is None:  # the call narrows the band only: the sinks stay
                narrower = self._narrower[window] = LocalWindowAttention(
                    window, self.block, self.impl, sink_tokens=self.sink_tokens
                )
            narrower._flex.compile = (
                self._flex.compile
            )  # its FlexAttention kernel as this one's, eager or not
            out = narrower._attend(
                q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=None, documents=documents
            )
            self.impl_ran = narrower.impl_ran
            return out
        h, nq, nk = q.shape[1], q.shape[2], k.shape[2]
        if nq < nk:
            # the queries are the last Nq positions: only keys from (first position - window) on can
            # be seen, so the rest of the cache is never touched (decoding costs O(window), not O(Nk))
            lo = max(0, nk - nq - self.window)
            s = self.sink_tokens
            if s and lo > s:
                # and the sinks: the first s keys joined to those in reach (small copies, O(s + window)).
                # Renumbered, the sinks are still keys 0..s-1 and every query's band starts at or after
                # key s (position - window >= lo maps to >= s), so the same pattern applies unchanged
                k = torch.cat([k[:, :, :s], k[:, :, lo:]], 2)  # (B, Hkv, s + Nk - lo, D)
                v = torch.cat([v[:, :, :s], v[:, :, lo:]], 2)  # (B, Hkv, s + Nk - lo, Dv)
                if key_padding_mask is not None:
                    key_padding_mask = torch.cat([key_padding_mask[:, :s], key_padding_mask[:, lo:]], 1)
            elif not s:
                k, v = k[:, :, lo:], v[:, :, lo:]  # (B, Hkv, Nk - lo, D|Dv), views
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask[:, lo:]  # (B, Nk - lo)
                if documents is not None:  # (no sinks: check refuses documents beside them)
                    documents = documents[:, lo:]  # (B, Nk - lo): a document cut short is still one run
            # (else the sinks reach the first band: every key is in reach, nothing to cut)
        w = Workload.of(q, k, v, causal=causal, key_padding_mask=key_padding_mask, documents=documents)
        impl = self.choose_impl(w)
        self.impl_ran = impl
        self.impl_note = self._cpu_kernel_refusal(w) if self.impl == "auto" and w.device == "cpu" else None
        if impl == "kernel":  # grouped K/V heads read in place, the band and the sinks at token level
            return sparse_kernel.forward(
                q,
                k,
                v,
                self._kernel_rows(nq, k.shape[2], causal),
                self._kernel_block(),
                causal=causal,
                key_padding_mask=key_padding_mask,
                scale=q.shape[-1] ** -0.5,
                window=self.window,
                sinks=self.sink_tokens,
                documents=documents,
            )  # (B, H, Nq, Dv)
        masks = {"key_padding_mask": key_padding_mask, "documents": documents}
        if impl == "sdpa" and nq < nk and nq <= (self.block or max(self.window, 16)):
            return self._few_queries_attend(q, k, v, causal=causal, **masks)
        k, v = repeat_kv(k, h), repeat_kv(v, h)  # grouped heads: only the keys kept are copied
        if impl == "flex":
            return self._flex(q, k, v, causal=causal, **masks)
        if impl == "sdpa":
            return self._sdpa_attend(q, k, v, causal=causal, **masks)
        return self._blocked_attend(q, k, v, causal=causal, **masks)

    def _kernel_rows(self, nq: int, nk: int, causal: bool) -> sparse_kernel.Layout:
        """The C kernel's layout: each query block holding a query with the key blocks its band
        touches (causal: none after its own) and those holding the sinks. Cached per
        ``(Nq, Nk, causal)``; ``O(Nk / b)`` rows of ``O(window / b)`` blocks of ``b`` tokens
        (:meth:`_kernel_block`)."""
        if (nq, nk, causal) not in self._rows:
            if len(self._rows) >= 64:  # a growing cache (prefill chunks): keep the memory bounded
                self._rows.clear()
            b = self._kernel_block()
            nb = -(-nk // b)
            sink_blocks = range(min(nb, -(-self.sink_tokens // b)))
            rows = []
            for r in range((nk - nq) // b, nb):
                lo = max(0, (r * b - self.window) // b)
                hi = r if causal else min(nb - 1, (r * b + b - 1 + self.window) // b)
                rows.append((r, sorted({*sink_blocks, *range(lo, hi + 1)})))
            self._rows[nq, nk, causal] = sparse_kernel.layout(rows, nb)
        return self._rows[nq, nk, causal]

    def _kernel_block(self) -> int:
        """The C kernel's query and key block: ``block`` where given, else :data:`KERNEL_BLOCK`."""
        return self.block or KERNEL_BLOCK

    def _few_queries_attend(self, q, k, v, *, causal, key_padding_mask, documents=None):
        """Fewer queries than keys, all within one query block (decoding, a short prefill onto a cache):
        one fused SDPA call on the keys in reach (``k``, ``v`` already cut to them, the sinks first) with
        the band OR the sinks as its mask, grouped K/V heads left to SDPA (no copy, no padding, no
        spans). ``O(Nq (Nq + window + sink_tokens))``."""
        nq, nk = q.shape[2], k.shape[2]
        p = torch.arange(nk - nq, nk, device=q.device)[:, None]  # (Nq, 1): positions of the queries
        j = torch.arange(nk, device=q.device)[None, :]  # (1, Nk)
        blocked = (p - j).abs() > self.window
        if self.sink_tokens:  # a sink is seen even outside the band (one mask entry: counted once)
            blocked = blocked & (j >= self.sink_tokens)
        if causal:
            blocked = blocked | (j > p)
        blocked = blocked[None, None]  # (1, 1, Nq, Nk)
        if key_padding_mask is not None:
            blocked = blocked | ~key_padding_mask.to(q.device)[:, None, None, :]  # (B, 1, Nq, Nk)
        if documents is not None:
            blocked = blocked | ~document_mask(documents.to(q.device), nq)  # (B, 1, Nq, Nk)
        return sdpa_blocked(q, k, v, blocked, enable_gqa=k.shape[1] != q.shape[1])  # (B, H, Nq, Dv)

    def _geometry(self, nq: int, nk: int, causal: bool) -> tuple[int, int, int, int, int, int, int]:
        """``(w, b, nb, n_pad, span, off, right)``: clipped window, block, query blocks, padded query
        length, keys a block can see, position of query 0 (``Nk - Nq``), and right padding of K/V so
        that ``unfold`` yields exactly ``nb`` spans."""
        w = min(self.window, nk - 1)  # a wider window sees nothing more
        b = self._block_size(nq, w)
        nb = -(-nq // b)  # number of query blocks
        n_pad = nb * b
        span = b + w if causal else b + 2 * w
        off = nk - nq
        # K is padded by w on the left; block c's span starts at padded index c*b + off
        right = off + (nb - 1) * b + span - w - nk
        return w, b, nb, n_pad, span, off, right

    def _sink_slots(self, nk: int, w: int) -> int:
        """How many sink slots go in front of each block's span: ``sink_tokens`` (at most ``Nk``), or 0
        when the clipped window ``w`` reaches every key (every sink is in every band already)."""
        return 0 if w >= nk - 1 else min(self.sink_tokens, nk)

    def _blocked_mask(
        self,
        nq: int,
        nk: int,
        causal: bool,
        key_padding_mask: torch.Tensor | None,
        device: torch.device,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """True where query row ``r`` of block ``c`` may not see slot ``t`` of its keys (the ``ns`` sink
        slots, then the span): ``(nb, b, ns + span)``, or ``(B, 1, nb, b, ns + span)`` with key
        padding or packed ``documents`` (ids ``(B, Nk)``; never beside sinks) (``ns`` from
        :meth:`_sink_slots`, 0 without sinks)."""
        w, b, nb, n_pad, span, off, right = self._geometry(nq, nk, causal)
        # query r of a block vs span slot t: i - j = r + w - t, independent of the block, so the
        # band is one (b, span) matrix shared by all blocks
        r = torch.arange(b, device=device)[:, None]  # (b, 1)
        t = torch.arange(span, device=device)[None, :]  # (1, span)
        outside = (t < r) | (t > r + (w if causal else 2 * w))  # (b, span)
        # which span slots are not real keys (the padding added around K, or key padding), per block
        absent = torch.ones(w + nk + right, dtype=torch.bool, device=device)  # (Lp,)
        absent[w : w + nk] = False
        if key_padding_mask is not None:
            absent = absent | ~F.pad(key_padding_mask.to(device), (w, right))  # (B, Lp)
        absent = absent[..., off:].unfold(-1, span, b)  # (nb, span) or (B, nb, span)
        if absent.dim() == 3:
            blocked = outside | absent[:, None, :, None, :]  # (B, 1, nb, b, span)
        else:
            blocked = outside | absent[:, None, :]  # (nb, b, span)
        if documents is not None:  # a slot of another document than the query's
            ids = documents.to(device)
            q_ids = F.pad(ids[:, off:], (0, n_pad - nq), value=-1).view(-1, nb, b)  # (B, nb, b)
            slot_ids = F.pad(ids, (w, right), value=-1)[:, off:].unfold(-1, span, b)  # (B, nb, span)
            other = q_ids[:, :, :, None] != slot_ids[:, :, None, :]  # (B, nb, b, span)
            blocked = blocked | other[:, None]  # (B, 1, nb, b, span)
        ns = self._sink_slots(nk, w)
        if not ns:
            return blocked
        # sink slot u (key u) for query row r of block c, at position p = off + c*b + r, depends on the
        # block (unlike the band): hidden where the band already shows key u (counted once), after p
        # when causal, and where key u is padding
        p = off + torch.arange(n_pad, device=device).view(nb, b, 1)  # (nb, b, 1): query positions
        u = torch.arange(ns, device=device)  # (ns,): sink keys
        hide = (p - u).abs() <= w  # (nb, b, ns)
        if causal:
            hide = hide | (u > p)
        if key_padding_mask is not None:
            hide = hide | ~key_padding_mask.to(device)[:, None, None, None, :ns]  # (B, 1, nb, b, ns)
        return torch.cat([hide, blocked], -1)  # (nb, b, ns + span) or (B, 1, nb, b, ns + span)

    def _spans(self, x: torch.Tensor, nq: int, causal: bool) -> torch.Tensor:
        """``x (B, H, Nk, E)`` padded and cut into the overlapping key spans of ``Nq`` queries:
        ``(B, H, nb, E, span)``, a strided view (no copy yet)."""
        w, b, _, _, span, off, right = self._geometry(nq, x.shape[2], causal)
        xp = F.pad(x, (0, 0, w, right))  # (B, H, w + Nk + right, E)
        # the span of block c holds padded positions [off + c*b, off + c*b + span), i.e. keys
        # off + c*b - w + t
        return xp[:, :, off:].unfold(2, span, b)  # (B, H, nb, E, span)

    def _sdpa_attend(self, q, k, v, *, causal, key_padding_mask, documents=None):
        bsz, h, n, d = q.shape
        dv = v.shape[-1]
        w, b, nb, n_pad, span, _, _ = self._geometry(n, k.shape[2], causal)
        ns = self._sink_slots(k.shape[2], w)
        width = ns + span  # keys each block is scored against: the sinks, then its span
        qp = F.pad(q, (0, 0, 0, n_pad - n)) if n_pad > n else q  # (B, H, Np, D)
        qb = qp.reshape(bsz, h, nb, b, d)  # (B, H, nb, b, D)
        ku = self._spans(k, n, causal)  # (B, H, nb, D, span), a view
        vu = self._spans(v, n, causal)  # (B, H, nb, Dv, span), a view
        blocked = self._blocked_mask(
            n, k.shape[2], causal, key_padding_mask, q.device, documents
        )  # (nb|B, ..., b, width)
        # spans are copied out a chunk of blocks at a time (see masks.CHUNK_BYTES)
        per_block = bsz * h * (width * (d + dv) + b * width) * q.element_size()
        step = blocks_per_chunk(per_block, nb)
        outs = []
        # chunks by split, not by slicing: the backward of a slice is a zero tensor the size of the
        # whole input, once per chunk (quadratic in N: fwd+bwd at N=16384 took 19x the forward);
        # split's backward concatenates the chunks' gradients once
        pieces = zip(ku.split(step, dim=2), vu.split(step, dim=2), qb.split(step, dim=2), strict=True)
        for s, (kc, vc, qc) in zip(range(0, nb, step), pieces, strict=True):
            m = kc.shape[2]
            if ns:  # the sinks in front of every span: one copy, the concatenation (contiguous)
                kc = torch.cat([k[:, :, None, :ns].expand(bsz, h, m, ns, d), kc.transpose(-2, -1)], 3)
                vc = torch.cat([v[:, :, None, :ns].expand(bsz, h, m, ns, dv), vc.transpose(-2, -1)], 3)
                kc = kc.reshape(bsz * h, m, width, d)  # (B, H, m, ns + span, D) -> (B*H, m, width, D)
                vc = vc.reshape(bsz * h, m, width, dv)  # (B*H, m, width, Dv)
            else:
                kc = kc.transpose(-2, -1).reshape(bsz * h, m, span, d)  # (B*H, m, span, D)
                vc = vc.transpose(-2, -1).reshape(bsz * h, m, span, dv)  # (B*H, m, span, Dv)
            if blocked.dim() == 5:  # padding or documents: one mask per batch element, repeated over heads
                bc = blocked[:, :, s : s + m].expand(bsz, h, m, b, width).reshape(bsz * h, m, b, width)
            else:
                bc = blocked[None, s : s + m]  # (1, m, b, width): 4-D, the CPU's fused kernel takes it
            # each block is one "head" of SDPA
            out = sdpa_blocked(qc.reshape(bsz * h, m, b, d), kc, vc, bc)  # (B*H, m, b, Dv)
            outs.append(out.reshape(bsz, h, m * b, dv))  # CUDA SDPA may return a non-contiguous view
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (B, H, Np, Dv)
        return out[:, :, :n]  # padded queries dropped

    def _blocked_attend(self, q, k, v, *, causal, key_padding_mask, documents=None):
        bsz, h, n, d = q.shape
        w, b, nb, n_pad, _, _, _ = self._geometry(n, k.shape[2], causal)
        ns = self._sink_slots(k.shape[2], w)
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        # scale q before the matmul: in low precision q k^T could overflow first
        qs = q.to(work) * d**-0.5  # (B, H, N, D)
        if n_pad > n:  # (F.pad copies even when there is nothing to pad)
            qs = F.pad(qs, (0, 0, 0, n_pad - n))  # (B, H, Np, D)
        qb = qs.reshape(bsz, h, nb, b, d)  # (B, H, nb, b, D)
        ku = self._spans(k.to(work), n, causal)  # (B, H, nb, D, span): already K^T per block
        vu = self._spans(v.to(work), n, causal).transpose(-2, -1)  # (B, H, nb, span, Dv)
        if ns:  # the sinks in front of every block's span (ns keys each, copied with the spans)
            sk = k[:, :, None, :ns].to(work).transpose(-2, -1)  # (B, H, 1, D, ns)
            sv = v[:, :, None, :ns].to(work)  # (B, H, 1, ns, Dv)
            ku = torch.cat([sk.expand(bsz, h, nb, d, ns), ku], -1)  # (B, H, nb, D, ns + span)
            vu = torch.cat([sv.expand(bsz, h, nb, ns, v.shape[-1]), vu], -2)  # (B, H, nb, ns + span, Dv)
        blocked = self._blocked_mask(n, k.shape[2], causal, key_padding_mask, q.device, documents)
        # the scores are not kept: softmax overwrites them, and only p is needed afterwards
        p = softmax_blocked_(qb @ ku, blocked)  # (B, H, nb, b, ns + span)
        out = zero_empty_rows(p @ vu, blocked)  # (B, H, nb, b, Dv)
        out = out.reshape(bsz, h, n_pad, v.shape[-1])  # (B, H, Np, Dv)
        return out[:, :, :n].to(q.dtype)  # padded queries dropped

    def cache_len(self, nk: int) -> int:
        """Cached keys a decoding step reads after a context of ``nk`` positions: the last ``window``
        (besides the new key) and the first ``sink_tokens``, all ``nk`` where the two overlap. The
        others can go: a cache of the sinks and the last ``window`` keys gives the same output."""
        return min(nk, self.window + self.sink_tokens)

    def sink_keys(self) -> int:
        """The first ``sink_tokens`` keys: every query sees them, wherever the band is."""
        return self.sink_tokens

    def _band(self, nq: int, nk: int, causal: bool, device: torch.device) -> MaskMod:
        """The band and the sinks of a call as FlexAttention's predicate
        (:data:`variants.flex_kernel.Pattern`)."""
        return band_mask_mod(nq, nk, self.window, causal, self.sink_tokens)

    def pattern(self, nq: int, nk: int, causal: bool = False) -> torch.Tensor:
        """``|p - j| <= window`` or ``j < sink_tokens`` (and ``j <= p`` if causal) for the query at
        position ``p = i + Nk - Nq``: boolean ``(Nq, Nk)``."""
        return band_pattern(nq, nk, self.window, causal, self.sink_tokens)

    def window_exempt(self, nq: int, nk: int, causal: bool = False) -> torch.Tensor:
        """The pairs a call's ``window=`` leaves visible outside its band: the sinks (``j <
        sink_tokens``, and ``j <= p`` if causal), as boolean ``(Nq, Nk)``. A call's window narrows the
        band and keeps the sinks this instance was built with; the float64 oracle reads this."""
        return self.pattern(nq, nk, causal) & (torch.arange(nk) < self.sink_tokens)[None, :]

    def num_pairs(self, nq: int, nk: int, causal: bool = False) -> int:
        """Pairs of :meth:`pattern`, counted in ``O(window + sink_tokens)``."""
        return band_pairs(nq, nk, self.window, causal, self.sink_tokens)
