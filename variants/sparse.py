"""``sparse``: block-sparse attention with window, global and random blocks (BigBird: Zaheer et al.,
2020, "Big Bird: Transformers for Longer Sequences"; the window + global part is Longformer's,
Beltagy et al., 2020).

The sequence is cut into blocks of ``block`` tokens; ``nb = ceil(N / block)``. Query block ``i`` sees
key blocks

- ``i - window_blocks .. i + window_blocks`` (the sliding window, clipped at the ends),
- ``0 .. global_blocks - 1`` (global blocks: every query sees them),
- with ``stride_blocks = s > 0``, every block ``j`` with ``(i - j) % s == 0`` (the Sparse
  Transformer's strided pattern, Child et al., 2019, at block level: with ``global_blocks =
  random_blocks = 0`` and ``s`` near ``sqrt(nb)`` it is that pattern alone, ``O(N^1.5)``);
- ``random_blocks`` other key blocks drawn without replacement, with a fixed seed, from the blocks
  not already in its window, global or strided set (fewer when not that many are left);

and the queries of the global blocks see every key. With causal masking strided and random blocks
come only from the past before the window, so no slot is spent on the future. The layout depends
only on ``(N, knobs, causal)``. Causal masking is intersected with it at token level (the window
blocks after the diagonal are not computed at all). ``pattern()`` is the token-level form of the
layout.

Only the blocks in the layout are computed: a table gives each query block a fixed number of key
blocks (window + global + strided + random slots; a slot that repeats a block or falls off the end is masked
out), those key/value blocks are gathered and every query block is scored against its own in one
batched matmul. The few global query blocks are computed densely against all keys. ``N`` is padded
to a multiple of ``block`` internally: padded keys are masked, padded queries dropped.

Shapes: ``q (B, H, Nq, D)``, ``k (B, H, N, D)``, ``v (B, H, N, Dv)`` -> ``(B, H, Nq, Dv)`` with ``Nq <= N``:
self-attention, or its last ``Nq`` positions against a cache of ``N`` keys (decoding, ``Nq = 1``; the
layout is that of length ``N``, and only the query blocks holding those positions are computed); with
causal and key padding masks, no arbitrary ``attn_mask``. With ``S = 2 window_blocks + 1
+ global_blocks + ceil(nb / stride_blocks) + random_blocks`` slots, time ``O(B H N (S +
global_blocks) block D)`` and memory ``O(B H N (S + global_blocks) block)``: linear in ``N`` at a
fixed pattern without a stride.

The layout is computed by ``impl``:

- ``kernel``: the suite's C kernel (:mod:`variants.sparse_kernel`, built on first use with the system
  compiler): each query block against its listed key blocks, K and V read in place, the masks at
  token level, and its own backward (probabilities recomputed from the saved log-sum-exp, FlashAttention-2
  style); float32 on the CPU.
- ``sdpa``: the key blocks gathered a chunk at a time and every query block made one "head" of
  PyTorch's fused ``scaled_dot_product_attention`` with a 4-D additive mask; its backward gathers
  again per chunk instead of keeping the copies (:mod:`variants.gathered_sdpa`).
- ``blocked``: the same gathered blocks with batched matmuls and an in-place softmax in plain
  PyTorch, accumulating low-precision inputs in float32 (the reference).
- ``flex``: this very layout as a FlexAttention block mask (:mod:`variants.flex_kernel`: a Triton
  kernel on CUDA that skips the tiles outside the layout, fwd and bwd; no backward on the CPU; no
  float64). With few batch-heads on a GPU its global query rows are one dense SDPA call beside the
  kernel (in the block mask their tile row would walk every key tile while the others walk a
  handful, and set the kernel's time); ``global_rows`` in the record says where they ran (``dense``
  or ``block mask``; causal attention keeps them in the block mask, where they see only their own
  past; the knob ``global_rows=dense|block_mask`` forces either, ``auto`` decides per shape). The
  global key columns stay in the block mask: computed apart as well (dense, in float32, merged by
  log-sum-exp) they cost more than their backward tail saved at B=1, H=8, D=64, N=4096 to 65536 on
  an H100 (results/gpu/NOTES.md). ``cuda_tile`` is the block mask's tile on CUDA: in 64-wide
  tiles a 64-block layout fills whole tiles (at 128 about half of each visited tile lies outside
  the layout, and every tile is partial, so the layout's predicate is evaluated on every pair); a
  tile below 128 is autotuned on its first call (:mod:`variants.flex_kernel`). ``auto`` takes 64
  where the global tile row would be the 128-wide kernel's tail at all, with the global rows in the mask
  (4.07x faster than dense SDPA at B=1 H=8 D=64 N=16384 on an H100, against 1.62x with the rows
  apart in 128 tiles) when ``block`` is 64, else 128; ``tile`` in the record says which ran.
- ``auto``: on the CPU ``kernel`` where it takes the call (else ``sdpa``, and ``impl_note`` says
  why); on CUDA ``flex`` when ``block`` divides 128 or is a multiple of it (the kernel's tiles), else
  ``sdpa``. The record's ``impl_ran`` says which ran.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import sparse_kernel
from .base import AttentionVariant, Unavailable, Unsupported, Workload
from .flex_kernel import CUDA_TILE, CUDA_TILES, FlexKernel, flex_refusal, tiles_per_head
from .gathered_sdpa import gathered_sdpa
from .masks import sdpa_blocked, softmax_blocked_, zero_empty_rows
from .patterns import MaskMod, block_layout, layout_blocks, layout_mask_mod, layout_pairs, layout_pattern
from .registry import register

IMPLS = ("auto", "kernel", "sdpa", "blocked", "flex")
GLOBAL_ROWS = ("auto", "dense", "block_mask")  # where the flex route computes the global query rows
# cuda_tile=auto's tile where the 128-wide kernel's global tile row would be its tail (_fine_tiles)
FINE_TILE = 64


# How many key tiles more than the balanced load the global tile row must walk before a dense call
# beside the kernel pays for itself (its launch, mask and concatenation, forward and backward). H100,
# bf16 fwd+bwd, B=1 H=8 D=64, 2026-11-26: 19 tiles more (N=4096) lost (1.39 ms apart against 0.76 in
# the block mask), 74 more (N=16384) won (2.34 against 3.17); 40 is about their geometric mean.
MIN_TAIL_EXCESS_TILES = 40


def tail_excess(batch_heads: int, tiles_per_head: float, key_tiles: int, sms: int) -> float:
    """How many tiles more one tile row that visits all ``key_tiles`` walks than the kernel's other
    work takes per multiprocessor (the ``batch_heads * tiles_per_head`` tiles spread evenly over
    ``sms``); negative where that row is not the kernel's tail. ``O(1)``."""
    return key_tiles - batch_heads * tiles_per_head / sms


