"""``local_window``: sliding-window (banded) attention, computed block by block (Longformer's local
attention; Beltagy et al., 2020, "Longformer: The Long-Document Transformer").

Query ``i`` sees key ``j`` iff ``|i - j| <= window`` (and ``j <= i`` when causal). A window of ``N - 1``
or more is full attention. Queries are cut into blocks of ``block`` rows; a block starting at ``s``
can only see keys in ``[s - window, s + block - 1 + window]``, so each block is scored against that
span of ``block + 2 * window`` keys (``block + window`` when causal: later keys are never visible).
K and V are padded by ``window`` on both sides and to a multiple of ``block``, and the spans are
strided views of them (``unfold``; the batched matmul copies each span once, ``(block + 2 window) /
block`` times the size of K), so every block is scored in one batched matmul and no ``N x N``
matrix exists, forward or backward.

Three implementations of the same pattern, chosen by the ``impl`` knob (``impl_ran`` in the record):

- ``sdpa``: the spans are copied out (``(block + 2 window) / block`` times the size of K and V) and
  every block is one "head" of PyTorch's fused ``scaled_dot_product_attention`` with an additive band
  mask of shape ``(1, nb, block, span)`` shared by all batch elements and heads (4-D, so the CPU picks
  its fused flash kernel; a 3-D mask sends it to the unfused math path, 2.6x slower here). Scores,
  softmax and the weighted sum stay inside the kernel, forward and backward.
- ``blocked``: the same spans scored with batched matmuls and an in-place softmax in plain PyTorch
  (the reference implementation: every step visible).
- ``flex``: FlexAttention's compiled kernel with the band as its block mask
  (:mod:`variants.flex_kernel`, the predicate from :mod:`variants.patterns`); no backward on the CPU;
  compiles once per shape.
- ``auto`` (default): ``flex`` on CUDA (a Triton kernel that skips tiles outside the band), ``sdpa``
  on the CPU (no compile, and faster there than compiled flex at N=2048-8192).

Shapes: ``q (B, H, N, D)``, ``k (B, H, N, D)``, ``v (B, H, N, Dv)`` -> ``(B, H, N, Dv)``; self-attention
only (``Nq == Nk``), with causal and key padding masks, no arbitrary ``attn_mask``.
Time ``O(B H N (block + 2 window) D)``; memory ``O(N (block + 2 window))`` for the shared mask
(``O(B H N (block + 2 window))`` with key padding, or for the ``blocked`` scores): linear in ``N`` at a
fixed window. ``blocked`` accumulates low-precision inputs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionVariant, Unsupported, Workload, repeat_kv
from .flex_kernel import CUDA_TILE, FlexKernel, flex_refusal
from .masks import blocks_per_chunk, sdpa_blocked, softmax_blocked_, zero_empty_rows
from .patterns import MaskMod, band_mask_mod, band_pairs, band_pattern
from .registry import register

IMPLS = ("auto", "sdpa", "blocked", "flex")


@register("local_window")
class LocalWindowAttention(AttentionVariant):
    """Sliding-window attention of radius ``window``, scored in query blocks of ``block`` rows."""

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
    )

    def __init__(self, window: int = 128, block: int | None = None, impl: str = "auto") -> None:
        super().__init__()
        if window < 0:
            raise ValueError(f"window must be >= 0 (a radius in tokens), got {window}")
        if block is not None and block < 1:
            raise ValueError(f"block must be >= 1 or None, got {block}")
        if impl not in IMPLS:
            raise ValueError(f"local_window impl must be one of {', '.join(IMPLS)}; got '{impl}'")
        self.window = window
        self.block = block
        self.impl = impl
        self.impl_ran: str | None = None
        self._narrower: dict[int, LocalWindowAttention] = {}  # for calls with a narrower window
        # tiles of 128 (or the block, if given): the band is the predicate, the tile only how much
        # the kernel can skip
        self._flex = FlexKernel(self._band, block or CUDA_TILE)

    def knobs(self) -> dict[str, object]:
        return {"window": self.window, "block": self.block, "impl": self.impl}

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["impl_ran"] = self.impl_ran
        d["tile"] = self._flex.tile_ran if self.impl_ran == "flex" else None
        return d

    def choose_impl(self, w: Workload) -> str:
        """The implementation that runs ``w`` (``auto`` resolved: ``flex`` on CUDA where its kernel
        takes the workload, else ``sdpa``)."""
        if self.impl != "auto":
            return self.impl
        return "flex" if w.device == "cuda" and flex_refusal(w) is None else "sdpa"

    def check(self, w: Workload) -> None:
        super().check(w)
        if self.choose_impl(w) == "flex" and (why := flex_refusal(w)):
            raise Unsupported(f"local_window impl=flex {why}")

    def _block_size(self, n: int, window: int) -> int:
        # a block as wide as the window keeps the span (block + 2w) within 3x the useful band (2w + 1)
        # while the matmuls stay large; never wider than the sequence (padding would be wasted work)
        b = self.block if self.block is not None else max(window, 16)
        return max(1, min(b, n))

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, window=None):
        if window is not None and window < self.window:  # the call's band lies inside this one
            narrower = self._narrower.get(window)
            if narrower is None:
                narrower = self._narrower[window] = LocalWindowAttention(window, self.block, self.impl)
            out = narrower._attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=None)
            self.impl_ran = narrower.impl_ran
            return out
        h, nq, nk = q.shape[1], q.shape[2], k.shape[2]
        if nq < nk:
            # the queries are the last Nq positions: only keys from (first position - window) on can
            # be seen, so the rest of the cache is never touched (decoding costs O(window), not O(Nk))
            lo = max(0, nk - nq - self.window)
            k, v = k[:, :, lo:], v[:, :, lo:]  # (B, Hkv, Nk - lo, D|Dv), views
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask[:, lo:]  # (B, Nk - lo)
        impl = self.choose_impl(Workload.of(q, k, v, causal=causal, key_padding_mask=key_padding_mask))
        self.impl_ran = impl
        if impl == "sdpa" and nq < nk and nq <= (self.block or max(self.window, 16)):
            return self._few_queries_attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
        k, v = repeat_kv(k, h), repeat_kv(v, h)  # grouped heads: only the keys kept are copied
        if impl == "flex":
            return self._flex(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
        if impl == "sdpa":
            return self._sdpa_attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
        return self._blocked_attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask)

    def _few_queries_attend(self, q, k, v, *, causal, key_padding_mask):
        """Fewer queries than keys, all within one query block (decoding, a short prefill onto a cache):
        one fused SDPA call on the keys in reach (``k``, ``v`` already cut to them) with the band as its
        mask, grouped K/V heads left to SDPA (no copy, no padding, no spans). ``O(Nq (Nq + window))``."""
        nq, nk = q.shape[2], k.shape[2]
        p = torch.arange(nk - nq, nk, device=q.device)[:, None]  # (Nq, 1): positions of the queries
        j = torch.arange(nk, device=q.device)[None, :]  # (1, Nk)
        blocked = (p - j).abs() > self.window
        if causal:
            blocked = blocked | (j > p)
        blocked = blocked[None, None]  # (1, 1, Nq, Nk)
        if key_padding_mask is not None:
            blocked = blocked | ~key_padding_mask.to(q.device)[:, None, None, :]  # (B, 1, Nq, Nk)
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

    def _blocked_mask(
        self, nq: int, nk: int, causal: bool, key_padding_mask: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        """True where query row ``r`` of block ``c`` may not see span slot ``t``: ``(nb, b, span)``, or
        ``(B, 1, nb, b, span)`` with key padding."""
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
            return outside | absent[:, None, :, None, :]  # (B, 1, nb, b, span)
        return outside | absent[:, None, :]  # (nb, b, span)

    def _spans(self, x: torch.Tensor, nq: int, causal: bool) -> torch.Tensor:
        """``x (B, H, Nk, E)`` padded and cut into the overlapping key spans of ``Nq`` queries:
        ``(B, H, nb, E, span)``, a strided view (no copy yet)."""
        w, b, _, _, span, off, right = self._geometry(nq, x.shape[2], causal)
        xp = F.pad(x, (0, 0, w, right))  # (B, H, w + Nk + right, E)
        # the span of block c holds padded positions [off + c*b, off + c*b + span), i.e. keys
        # off + c*b - w + t
        return xp[:, :, off:].unfold(2, span, b)  # (B, H, nb, E, span)

    def _sdpa_attend(self, q, k, v, *, causal, key_padding_mask):
        bsz, h, n, d = q.shape
        dv = v.shape[-1]
        _, b, nb, n_pad, span, _, _ = self._geometry(n, k.shape[2], causal)
        qp = F.pad(q, (0, 0, 0, n_pad - n)) if n_pad > n else q  # (B, H, Np, D)
        qb = qp.reshape(bsz, h, nb, b, d)  # (B, H, nb, b, D)
        ku = self._spans(k, n, causal)  # (B, H, nb, D, span), a view
        vu = self._spans(v, n, causal)  # (B, H, nb, Dv, span), a view
        blocked = self._blocked_mask(
            n, k.shape[2], causal, key_padding_mask, q.device
        )  # (nb|B, ..., b, span)
        # spans are copied out a chunk of blocks at a time (see masks.CHUNK_BYTES)
        per_block = bsz * h * (span * (d + dv) + b * span) * q.element_size()
        step = blocks_per_chunk(per_block, nb)
        outs = []
        # chunks by split, not by slicing: the backward of a slice is a zero tensor the size of the
        # whole input, once per chunk (quadratic in N: fwd+bwd at N=16384 took 19x the forward);
        # split's backward concatenates the chunks' gradients once
        pieces = zip(ku.split(step, dim=2), vu.split(step, dim=2), qb.split(step, dim=2), strict=True)
        for s, (kc, vc, qc) in zip(range(0, nb, step), pieces, strict=True):
            m = kc.shape[2]
            kc = kc.transpose(-2, -1).reshape(bsz * h, m, span, d)  # (B*H, m, span, D)
            vc = vc.transpose(-2, -1).reshape(bsz * h, m, span, dv)  # (B*H, m, span, Dv)
            if blocked.dim() == 5:  # key padding: one mask per batch element, repeated over heads
                bc = blocked[:, :, s : s + m].expand(bsz, h, m, b, span).reshape(bsz * h, m, b, span)
            else:
                bc = blocked[None, s : s + m]  # (1, m, b, span): 4-D, the CPU's fused kernel takes it
            # each block is one "head" of SDPA
            out = sdpa_blocked(qc.reshape(bsz * h, m, b, d), kc, vc, bc)  # (B*H, m, b, Dv)
            outs.append(out.reshape(bsz, h, m * b, dv))  # CUDA SDPA may return a non-contiguous view
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (B, H, Np, Dv)
        return out[:, :, :n]  # padded queries dropped

    def _blocked_attend(self, q, k, v, *, causal, key_padding_mask):
        bsz, h, n, d = q.shape
        _, b, nb, n_pad, _, _, _ = self._geometry(n, k.shape[2], causal)
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        # scale q before the matmul: in low precision q k^T could overflow first
        qs = q.to(work) * d**-0.5  # (B, H, N, D)
        if n_pad > n:  # (F.pad copies even when there is nothing to pad)
            qs = F.pad(qs, (0, 0, 0, n_pad - n))  # (B, H, Np, D)
        qb = qs.reshape(bsz, h, nb, b, d)  # (B, H, nb, b, D)
        ku = self._spans(k.to(work), n, causal)  # (B, H, nb, D, span): already K^T per block
        vu = self._spans(v.to(work), n, causal).transpose(-2, -1)  # (B, H, nb, span, Dv)
        blocked = self._blocked_mask(n, k.shape[2], causal, key_padding_mask, q.device)
        # the scores are not kept: softmax overwrites them, and only p is needed afterwards
        p = softmax_blocked_(qb @ ku, blocked)  # (B, H, nb, b, span)
        out = zero_empty_rows(p @ vu, blocked)  # (B, H, nb, b, Dv)
        out = out.reshape(bsz, h, n_pad, v.shape[-1])  # (B, H, Np, Dv)
        return out[:, :, :n].to(q.dtype)  # padded queries dropped

    def cache_len(self, nk: int) -> int:
        """Decoding reads the last ``window`` cached keys (and the new one): older keys can go."""
        return min(nk, self.window)

    def _band(self, nq: int, nk: int, causal: bool, device: torch.device) -> MaskMod:
        """The band of a call as FlexAttention's predicate (:data:`variants.flex_kernel.Pattern`)."""
        return band_mask_mod(nq, nk, self.window, causal)

    def pattern(self, nq: int, nk: int, causal: bool = False) -> torch.Tensor:
        """``|p - j| <= window`` (and ``j <= p`` if causal) for the query at position ``p = i + Nk - Nq``."""
        return band_pattern(nq, nk, self.window, causal)

    def num_pairs(self, nq: int, nk: int, causal: bool = False) -> int:
        return band_pairs(nq, nk, self.window, causal)
