"""PyTorch FlexAttention as a kernel, and what it refuses: used by ``flex`` (exact attention) and by
``local_window`` and ``sparse`` with ``impl=flex`` (their pattern as its block mask).

FlexAttention ("FlexAttention: The Flexibility of PyTorch with the Performance of FlashAttention",
PyTorch blog, Aug 2024; Dong et al., "Flex Attention: A Programming Model for Generating Optimized
Attention Kernels", 2024) turns a predicate ``mask_mod(b, h, q_idx, kv_idx) -> bool`` into a fused
kernel through ``torch.compile``, skipping whole ``tile x tile`` blocks that the predicate rules out
(the tiles are listed once by ``create_block_mask``). :class:`FlexKernel` builds that block mask from
a pattern's predicate (:mod:`variants.patterns`: the band, or a block-sparse layout read at token
level), causal masking, key padding and ``attn_mask`` (captured tensors read by the predicate), adds
a float ``bias`` through a ``score_mod`` (a captured tensor), and hands grouped K/V heads to
FlexAttention's ``enable_gqa`` (no copy). Shapes ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``, ``v (B,
Hkv, Nk, Dv)`` -> ``(B, H, Nq, Dv)``. Time ``O(B H P D)`` for ``P`` pairs in visited tiles; memory
``O(B H N D)`` compiled, plus the block mask ``O(B H (N / tile)^2)`` (``O(B H Nq Nk)`` while it is
built, and uncompiled FlexAttention materialises the full score matrix).

Facts, checked on torch 2.13 CPU and torch 2.11 on an H100: compiled kernels refuse float64 (inductor's
CPU template); uncompiled ones also run float64, any tile and odd lengths. There is no backward on the
CPU (``NotImplementedError`` when an input requires grad). A row that sees no key comes out as zeros
(the kernel's row sum is 0 and it writes 0), compiled and not, so no fix-up pass is needed (the tests
check it). ``create_block_mask`` is slow (it evaluates the predicate on every pair), so block masks are
cached per (shape, causal, mask tensors and their in-place version). The compiled function is
``torch.compile(flex_attention, dynamic=False)``: one specialised kernel per shape, so a length sweep
recompiles (and Dynamo falls back to eager after its recompile limit unless the caller resets it). A
call with fewer queries than keys (decoding) runs :func:`_flex_on_a_cache` instead, specialised to its
first shape and generic over the lengths that change after it: a model's decoding loop, one key more
every token, compiled a kernel per token and ran eagerly past the limit (198 ms per token in the llama
store on 2026-11-29, against 8 for sdpa). The CUDA (Triton) kernel refuses head sizes below 16 ("NYI:
embedding dimension of the query, key, and value must be at least 16") and block-mask tiles narrower
than its own (up to 128, chosen per GPU; 64 is refused on an H100). So on CUDA the block mask uses
128-wide tiles unless ``block`` is a multiple of 128: full attention and the band do not depend on the
tile, and a layout of smaller blocks (``block`` dividing 128) is expressed exactly by its predicate
inside partly used tiles (fewer tiles are skipped than the layout allows; ``tile_ran`` says which ran).
Layouts of other block sizes are refused on CUDA (:func:`flex_refusal`). A kernel may ask for a smaller
CUDA tile (``cuda_tile=64``, so that every tile of a 64-block layout is a whole layout block and its
predicate is never evaluated): inductor's default Hopper configurations (forward 128 x 128 or 128 x 64,
backward 64 x 128, for head sizes 64 to 128) do not divide such a tile, so that kernel is compiled with
``max_autotune``, whose candidate configurations include 64-wide ones (a first call of tens of seconds
per shape). No forward configuration is narrower than 64.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .base import Workload
from .patterns import MaskMod, causal_mask_mod

CUDA_TILE = 128  # a block-mask tile every GPU's Triton kernel configuration divides
MIN_HEAD_DIM_CUDA = 16
_CACHE_SIZE = 8  # block masks kept per kernel: one per (shape, mask) a benchmark cycles through

#: ``(Nq, Nk, causal, device) -> MaskMod``: a variant's pattern for one call shape, causal masking
#: included, its captured tensors on ``device``
Pattern = Callable[[int, int, bool, torch.device], MaskMod]


#: the CUDA tiles a kernel may ask for: :data:`CUDA_TILE`, and 64, the smallest tile inductor's forward
#: configurations (autotuned or default) divide for head sizes up to 256
CUDA_TILES = (64, CUDA_TILE)


#: the CPU tiles compiled FlexAttention computes right (torch 2.13, against the float64 oracle): 8
#: gave NaN or errors of 2-4 at every length, and a tile past a short sequence's length (64 or 128 at
#: N=40) NaN or 2.1; 16 and 32 there, and any tile up to the length, were right
CPU_MIN_TILE = 16


def tile_size(block: int, device: str, cuda_tile: int = CUDA_TILE, n: int | None = None) -> int:
    """The block mask's tile on ``device`` along a side (queries or keys) of length ``n``: on
    the CPU ``block``, but at least :data:`CPU_MIN_TILE` and at most the largest power of two up to
    ``n`` (where the compiled kernel is right; the mask predicate keeps the pattern whatever the tile);
    on CUDA ``cuda_tile`` when it was asked below :data:`CUDA_TILE`, else :data:`CUDA_TILE` unless
    ``block`` is a multiple of it (the Triton kernel's tiles; see the module docstring)."""
    if device != "cuda":
        tile = max(CPU_MIN_TILE, block)
        return tile if n is None else min(tile, max(CPU_MIN_TILE, 1 << (n.bit_length() - 1)))
    if cuda_tile != CUDA_TILE or block % CUDA_TILE != 0:
        return cuda_tile
    return block


def flex_refusal(
    w: Workload, compiled: bool = True, layout_block: int | None = None, cuda_tile: int = CUDA_TILE
) -> str | None:
    """Why FlexAttention cannot run ``w`` (a short reason to follow the variant's name), or None if it
    can. ``layout_block``: the block size of a block-sparse layout the block mask must express, which
    the CUDA kernel takes only when it divides ``cuda_tile`` or is a multiple of it."""
    if compiled and w.dtype == torch.float64:
        return "does not support float64 (compiled kernels)"
    if w.backward and w.device == "cpu":
        return "has no backward on the CPU (FlexAttention)"
    if compiled and w.device == "cuda" and min(w.head_dim, w.v_head_dim) < MIN_HEAD_DIM_CUDA:
        return (
            f"needs head sizes of at least {MIN_HEAD_DIM_CUDA} on CUDA (the Triton kernel); "
            f"got D={w.head_dim}, Dv={w.v_head_dim}"
        )
    fits = layout_block is None or cuda_tile % layout_block == 0 or layout_block % cuda_tile == 0
    if compiled and w.device == "cuda" and not fits:
        return (
            f"on CUDA needs block to divide {cuda_tile} or be a multiple of it (the Triton kernel's "
            f"tiles); got block={layout_block}"
        )
    return None


def tiles_per_head(bm: Any) -> float:
    """The tiles a ``BlockMask`` visits, partial and full, per (batch, head) it holds. ``O(tiles)``
    on the mask's device, one host read."""
    tiles = bm.kv_num_blocks.sum() + (bm.full_kv_num_blocks.sum() if bm.full_kv_num_blocks is not None else 0)
    return int(tiles) / (bm.kv_num_blocks.shape[0] * bm.kv_num_blocks.shape[1])


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _whole_tiles(nqb: int, nkb: int, tiles: tuple[int, int], device: torch.device) -> Any:
    """A ``BlockMask`` of ``nqb x nkb`` whole ``(query, key)`` ``tiles`` (no predicate to evaluate),
    for sequences that fill them. Built from the tile counts, ``O(nqb nkb)``, but 1.6 ms on this
    project's VM (``BlockMask.from_kv_blocks`` derives the query-side lists with a handful of small
    ops), so it is kept: a decoding loop, one key more per token, meets the same counts for a tile's
    worth of tokens. Its tensors are never written to."""
    from torch.nn.attention.flex_attention import BlockMask

    whole = torch.full((1, 1, nqb), nkb, dtype=torch.int32, device=device)  # (1, 1, query tiles)
    # (1, 1, query tiles, key tiles): every key tile, in order, for each query tile
    order = torch.arange(nkb, dtype=torch.int32, device=device).expand(1, 1, nqb, nkb).contiguous()
    none = torch.zeros_like(whole)  # no partly masked tile
    return BlockMask.from_kv_blocks(
        none,
        torch.zeros_like(order),
        whole,
        order,
        BLOCK_SIZE=tiles,
        seq_lengths=(nqb * tiles[0], nkb * tiles[1]),
    )


def _every_pair(nq: int, nk: int, tiles: tuple[int, int], device: torch.device) -> Any:
    """A ``BlockMask`` of ``(query, key)`` ``tiles`` in which every tile is whole: every pair of
    ``Nq`` queries and ``Nk`` keys (the kernel stops at the sequences' lengths inside the last
    tiles). :func:`_whole_tiles`' mask, shallow-copied to these lengths: ``O(1)`` once built."""
    bm = copy.copy(_whole_tiles(-(-nq // tiles[0]), -(-nk // tiles[1]), tiles, device))
    bm.seq_lengths = (nq, nk)
    return bm


def _flex_on_a_cache(*args: Any, **kwargs: Any) -> Any:
    """``flex_attention`` for the calls with fewer queries than keys (decoding, a prefill onto a
    cache), under a code object of its own, compiled with Dynamo's automatic dynamic shapes: its first
    shape gets a kernel specialised to it, as every other call does (a decode benchmark, one shape,
    times that kernel), and a second shape one kernel for whatever lengths changed, so a decoding loop
    compiles twice, not once per token. Its own code object keeps these kernels and their recompile
    limit apart from the static ones of :class:`FlexKernel`'s other calls, whose shapes stay
    specialised (a length sweep in one process times each length's own kernel)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(*args, **kwargs)


class FlexKernel:
    """FlexAttention with one fixed pattern, for one variant instance: its compiled function and its
    block masks, cached (a plain object, not a module: it holds no state to save).

    ``pattern`` is the variant's pattern (:data:`Pattern`), or None for every pair (causal: every
    pair with ``j <= i + Nk - Nq``); ``block`` is the layout's block, from which the block mask's tile
    follows (:func:`tile_size`, with ``cuda_tile``, one of :data:`CUDA_TILES`, on CUDA); ``compile``
    False runs FlexAttention eagerly (any dtype; materialises the scores).
    """

    def __init__(
        self, pattern: Pattern | None, block: int, compile: bool = True, cuda_tile: int = CUDA_TILE
    ) -> None:
        if cuda_tile not in CUDA_TILES:
            raise ValueError(f"cuda_tile must be one of {', '.join(map(str, CUDA_TILES))}; got {cuda_tile}")
        self.pattern = pattern
        self.block = block
        self.compile = compile
        self.cuda_tile = cuda_tile
        # the block mask's key tile of the last call (None: no mask); its query tile is the same, or
        # smaller where the queries are fewer (tiles())
        self.tile_ran: int | None = None
        # compiled (or plain) flex_attention, keyed by whether inductor autotunes it (autotune_for) and
        # whether the call has fewer queries than keys (_flex_on_a_cache)
        self._fns: dict[tuple[bool, bool], Callable[..., torch.Tensor]] = {}
        self._masks: OrderedDict[tuple, tuple[Any, tuple]] = OrderedDict()

    def block_mask(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        causal: bool,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        documents: torch.Tensor | None = None,
    ) -> Any:
        """A ``BlockMask`` for a call on ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)`` and these masks (and
        packed ``documents``, ids ``(B, Nk)``: a query sees its own document's keys only), or None where
        every pair is visible (no pattern or mask, and not causal or one query: a decoding step;
        compiled on the CPU, whole tiles of this kernel's own size instead, :func:`_every_pair`, built
        from tile counts in ``O(Nk / tile)``); cached per mask tensor, so a model that hands every layer
        the same tensors builds it once. Building any other evaluates the predicate on every pair:
        ``O(B H Nq Nk)`` (``B`` and ``H`` only where a mask varies over them)."""
        from torch.nn.attention.flex_attention import create_block_mask

        b, h, nq, _ = q.shape
        nk = k.shape[2]
        # every pair is visible: no pattern or mask, and not causal or a single query (a decoding
        # step's one query is the last position, so causality hides none of its keys)
        every_pair = (
            self.pattern is None
            and (not causal or nq == 1)
            and key_padding_mask is None
            and attn_mask is None
            and documents is None
        )
        if every_pair:
            # compiled on the CPU, FlexAttention's own mask for every pair (128-wide tiles) gave wrong
            # outputs at head size 16 (one query on 72 keys: error 0.37; 72 on 72: NaN); ours is right.
            # Not kept below: _every_pair is O(1) from its own cache, and a decoding loop's new length
            # every step would push the masks that are costly to build out of this kernel's cache
            if not (self.compile and q.device.type == "cpu"):
                return None
            return _every_pair(nq, nk, self.tiles(q, k), q.device)
        # the tensors themselves are held in the entry, so their ids cannot be reused while cached;
        # _version changes on any in-place edit, which would make the block list stale
        slots = (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask), ("documents", documents))
        tensors = tuple(t for _, t in slots if t is not None)
        # tensors made under torch.inference_mode have no _version (reading it raises), so an in-place
        # edit could not be seen: their block masks are built afresh every call, never cached
        cacheable = not any(t.is_inference() for t in tensors)
        key = None
        if cacheable:
            # each tensor under its slot: the same tensor as padding and as documents is two masks
            key = (nq, nk, b, h, causal, q.device)
            key += tuple((slot, id(t), t._version, tuple(t.shape)) for slot, t in slots if t is not None)
        hit = self._masks.get(key) if cacheable else None
        if hit is not None:
            self._masks.move_to_end(key)
            return hit[0]

        preds: list[Callable] = []
        if self.pattern is not None:
            pattern = self.pattern(nq, nk, causal, q.device)  # causal included
            preds.append(lambda bi, hi, qi, ki: pattern(qi, ki))
        elif causal:
            past = causal_mask_mod(nq, nk)
            preds.append(lambda bi, hi, qi, ki: past(qi, ki))
        mb = mh = None  # None = the block mask broadcasts over batch / heads
        if key_padding_mask is not None:
            kpm = key_padding_mask.to(q.device)  # (B, Nk), captured by the predicate
            preds.append(lambda bi, hi, qi, ki: kpm[bi, ki])
            mb = b
        if attn_mask is not None:
            am = attn_mask.to(q.device)
            while am.dim() < 4:
                am = am.unsqueeze(0)  # (B|1, H|1, Nq|1, Nk)
            am = am.expand(b, h, nq, nk)  # a view: the predicate indexes it directly
            preds.append(lambda bi, hi, qi, ki: am[bi, hi, qi, ki])
            if attn_mask.dim() == 4 and attn_mask.shape[0] > 1:
                mb = b
            if attn_mask.dim() >= 3 and attn_mask.shape[-3] > 1:
                mh = h
        if documents is not None:
            ids, off = documents.to(q.device), nk - nq  # (B, Nk); the queries are the last Nq positions
            preds.append(lambda bi, hi, qi, ki: ids[bi, qi + off] == ids[bi, ki])
            mb = b

        def mask_mod(bi: torch.Tensor, hi: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
            ok = preds[0](bi, hi, qi, ki)
            for p in preds[1:]:
                ok = ok & p(bi, hi, qi, ki)
            return ok

        bm = create_block_mask(mask_mod, mb, mh, nq, nk, device=q.device, BLOCK_SIZE=self.tiles(q, k))
        if cacheable:
            self._masks[key] = (bm, tensors)
        if len(self._masks) > _CACHE_SIZE:
            self._masks.popitem(last=False)
        return bm

    def tiles(self, q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
        """The block mask's (query, key) tiles for a call on ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``:
        :func:`tile_size` of each side's own length. Apart, because a key tile past the keys is what
        compiled flex gets wrong on the CPU (tiles (32, 128) at Nq = Nk = 40: error 0.55; (128, 32):
        right), and a decoding call's one query must not shrink its key tile: at Nq = 1, Nk = 65536
        (32 query heads on 4, D = 128, 2 threads on this project's VM) tiles (16, 16) took 309 ms,
        (16, 128) 131 ms."""
        dev = q.device.type
        return tile_size(self.block, dev, self.cuda_tile, q.shape[2]), tile_size(
            self.block, dev, self.cuda_tile, k.shape[2]
        )

    def autotune_for(self, device: str) -> bool:
        """Whether the compiled kernel on ``device`` is autotuned: on CUDA with a tile below
        :data:`CUDA_TILE`, which inductor's default configurations do not divide (module docstring)."""
        return self.compile and device == "cuda" and tile_size(self.block, device, self.cuda_tile) < CUDA_TILE

    def _flex_fn(self, device: str, on_cache: bool) -> Callable[..., torch.Tensor]:
        """flex_attention as this kernel runs it on ``device``: compiled (unless ``compile=False``),
        autotuned where :meth:`autotune_for` says, and for a call ``on_cache`` (fewer queries than
        keys) through :func:`_flex_on_a_cache`, whose shapes may change from call to call."""
        key = (self.autotune_for(device), on_cache)
        if key not in self._fns:
            from torch.nn.attention.flex_attention import flex_attention

            # held once per kernel: compiling per call would recompile every time
            fn = flex_attention
            if self.compile:
                options = {"max_autotune": True} if key[0] else None
                if on_cache:  # dynamic=None: Dynamo's automatic dynamic shapes
                    fn = torch.compile(_flex_on_a_cache, dynamic=None, options=options)
                else:
                    fn = torch.compile(flex_attention, dynamic=False, options=options)
            self._fns[key] = fn
        return self._fns[key]

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
        bias: torch.Tensor | None = None,
        softcap: float | None = None,
        return_lse: bool = False,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``q (B, H, Nq, D)`` over ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` through the
        pattern, causal masking and the masks (boolean, True = may attend; ``key_padding_mask (B,
        Nk)``, ``attn_mask`` broadcastable to ``(B, H, Nq, Nk)``), scores scaled by ``scale`` (default
        ``1/sqrt(D)``), soft-capped to ``softcap tanh(s / softcap)`` when given, plus ``bias``
        (broadcastable to ``(B, H, Nq, Nk)``), and packed ``documents`` (ids ``(B, Nk)``, read by the
        block mask's predicate: no ``Nq x Nk`` mask): ``(B, H, Nq, Dv)``; with ``return_lse`` also each row's
        log-sum-exp ``(B, H, Nq)`` float32, natural log, -inf for a row that sees no key, through which
        gradients flow (flex's sinks weigh the output by it). The caller checks the
        workload first (:func:`flex_refusal`)."""
        if not torch.is_grad_enabled():  # FlexAttention refuses a CPU input that requires grad even
            # then (a model's learned query, run under no_grad): no graph is built, so detach
            q, k, v = q.detach(), k.detach(), v.detach()
            bias = None if bias is None else bias.detach()
        bm = self.block_mask(q, k, causal, key_padding_mask, attn_mask, documents)
        self.tile_ran = self.tiles(q, k)[1] if bm is not None else None
        extra: dict[str, Any] = {"scale": scale}
        if k.shape[1] != q.shape[1]:
            extra["enable_gqa"] = True  # query head h reads K/V head h // (H / Hkv)
        if bias is not None or softcap is not None:
            bias4 = None
            if bias is not None:
                bias4 = bias[(None,) * (4 - bias.dim())].expand(
                    q.shape[0], q.shape[1], q.shape[2], k.shape[2]
                )

            def score_mod(score, bi, hi, qi, ki):  # noqa: ANN001, ANN202  (FlexAttention's signature)
                if softcap is not None:  # after the scale, before the bias (Gemma2's order)
                    score = softcap * torch.tanh(score / softcap)
                return score if bias4 is None else score + bias4[bi, hi, qi, ki]

            extra["score_mod"] = score_mod
        flex = self._flex_fn(q.device.type, on_cache=q.shape[2] < k.shape[2])
        with warnings.catch_warnings():
            # uncompiled use is a deliberate choice here (compile=False), not a mistake to warn about
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            if not return_lse:
                return flex(q, k, v, block_mask=bm, **extra)  # (B, H, Nq, Dv)
            try:  # torch >= 2.9 asks for the log-sum-exp this way (return_lse is deprecated there)
                from torch.nn.attention.flex_attention import AuxRequest
            except ImportError:
                return flex(q, k, v, block_mask=bm, return_lse=True, **extra)
            out, aux = flex(q, k, v, block_mask=bm, return_aux=AuxRequest(lse=True), **extra)
            return out, aux.lse  # (B, H, Nq, Dv), (B, H, Nq)
