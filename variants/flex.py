"""``flex``: exact attention through PyTorch FlexAttention's compiled kernel (:mod:`variants.flex_kernel`).

Every pair is computed; causal masking, key padding, ``attn_mask`` and packed ``documents`` (read as
ids, ``O(N)``) become its block mask (whole ``tile x tile`` blocks they rule out are skipped), a float
``bias`` its ``score_mod``, and grouped K/V heads go to FlexAttention's ``enable_gqa`` (no copy). Causal
masking is aligned bottom-right (key ``j`` visible to query ``i`` iff ``j <= i + Nk - Nq``, so ``Nq <=
Nk``); ``Nq > Nk`` is cross-attention, never causal. Shapes ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``,
``v (B, Hkv, Nk, Dv)`` -> ``(B, H, Nq, Dv)``. Time ``O(B H Nq Nk D)``; memory ``O(B H N D)`` compiled,
plus the block mask ``O(B H (N / tile)^2)``; uncompiled (``compile=False``) FlexAttention materialises
the scores. What the kernel refuses (float64 compiled, backward on the CPU, head sizes below 16 on CUDA)
is in :mod:`variants.flex_kernel`.

The sliding-window and block-sparse patterns through the same kernel are ``local_window impl=flex``
and ``sparse impl=flex`` (the variants that define those patterns); the ``pattern`` knob, which once
chose them here, takes only ``full`` and names the variant to use for the others.
"""

from __future__ import annotations

import torch

from .base import AttentionVariant, Unsupported, Workload
from .flex_kernel import FlexKernel, flex_refusal
from .registry import register

_LOW = frozenset({torch.float32, torch.bfloat16, torch.float16})
#: the patterns this variant used to run, and the variant that runs each now
_MOVED = {"window": "local_window impl=flex", "sparse": "sparse impl=flex"}


@register("flex")
class FlexAttention(AttentionVariant):
    """Exact attention through ``torch.nn.attention.flex_attention``, compiled."""

    exact = True
    dtypes = _LOW  # compiled CPU kernels refuse float64; see variants.flex_kernel
    # CPU: FlexAttention raises NotImplementedError when any input requires grad
    backward_devices = frozenset({"cuda"})
    compiled = True
    supports_bias = True
    supports_sinks = True  # from the log-sum-exp where flex returns it (native_sinks), else one more key
    supports_softcap = True  # in the score_mod, before the bias
    native_gqa = True
    native_scale = True
    example_knobs = ({"pattern": "full", "compile": False}, {"block": 8, "compile": False})

    def __init__(self, pattern: str = "full", block: int = 128, compile: bool = True) -> None:
        super().__init__()
        if pattern in _MOVED:
            raise ValueError(
                f"flex computes exact attention (pattern=full); for pattern={pattern} use {_MOVED[pattern]}"
            )
        if pattern != "full":
            raise ValueError(f"flex pattern must be 'full' (exact attention); got '{pattern}'")
        if block < 1:
            raise ValueError(f"block must be >= 1; got block={block}")
        self.block = block
        self.compile = compile
        self._flex = FlexKernel(None, block, compile)

    def check(self, w: Workload) -> None:
        super().check(w)
        if w.device == "cuda" and self.compile and (why := flex_refusal(w)):
            raise Unsupported(f"flex {why}")

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["tile"] = self._flex.tile_ran
        return d

    def knobs(self) -> dict[str, object]:
        return {"pattern": "full", "block": self.block, "compile": self.compile}

    def native_sinks(self, w: Workload) -> bool:
        # each row's output times its share e^lse / (e^lse + e^sink): no copy, no head size of D+1
        # (which the kernel pads to 128). Compiled on the CPU, FlexAttention returns no log-sum-exp.
        return w.device == "cuda" or not self.compile

    def native_documents(self, w: Workload) -> bool:
        return True  # the block mask's predicate reads the ids: the tiles between documents are skipped

    def _attend(
        self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None, bias=None, softcap=None,
        sinks=None, documents=None,
    ):  # fmt: skip
        call = dict(
            causal=causal,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            scale=scale,
            documents=documents,
        )
        if sinks is None:
            return self._flex(q, k, v, **call, bias=bias, softcap=softcap)  # (B, H, Nq, Dv)
        out, lse = self._flex(q, k, v, **call, bias=bias, softcap=softcap, return_lse=True)
        # (B, H, Nq, Dv), (B, H, Nq): the sink's e^sink joins the denominator for a zero value, so the
        # row's weights shrink by sigmoid(lse - sink); a row that sees no key stays 0 (sigmoid(-inf))
        share = torch.sigmoid(lse - sinks.float())  # (B, H, Nq); sinks (B|1, H, Nq|1)
        return (out.float() * share[..., None]).to(q.dtype)  # (B, H, Nq, Dv)
