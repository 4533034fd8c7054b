"""``flex``: PyTorch FlexAttention, with attention patterns written as ``mask_mod`` predicates.

FlexAttention ("FlexAttention: The Flexibility of PyTorch with the Performance of FlashAttention",
PyTorch blog, Aug 2024; Dong et al., "Flex Attention: A Programming Model for Generating Optimized
Attention Kernels", 2024) turns a predicate ``mask_mod(b, h, q_idx, kv_idx) -> bool`` into a fused
kernel through ``torch.compile``, skipping whole ``block x block`` tiles that the predicate rules out
(the tiles are listed once by ``create_block_mask``).

Patterns (``pattern`` knob; True = may attend, call-time masks come on top):

- ``full``: every pair.
- ``window``: ``|i - j| <= window`` (a radius, as in DESIGN.md).
- ``sparse``: the BigBird block layout of ``variants/sparse.py`` (``BlockSparseAttention(block=block)``
  with that module's defaults: one window block each side, one global block, one random block,
  seed 0), so ``flex`` with ``pattern=sparse`` and ``sparse`` with the same ``block`` compute the same
  pairs.

With ``Nq < Nk`` the queries are the last ``Nq`` positions (query ``i`` is position ``i + Nk - Nq``),
for the patterns and for ``causal``, which adds ``j <= position``; with ``Nq > Nk`` (cross-attention)
query ``i`` is position ``i``. Key padding and ``attn_mask`` are captured tensors read by the
predicate; a float ``bias`` is a captured tensor read by a ``score_mod``. Grouped K/V heads go to
FlexAttention's ``enable_gqa`` (no copy).
Shapes ``q (B, H, Nq, D)``, ``k (B, H, Nk, D)``, ``v (B, H, Nk, Dv)`` -> ``(B, H, Nq, Dv)``; no layout
change is needed. Time ``O(B H P D)`` for ``P`` pairs in visited tiles; memory ``O(B H N D)`` compiled,
plus the block mask ``O(B H (N / block)^2)`` (``O(B H Nq Nk)`` while it is built, and uncompiled
FlexAttention materialises the full score matrix).

Facts checked on torch 2.13 CPU: compiled forward works in fp32/bf16/fp16 and refuses float64
(inductor's CPU template); uncompiled also runs float64, any block size and odd lengths. Backward
raises ``NotImplementedError`` on CPU. A row that sees no key comes out as zeros (the kernel's
row sum is 0 and it writes 0), compiled and not, so no fix-up pass is needed (tests check it).
``create_block_mask`` is slow (it evaluates the predicate on every pair), so block masks are cached
per (shape, causal, mask tensors and their in-place version). The compiled function is
``torch.compile(flex_attention, dynamic=False)``: one specialised kernel per shape, so a length sweep
recompiles (and Dynamo falls back to eager after its recompile limit unless the caller resets it).
On CUDA the Triton kernels need the block mask's tiles to be a multiple of their own tile (up to
128, chosen per GPU; a 64 block is refused on an H100). So on CUDA the block mask uses 128-wide tiles
unless ``block`` is a multiple of 128: the window and full patterns do not depend on the tile, and a
sparse layout of smaller blocks (``block`` dividing 128) is expressed exactly by its predicate inside
partly used tiles (fewer tiles are skipped than the layout allows; the record's ``tile`` says which
ran). Other sparse block sizes are :class:`Unsupported` on CUDA.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .base import AttentionVariant, Unsupported, Workload
from .flex_limits import CUDA_TILE, fits_cuda_tile, flex_refusal
from .local_window import band_pairs
from .registry import register
from .sparse import BlockSparseAttention

PATTERNS = ("full", "window", "sparse")
_LOW = frozenset({torch.float32, torch.bfloat16, torch.float16})
_CACHE_SIZE = 8  # block masks kept per module: one per (shape, mask) a benchmark cycles through


@register("flex")
class FlexAttention(AttentionVariant):
    """``torch.nn.attention.flex_attention`` with a full, sliding-window or block-sparse pattern."""

    # full attention for pattern='full'; window and sparse approximate it (set per instance below)
    exact = True
    dtypes = _LOW  # compiled CPU kernels refuse float64; see the module docstring
    # CPU: FlexAttention raises NotImplementedError when any input requires grad
    backward_devices = frozenset({"cuda"})
    compiled = True
    supports_bias = True
    native_gqa = True
    native_scale = True
    example_knobs = (
        {"pattern": "full", "compile": False},
        {"pattern": "window", "window": 3, "block": 8, "compile": False},
        {"pattern": "sparse", "block": 4, "compile": False},
    )

    def __init__(
        self, pattern: str = "full", window: int = 128, block: int = 128, compile: bool = True
    ) -> None:
        super().__init__()
        if pattern not in PATTERNS:
            raise ValueError(f"flex pattern must be one of {', '.join(PATTERNS)}; got '{pattern}'")
        if window < 0 or block < 1:
            raise ValueError(f"window must be >= 0 and block >= 1; got window={window}, block={block}")
        self.pattern_name = pattern
        self.exact = pattern == "full"  # the knob decides; records and accuracy read the instance
        self.window = window
        self.block = block
        self.compile = compile
        self.tile_ran: int | None = None  # the block mask's tile size of the last call
        self._flex: Callable[..., torch.Tensor] | None = None  # compiled (or plain) flex_attention
        self._masks: OrderedDict[tuple, tuple[Any, tuple]] = OrderedDict()
        # the sparse pattern's layout comes from the 'sparse' variant itself (one definition);
        # a plain attribute, not a submodule, so it stays out of this module's state
        self.__dict__["_sparse"] = BlockSparseAttention(block=block) if pattern == "sparse" else None

    def tile(self, device: str) -> int:
        """The block mask's tile size on ``device`` (see the module docstring)."""
        if device != "cuda" or self.block % CUDA_TILE == 0:
            return self.block
        return CUDA_TILE

    def check(self, w: Workload) -> None:
        super().check(w)
        if w.device == "cuda" and self.compile and (why := flex_refusal(w)):
            raise Unsupported(f"flex {why}")
        if w.device == "cuda" and self.pattern_name == "sparse" and not fits_cuda_tile(self.block):
            raise Unsupported(
                f"flex pattern=sparse on CUDA needs block to divide {CUDA_TILE} or be a multiple of it "
                f"(the Triton kernel's tiles); got block={self.block}"
            )

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["tile"] = self.tile_ran
        return d

    def knobs(self) -> dict[str, object]:
        return {
            "pattern": self.pattern_name,
            "window": self.window,
            "block": self.block,
            "compile": self.compile,
        }

    # ------------------------------------------------------------------ the pattern
    def pattern(self, nq: int, nk: int, causal: bool = False) -> torch.Tensor:
        if self.pattern_name == "sparse":
            return self._sparse.pattern(nq, nk, causal)
        i = torch.arange(nq)[:, None] + max(0, nk - nq)  # (Nq, 1): positions of the queries
        j = torch.arange(nk)[None, :]  # (1, Nk)
        allowed = torch.ones(nq, nk, dtype=torch.bool)
        if self.pattern_name == "window":
            allowed = (i - j).abs() <= self.window
        return allowed & (j <= i) if causal else allowed

    def num_pairs(self, nq: int, nk: int, causal: bool = False) -> int:
        if self.pattern_name == "full":
            return super().num_pairs(nq, nk, causal)
        if self.pattern_name == "window":
            return band_pairs(nq, nk, self.window, causal)
        return self._sparse.num_pairs(nq, nk, causal)

    # ------------------------------------------------------------------ block masks
    def _block_mask(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        causal: bool,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> Any:
        """A ``BlockMask`` for this call, or None for full attention with no mask; cached."""
        from torch.nn.attention.flex_attention import create_block_mask

        b, h, nq, _ = q.shape
        nk = k.shape[2]
        if self.pattern_name == "full" and not causal and key_padding_mask is None and attn_mask is None:
            return None
        # the tensors themselves are held in the entry, so their ids cannot be reused while cached;
        # _version changes on any in-place edit, which would make the block list stale
        tensors = tuple(t for t in (key_padding_mask, attn_mask) if t is not None)
        # tensors made under torch.inference_mode have no _version (reading it raises), so an in-place
        # edit could not be seen: their block masks are built afresh every call, never cached
        cacheable = not any(t.is_inference() for t in tensors)
        key = None
        if cacheable:
            key = (nq, nk, b, h, causal, q.device, *((id(t), t._version, tuple(t.shape)) for t in tensors))
        hit = self._masks.get(key) if cacheable else None
        if hit is not None:
            self._masks.move_to_end(key)
            return hit[0]

        preds: list[Callable] = []
        off = max(0, nk - nq)  # query qi is position qi + off
        if self.pattern_name == "window":
            w = self.window
            preds.append(lambda bi, hi, qi, ki: (qi + off - ki).abs() <= w)
        elif self.pattern_name == "sparse":
            blk = self.block
            # (nb, nb) over the longer sequence (causal: random blocks drawn from the past)
            lay = self._sparse.block_pattern(max(nq, nk), causal).to(q.device)
            preds.append(lambda bi, hi, qi, ki: lay[(qi + off) // blk, ki // blk])
        if causal:
            preds.append(lambda bi, hi, qi, ki: ki <= qi + off)
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

        def mask_mod(bi: torch.Tensor, hi: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
            ok = preds[0](bi, hi, qi, ki)
            for p in preds[1:]:
                ok = ok & p(bi, hi, qi, ki)
            return ok

        bm = create_block_mask(mask_mod, mb, mh, nq, nk, device=q.device, BLOCK_SIZE=self.tile(q.device.type))
        if cacheable:
            self._masks[key] = (bm, tensors)
        if len(self._masks) > _CACHE_SIZE:
            self._masks.popitem(last=False)
        return bm

    # ------------------------------------------------------------------ the computation
    def _flex_fn(self) -> Callable[..., torch.Tensor]:
        if self._flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            # held once per module: compiling per call would recompile every time
            self._flex = torch.compile(flex_attention, dynamic=False) if self.compile else flex_attention
        return self._flex

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None, bias=None):
        bm = self._block_mask(q, k, causal, key_padding_mask, attn_mask)
        self.tile_ran = self.tile(q.device.type) if bm is not None else None
        extra: dict[str, Any] = {"scale": scale}
        if k.shape[1] != q.shape[1]:
            extra["enable_gqa"] = True  # query head h reads K/V head h // (H / Hkv)
        if bias is not None:
            bias4 = bias[(None,) * (4 - bias.dim())].expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])

            def add_bias(score, bi, hi, qi, ki):  # noqa: ANN001, ANN202  (FlexAttention's signature)
                return score + bias4[bi, hi, qi, ki]

            extra["score_mod"] = add_bias
        with warnings.catch_warnings():
            # uncompiled use is a deliberate choice here (compile=False), not a mistake to warn about
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = self._flex_fn()(q, k, v, block_mask=bm, **extra)  # (B, H, Nq, Dv)
        return out