@register("sparse")
class BlockSparseAttention(AttentionVariant):
    """BigBird block-sparse attention: window, global and random key blocks per query block."""

    exact = False  # an approximation of full attention; its oracle is the softmax over the layout
    supports_attn_mask = False
    supports_cross = False
    native_gqa = True  # K/V heads are repeated only in the gathered blocks
    example_knobs = (
        {"block": 4, "window_blocks": 1, "global_blocks": 1, "random_blocks": 1},
        {"block": 5, "window_blocks": 0, "global_blocks": 1, "random_blocks": 2, "seed": 3},
        {"block": 3, "window_blocks": 1, "global_blocks": 0, "random_blocks": 1, "stride_blocks": 3},
        {"block": 4, "window_blocks": 1, "global_blocks": 1, "random_blocks": 1, "impl": "blocked"},
        {"block": 4, "window_blocks": 1, "global_blocks": 1, "random_blocks": 1, "impl": "sdpa"},
    )

    def __init__(
        self,
        block: int = 64,
        window_blocks: int = 1,
        global_blocks: int = 1,
        random_blocks: int = 1,
        seed: int = 0,
        stride_blocks: int = 0,
        impl: str = "auto",
        global_rows: str = "auto",
        cuda_tile: int | str = "auto",
    ) -> None:
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"sparse impl must be one of {', '.join(IMPLS)}; got '{impl}'")
        if global_rows not in GLOBAL_ROWS:
            raise ValueError(
                f"sparse global_rows must be one of {', '.join(GLOBAL_ROWS)}; got '{global_rows}'"
            )
        if cuda_tile != "auto" and cuda_tile not in CUDA_TILES:
            tiles = ", ".join(map(str, CUDA_TILES))
            raise ValueError(f"sparse cuda_tile must be auto or one of {tiles}; got {cuda_tile!r}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        if min(window_blocks, global_blocks, random_blocks, stride_blocks) < 0:
            raise ValueError(
                "window_blocks, global_blocks, random_blocks and stride_blocks must be >= 0, got "
                f"{window_blocks}, {global_blocks}, {random_blocks}, {stride_blocks}"
            )
        self.block = block
        self.window_blocks = window_blocks
        self.global_blocks = global_blocks
        self.random_blocks = random_blocks
        self.seed = seed
        self.stride_blocks = stride_blocks
        self.impl = impl
        self.global_rows = global_rows
        self.impl_ran: str | None = None
        self.impl_note: str | None = None  # why auto did not take the kernel on the CPU
        self._rows: dict[tuple[int, int, bool], sparse_kernel.Layout] = {}
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cuda_tile = cuda_tile
        tile = CUDA_TILE if cuda_tile == "auto" else cuda_tile
        self._flex = FlexKernel(self._layout_mask_mod, block, cuda_tile=tile)
        # the layout without its global query rows, which are one dense SDPA call instead (_flex_attend)
        self._flex_local = FlexKernel(self._local_rows_mask_mod, block, cuda_tile=tile)
        # the layout in whole-block tiles, where cuda_tile=auto takes them (_fine_tiles)
        self._flex_fine = FlexKernel(self._layout_mask_mod, block, cuda_tile=FINE_TILE)
        self.flex_ran: FlexKernel | None = None  # the kernel of the last flex call
        self._tail: dict[tuple, float] = {}  # per shape: the global tile row's excess (_tail_excess)
        self.global_rows_ran: str | None = None

    def knobs(self) -> dict[str, object]:
        return {
            "block": self.block,
            "window_blocks": self.window_blocks,
            "global_blocks": self.global_blocks,
            "random_blocks": self.random_blocks,
            "seed": self.seed,
            "stride_blocks": self.stride_blocks,
            "impl": self.impl,
            "global_rows": self.global_rows,
            "cuda_tile": self.cuda_tile,
        }

    def choose_impl(self, w: Workload) -> str:
        """The implementation that runs ``w`` (``auto`` resolved, see the module docstring)."""
        if self.impl != "auto":
            return self.impl
        if w.device == "cpu":
            return "kernel" if sparse_kernel.unusable(w) is None else "sdpa"
        flex_ok = w.device == "cuda" and self._flex_refusal(w) is None
        return "flex" if flex_ok else "sdpa"

    def _flex_refusal(self, w: Workload) -> str | None:
        return flex_refusal(w, layout_block=self.block, cuda_tile=self._flex.cuda_tile)

    def check(self, w: Workload) -> None:
        super().check(w)
        if self.choose_impl(w) == "flex" and (why := self._flex_refusal(w)):
            raise Unsupported(f"sparse impl=flex {why}")
        if self.cuda_tile != "auto" and (w.device != "cuda" or self.choose_impl(w) != "flex"):
            raise Unsupported(
                f"sparse cuda_tile={self.cuda_tile} sets the tile of FlexAttention's CUDA kernel; this "
                f"call runs impl={self.choose_impl(w)} on {w.device}"
            )
        if self.global_rows != "auto" and self.choose_impl(w) != "flex":
            raise Unsupported(
                f"sparse global_rows={self.global_rows} places the global rows of the flex route; this "
                f"call runs impl={self.choose_impl(w)}, which computes them its own way"
            )
        if self.impl == "kernel":
            if why := sparse_kernel.refusal(w):
                raise Unsupported(f"sparse impl=kernel: {why}")
            if sparse_kernel.kernel() is None:
                raise Unavailable(f"sparse impl=kernel: {sparse_kernel.build_error()}")

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["impl_ran"] = self.impl_ran
        d["impl_note"] = self.impl_note
        d["tile"] = self.flex_ran.tile_ran if self.impl_ran == "flex" and self.flex_ran else None
        d["global_rows"] = self.global_rows_ran if self.impl_ran == "flex" else None
        return d

    def layout(self, n: int, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, valid)`` key-block table ``(nb, S)`` for length ``n`` (see :func:`block_layout`)."""
        nb = -(-n // self.block)
        if (nb, causal) not in self._tables:  # built once per length: a Python loop over the blocks
            self._tables[nb, causal] = block_layout(
                nb,
                self.window_blocks,
                self.global_blocks,
                self.random_blocks,
                self.seed,
                causal,
                self.stride_blocks,
            )
        return self._tables[nb, causal]

    def _layout_mask_mod(self, nq: int, nk: int, causal: bool, device: torch.device) -> MaskMod:
        """The layout of a call as FlexAttention's predicate (:data:`variants.flex_kernel.Pattern`):
        that of length ``max(Nq, Nk)`` (causal: random blocks drawn from the past), read at token level."""
        blocks = self.block_pattern(max(nq, nk), causal).to(device)  # (nb, nb)
        return layout_mask_mod(nq, nk, blocks, self.block, causal)

    def _local_rows_mask_mod(self, nq: int, nk: int, causal: bool, device: torch.device) -> MaskMod:
        """:meth:`_layout_mask_mod` with the global query rows (positions ``< global_blocks * block``)
        seeing nothing: they are computed apart, densely (:meth:`_flex_attend`)."""
        layout = self._layout_mask_mod(nq, nk, causal, device)
        ng, off = self.global_blocks * self.block, max(0, nk - nq)
        return lambda qi, ki: layout(qi, ki) & (qi + off >= ng)

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        w = Workload.of(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        self.impl_ran = self.choose_impl(w)
        self.impl_note = sparse_kernel.unusable(w) if self.impl == "auto" and w.device == "cpu" else None
        if self.impl_ran == "flex":
            return self._flex_attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
        if self.impl_ran == "kernel":
            rows = self._kernel_rows(q.shape[2], k.shape[2], causal)
            return sparse_kernel.forward(
                q,
                k,
                v,
                rows,
                self.block,
                causal=causal,
                key_padding_mask=key_padding_mask,
                scale=q.shape[-1] ** -0.5,
            )  # (B, H, Nq, Dv)
        bsz, h, nq, d = q.shape
        n, dv = k.shape[2], v.shape[-1]
        off = n - nq  # query i is position i + off of the layout of length N
        b = self.block
        index, valid = self.layout(n, causal)
        nb = index.shape[0]
        if causal:  # the window slots after the diagonal block (offsets 1..wb) are entirely future
            wb = min(self.window_blocks, nb - 1)
            keep = [c for c in range(index.shape[1]) if not wb < c <= 2 * wb]
            index, valid = index[:, keep], valid[:, keep]  # (nb, S - wb)
        slots = index.shape[1]
        n_pad = nb * b
        g = min(self.global_blocks, nb)
        ng = min(g * b, n)  # global positions
        ngq = max(0, ng - off)  # global query rows (the first ones)
        gb0 = max(g, off // b)  # first non-global query block holding a query
        dev = q.device
        index, valid = index.to(dev), valid.to(dev)

        hkv = k.shape[1]
        grp = h // hkv  # query heads per K/V head
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        kw, vw = k.to(work), v.to(work)  # (B, Hkv, N, D|Dv); no copy in float32
        kpm = key_padding_mask.to(dev) if key_padding_mask is not None else None
        outs = []

        # global query blocks: dense against every key (g * block rows, so linear in N)
        if ngq > 0:
            blocked = None  # True = may not attend
            if causal:  # key j is after the query at position i + off
                blocked = torch.ones(ngq, n, dtype=torch.bool, device=dev).triu(1 + off)  # (ngq, N)
            if kpm is not None:
                pad = ~kpm[:, None, None, :]  # (B, 1, 1, N)
                blocked = pad if blocked is None else blocked | pad  # (B, 1, ngq|1, N)
            # scale q before the matmul: in low precision q k^T could overflow first; grouped query
            # heads are one longer query sequence per K/V head (read once, not copied)
            qg = (q[:, :, :ngq].to(work) * d**-0.5).reshape(bsz, hkv, grp * ngq, d)  # (B, Hkv, G*ngq, D)
            sc = (qg @ kw.transpose(-2, -1)).view(bsz, h, ngq, n)  # (B, H, ngq, N)
            p = softmax_blocked_(sc, blocked).view(bsz, hkv, grp * ngq, n)  # (B, Hkv, G*ngq, N)
            outs.append(zero_empty_rows((p @ vw).view(bsz, h, ngq, dv), blocked))  # (B, H, ngq, Dv)

        # the other query blocks: each against its own gathered key blocks
        if max(ng, off) < n:
            nr = nb - gb0  # number of non-global query blocks holding queries
            idx = index[gb0:]  # (nr, S)
            sdpa = self.impl_ran == "sdpa"
            # sdpa: native dtype, unscaled (the kernel scales); blocked: scaled, accumulated in `work`
            qx, kx, vx = (q, k, v) if sdpa else (q.to(work) * d**-0.5, kw, vw)
            # queries laid out on whole blocks gb0..nb-1: `lead` rows before the first query (they are
            # computed, then dropped) and the padding after the last
            first = gb0 * b - off  # query row at the start of block gb0 (negative: lead rows)
            lead = max(0, -first)
            qx = qx[:, :, max(0, first) :]
            if lead or n_pad > n:  # (F.pad copies even when there is nothing to pad)
                qx = F.pad(qx, (0, 0, lead, n_pad - n))  # (B, H, nr*b, D)
            qb = qx.view(bsz, h, nr, b, d)  # (B, H, nr, b, D)

            # token index of every gathered key; a slot is unusable if invalid or past the end. Keys
            # are gathered by token (clamped: a slot past the end is masked), so K and V are never
            # padded or copied whole: decoding touches only the blocks its query sees
            key_tok = (idx[:, :, None] * b + torch.arange(b, device=dev)).reshape(nr, slots * b)  # (nr, S*b)
            key_idx = key_tok.clamp_max(n - 1)  # (nr, S*b)
            bad = ~valid[gb0:].repeat_interleave(b, dim=1) | (key_tok >= n)  # (nr, S*b)
            if kpm is not None:
                bad = bad | ~kpm[:, key_idx]  # (B, nr, S*b)
            blocked = bad[..., None, :]  # (nr, 1, S*b) or (B, nr, 1, S*b)
            if causal:
                q_tok = torch.arange(gb0 * b, n_pad, device=dev).view(nr, b, 1)  # (nr, b, 1) positions
                blocked = blocked | (key_tok[:, None, :] > q_tok)  # (nr, b, S*b) or (B, nr, b, S*b)
            if blocked.dim() == 4:
                blocked = blocked[:, None]  # (B, 1, nr, b|1, S*b)
            blocked = blocked.expand(*blocked.shape[:-2], b, slots * b)  # (..., nr, b, S*b)

            if sdpa:  # every query block one "head" of the fused kernel, a chunk at a time
                # (masks.CHUNK_BYTES); its backward keeps no gathered copy (variants.gathered_sdpa)
                per_block = bsz * h * slots * b * (d + dv + b) * q.element_size()
                out = gathered_sdpa(qb, kx, vx, key_idx, blocked, per_block)
                # (B, H, nr, b, Dv)
            else:  # index_select copies whole rows; it is faster than advanced indexing here
                kg = kx.index_select(2, key_idx.reshape(-1)).view(bsz, hkv, 1, nr, slots * b, d)
                vg = vx.index_select(2, key_idx.reshape(-1)).view(bsz, hkv, 1, nr, slots * b, dv)
                # (B, Hkv, 1, nr, S*b, D|Dv); each K/V head to its G query heads (a copy when G > 1)
                kg = kg.expand(bsz, hkv, grp, nr, slots * b, d).reshape(bsz, h, nr, slots * b, d)
                vg = vg.expand(bsz, hkv, grp, nr, slots * b, dv).reshape(bsz, h, nr, slots * b, dv)
                # the scores are not kept: softmax overwrites them, only p is needed afterwards
                p = softmax_blocked_(qb @ kg.transpose(-2, -1), blocked)  # (B, H, nr, b, S*b)
                out = zero_empty_rows(p @ vg, blocked)  # (B, H, nr, b, Dv)
            out = out.reshape(bsz, h, nr * b, dv)  # (B, H, nr*b, Dv)
            outs.append(out[:, :, lead : lead + n - max(ng, off)])  # lead and padded rows dropped
        return torch.cat(outs, dim=2).to(q.dtype)  # (B, H, Nq, Dv)

    def _kernel_rows(self, nq: int, nk: int, causal: bool) -> sparse_kernel.Layout:
        """The C kernel's layout: every query block holding a query with the key blocks it sees
        (causal: none after its own).
        Cached per ``(Nq, Nk, causal)``; ``O(nb^2)`` once."""
        if (nq, nk, causal) not in self._rows:
            if len(self._rows) >= 64:  # a growing cache (prefill chunks): keep the memory bounded
                self._rows.clear()
            blocks = self.block_pattern(nk, causal)  # (nb, nb)
            if causal:
                blocks = blocks.tril()
            first = (nk - nq) // self.block  # the block of the first query
            rows = [(r, blocks[r].nonzero().flatten().tolist()) for r in range(first, blocks.shape[0])]
            self._rows[nq, nk, causal] = sparse_kernel.layout(rows, -(-nk // self.block))
        return self._rows[nq, nk, causal]

    def _flex_attend(self, q, k, v, *, causal, key_padding_mask):
        """The layout on FlexAttention's kernel. Its global query rows see every key, so in the block
        mask their one tile row walks all ``N / tile`` key tiles while every other walks a handful,
        and with few batch-heads that row sets the kernel's time. There the kernel runs in 64-wide
        tiles (:meth:`_fine_tiles`), or, where the block is not 64 or the knobs say so, the
        global rows are one dense SDPA call (``O(g block N)``) and the kernel skips them (they come
        out zero there and are replaced)."""
        nq, nk = q.shape[2], k.shape[2]
        ngq = max(0, min(self.global_blocks * self.block, nk) - (nk - nq))  # global query rows
        self.global_rows_ran = "block mask" if ngq else None
        self.flex_ran = self._flex_fine if ngq and self._fine_tiles(q, k, causal) else self._flex
        if ngq == 0 or self.flex_ran is self._flex_fine or not self._global_rows_apart(q, k, causal):
            return self.flex_ran(q, k, v, causal=causal, key_padding_mask=key_padding_mask)
        self.global_rows_ran = "dense"
        self.flex_ran = self._flex_local
        off = nk - nq
        blocked = torch.zeros(1, 1, ngq, nk, dtype=torch.bool, device=q.device)  # True = may not attend
        if causal:  # key j after the query at position i + off
            blocked = torch.ones(1, 1, ngq, nk, dtype=torch.bool, device=q.device).triu(1 + off)
        if key_padding_mask is not None:
            blocked = blocked | ~key_padding_mask.to(q.device)[:, None, None, :]  # (B, 1, ngq, Nk)
        gqa = k.shape[1] != q.shape[1]
        glob = sdpa_blocked(q[:, :, :ngq], k, v, blocked, enable_gqa=gqa)  # (B, H, ngq, Dv)
        if ngq == nq:
            return glob
        rest = self._flex_local(q, k, v, causal=causal, key_padding_mask=key_padding_mask)  # (B, H, Nq, Dv)
        return torch.cat([glob, rest[:, :, ngq:]], dim=2)  # (B, H, Nq, Dv)

    def _fine_tiles(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
        """Whether ``cuda_tile=auto`` runs the layout in 64-wide tiles, the global rows in the block
        mask: wherever the 128-wide kernel's global tile row would be its tail at all (a positive
        :meth:`_tail_excess`: few batch-heads; no dense call to pay for, unlike
        :meth:`_global_rows_apart`) and the layout's block is 64 (smaller blocks would leave the
        tiles partial; not measured), unless ``global_rows=dense``. In whole-block tiles no visited
        pair lies outside the layout and no predicate is evaluated inside a tile. On an H100 (bf16
        fwd+bwd, B=1 H=8 D=64, 2026-11-26): N=16384 (74 tiles of excess) 0.98 ms, against 2.46 at
        128 with the rows apart, 1.76 at 64 with the rows apart, dense SDPA 4.00; N=4096 (19 tiles)
        0.51 against 0.74 at 128 in the mask. B=4 H=16 D=128 N=16384 (no tail) keeps 128: 6.9x
        faster than dense SDPA there, and 64 was not timed."""
        auto = self.cuda_tile == "auto" and self.global_rows != "dense"
        return auto and self.block == FINE_TILE and self._tail_excess(q, k, causal) > 0

    def _global_rows_apart(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
        """Whether the global query rows go to a dense call beside the 128-wide kernel: where their
        tile row is its tail by at least :data:`MIN_TAIL_EXCESS_TILES` (:func:`tail_excess`). With
        the rows apart against in the block mask, on an H100 (bf16 fwd+bwd, 2026-11-26): B=1 H=8
        D=64 N=16384 2.34 against 3.17 ms, N=4096 1.39 against 0.76. In smaller tiles they stay in
        the block mask (at 64: 0.98 ms in it against 1.76 apart, N=16384). The ``global_rows`` knob
        (``dense``, ``block_mask``) overrides this rule."""
        if self.global_rows != "auto":
            return self.global_rows == "dense"
        return self._flex.cuda_tile == CUDA_TILE and self._tail_excess(q, k, causal) >= MIN_TAIL_EXCESS_TILES

    def _tail_excess(self, q: torch.Tensor, k: torch.Tensor, causal: bool) -> float:
        """By how many tiles, in 128-wide tiles, the global rows' one tile row (every key tile) would
        outlast the rest of the kernel's tiles spread over the GPU's multiprocessors
        (:func:`tail_excess`): large with few batch-heads and long sequences. On an H200, B=4 H=16
        D=128 N=16384 was 5.5x faster than dense SDPA with the rows apart against 6.9x in the block
        mask (an H100): not a tail there. ``-inf`` causal (the global rows then see only their own
        first tile) and on the CPU (no tail there). Cached per shape."""
        if causal or q.device.type != "cuda":
            return float("-inf")
        b, h, nq, _ = q.shape
        nk = k.shape[2]
        key = (b, h, nq, nk, causal, q.device)
        if key not in self._tail:
            bm = self._flex.block_mask(q, k, causal, None, None)  # the layout alone, cached by the kernel
            per_head = tiles_per_head(bm)
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            key_tiles = -(-nk // bm.BLOCK_SIZE[1])  # what the global tile row visits
            self._tail[key] = tail_excess(b * h, per_head, key_tiles, sms)
        return self._tail[key]

    def left_padding_moves_pattern(self) -> str | None:
        """Its blocks start at absolute positions, the global ones at the sequence's first key. ``O(1)``."""
        return (
            f"sparse's blocks start at absolute positions (every {self.block} tokens; the global ones are "
            "the sequence's first keys), so left padding moves them off the real tokens"
        )

    def block_pattern(self, n: int, causal: bool = False) -> torch.Tensor:
        """Boolean ``(nb, nb)``: which key blocks each query block sees (global rows included)."""
        return layout_blocks(*self.layout(n, causal), self.global_blocks)

    def pattern(self, nq: int, nk: int, causal: bool = False) -> torch.Tensor:
        """The layout of length ``Nk`` at token level; with ``Nq < Nk`` its last ``Nq`` rows."""
        # the layout is defined for self-attention; a rectangle is cut from it
        return layout_pattern(nq, nk, self.block_pattern(max(nq, nk), causal), self.block, causal)

    def num_pairs(self, nq: int, nk: int, causal: bool = False) -> int:
        if nq != nk:
            return int(self.pattern(nq, nk, causal).sum())
        return layout_pairs(nq, *self.layout(nq, causal), self.block, self.global_blocks, causal)
