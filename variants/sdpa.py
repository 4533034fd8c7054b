"""``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with a pinned backend.

``backend='auto'`` lets PyTorch choose; any other value pins one backend with
``torch.nn.attention.sdpa_kernel`` and a backend that cannot run is :class:`Unsupported`, never a
silent fallback. After a call, :attr:`SDPAAttention.backend_ran` names the kernel that actually ran.
Grouped K/V heads: with no mask and no bias the query heads of a group are folded into one longer
query sequence, ``(B, Hkv, G * Nq, D)`` against ``(B, Hkv, Nk, D)`` (a view; at decode shapes this is a
third faster on the CPU than ``enable_gqa``); otherwise ``enable_gqa=True``. Neither copies K or V.
Causal with ``Nq < Nk`` (bottom-right) becomes an explicit mask, except for ``Nq = 1`` (no mask).
Packed documents on the CPU: one fused call per document, its queries against its own keys (as
FlashAttention's variable-length kernels do in one launch), so the pairs between documents are never
computed; elsewhere, or with a mask, window, bias or sinks beside them, their dense mask.
Time ``O(B H Nq Nk D)``; memory ``O(B H Nq Nk)`` for math, ``O(B H N D)`` for the fused kernels.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from .base import AttentionVariant, Unsupported, Workload, sinks_as_first_key
from .masks import attend_each_document, combined_mask, empty_rows
from .registry import register

BACKENDS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}

# aten op name -> backend it belongs to, for reporting what ran under 'auto'
_KERNEL_OPS = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


class _KernelSpy(TorchDispatchMode):
    """Records which fused SDPA kernel (if any) the dispatcher ran."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in _KERNEL_OPS and self.seen is None:
            self.seen = _KERNEL_OPS[name]
        return func(*args, **(kwargs or {}))


@register("sdpa")
class SDPAAttention(AttentionVariant):
    """PyTorch's fused attention entry point; ``backend`` in auto, math, flash, efficient, cudnn."""

    supports_bias = True
    supports_sinks = True  # one more key in front, kept on the fused kernel (_attend_with_sinks)
    bias_backward = True
    native_gqa = True
    native_scale = True

    def __init__(self, backend: str = "auto") -> None:
        super().__init__()
        if backend != "auto" and backend not in BACKENDS:
            raise ValueError(f"sdpa backend must be one of auto, {', '.join(BACKENDS)}; got '{backend}'")
        self.backend = backend
        self.backend_ran: str | None = None
        self._seen: dict[tuple, str] = {}  # kind of call -> the kernel that ran for it

    def knobs(self) -> dict[str, object]:
        return {"backend": self.backend}

    def check(self, w: Workload) -> None:
        super().check(w)
        b = self.backend
        if b in ("flash", "efficient", "cudnn") and w.device == "cpu":
            # on the CPU only 'flash' exists (a fused CPU kernel); the others are CUDA-only
            if b != "flash":
                raise Unsupported(f"sdpa backend '{b}' is CUDA-only; device is cpu")
        if b == "flash" and (w.key_padding or w.attn_mask or w.bias or (w.causal and 1 < w.nq < w.nk)):
            raise Unsupported(
                "sdpa backend 'flash' does not take a mask or bias (only top-left causal with Nq == Nk)"
            )
        if b == "flash" and w.device == "cuda" and w.dtype not in (torch.float16, torch.bfloat16):
            raise Unsupported("sdpa backend 'flash' on CUDA needs fp16 or bf16")
        if b == "flash" and w.head_dim != w.v_head_dim:
            raise Unsupported("sdpa backend 'flash' needs equal q/k and v head sizes")
        if b == "cudnn" and w.dtype not in (torch.float16, torch.bfloat16):
            raise Unsupported("sdpa backend 'cudnn' needs fp16 or bf16")
        if b == "efficient" and w.dtype == torch.float64:
            raise Unsupported("sdpa backend 'efficient' does not support float64")

    def native_sinks(self, w: Workload) -> bool:
        return True  # _attend_with_sinks: one more key, but shaped for the fused kernels

    def native_documents(self, w: Workload) -> bool:
        # one call per document reads the boundaries on the host: on the CPU only (on a device it would
        # wait for the stream every call); a mask (a window arrives as one), bias or sinks beside them
        # would need slicing too
        return w.device == "cpu" and not (w.attn_mask or w.bias or w.sinks)

    def _attend_documents(self, q, k, v, documents, *, causal, key_padding_mask, scale):
        """Each packed document's queries against its own keys, one fused call each: ``documents (B,
        Nk)`` ids, each document a contiguous run; the queries are the last ``Nq`` positions, so a
        document's queries are its positions among them (causal: bottom-right within the document).
        ``(B, H, Nq, Dv)``; time ``O(H D sum(n_q n_k))`` over the documents, plus a call per document."""

        def alone(qd, kd, vd, kpm):  # one document: a fused call with no mask but its padding
            return self._attend(qd, kd, vd, causal=causal, key_padding_mask=kpm, attn_mask=None, scale=scale)

        return attend_each_document(alone, q, k, v, documents, key_padding_mask)

    def _attend_with_sinks(self, q, k, v, sinks, *, causal, key_padding_mask, attn_mask, scale, bias):
        """``sinks (B|1, H, Nq|1)`` as one more key in front (``sinks_as_first_key``), shaped so that
        the fused kernels still take the call: v gets the extra feature too (equal head sizes; with
        ``D+1`` against ``Dv`` PyTorch runs the math kernel, ``O(Nq Nk)`` memory and 3x the time on a
        CPU), and causal self-attention one more query in front (``Nq+1 == Nk+1``: plain causal, not
        an explicit mask). Returns ``(B, H, Nq, Dv)``, a view of the larger output."""
        dv = v.shape[-1]
        row = causal and q.shape[2] == k.shape[2]
        q, k, v, call = sinks_as_first_key(
            q, k, v, sinks, scale=scale, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
            bias=bias, equal_dims=dv == q.shape[-1], query_row=row,
        )  # fmt: skip
        out = self._attend(q, k, v, causal=causal, **call)  # (B, H, row + Nq, Dv(+1))
        return out[:, :, int(row) :, :dv]

    def _attend(
        self,
        q,
        k,
        v,
        *,
        causal,
        key_padding_mask,
        attn_mask,
        scale=None,
        bias=None,
        sinks=None,
        documents=None,
    ):
        if documents is not None:
            return self._attend_documents(
                q, k, v, documents, causal=causal, key_padding_mask=key_padding_mask, scale=scale
            )
        if sinks is not None:
            return self._attend_with_sinks(
                q, k, v, sinks, causal=causal, key_padding_mask=key_padding_mask,
                attn_mask=attn_mask, scale=scale, bias=bias,
            )  # fmt: skip
        b, h, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        if causal and nq == 1:
            causal = False  # the last position sees every key
        mask = None
        # a bias becomes the float mask, which SDPA takes only without is_causal: causality joins it
        if (
            key_padding_mask is not None
            or attn_mask is not None
            or (causal and (nq != nk or bias is not None))
        ):
            mask = combined_mask(
                b,
                nq,
                nk,
                causal=causal,
                key_padding_mask=key_padding_mask,
                attn_mask=attn_mask,
                device=q.device,
            )  # (B|1, H|1, Nq, Nk)
        empty = empty_rows(mask)
        if empty is not None:
            # SDPA returns NaN on rows that see no key: let them see key 0, then zero them out,
            # which also zeroes their gradient (DESIGN: empty rows give zeros, never NaN).
            first = torch.zeros_like(mask)
            first[..., 0] = True
            mask = mask | (empty & first)
        use_causal = causal and mask is None
        if bias is not None:  # one float mask: the bias where allowed, -inf elsewhere
            # SDPA takes a mask of 2+ dimensions: a (Nk,) bias raised deep in torch (the base class
            # hands it over in the queries' dtype: SDPA's CPU flash kernel misread a float32 mask
            # beside float64 queries, 1.07 off)
            bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))  # (.., Nq|1, Nk|1)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        fold = hkv != h and mask is None and not use_causal
        if fold:  # (B, H, Nq, D) -> (B, Hkv, G * Nq, D): each group's queries against its K/V head
            q = q.reshape(b, hkv, (h // hkv) * nq, d)
        gqa = {"enable_gqa": True} if hkv != h and not fold else {}
        if scale is not None:
            gqa["scale"] = scale
        # which kernel ran is found once per kind of call, under a dispatch mode that costs about
        # 0.1 ms a call: never inside the calls a benchmark times
        # sequence lengths are left out of the kind: decoding grows Nk by one every call
        key = (
            *((t.shape[:2], t.shape[3]) for t in (q, k, v)),
            q.dtype,
            q.device,
            use_causal,
            None if mask is None else (mask.dim(), mask.shape[:2], mask.dtype),
            bool(gqa.get("enable_gqa")),
            torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        )
        spy = _KernelSpy() if key not in self._seen else None
        try:
            with self._backend_context():
                if spy is not None:
                    with spy:
                        out = F.scaled_dot_product_attention(
                            q, k, v, attn_mask=mask, is_causal=use_causal, **gqa
                        )
                else:
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=use_causal, **gqa)
        except RuntimeError as exc:
            if self.backend != "auto" and "No available kernel" in str(exc):
                raise Unsupported(
                    f"sdpa backend '{self.backend}' cannot run this input: {str(exc).splitlines()[0]}"
                ) from None
            raise
        if spy is not None:
            self._seen[key] = spy.seen or "math"
        self.backend_ran = self._seen[key]
        if fold:
            out = out.reshape(b, h, nq, v.shape[-1])  # (B, Hkv, G * Nq, Dv) -> (B, H, Nq, Dv)
        if empty is not None:
            out = out.masked_fill(empty, 0.0)
        return out

    def _backend_context(self):
        if self.backend == "auto":
            # PyTorch's own choice: no context (entering sdpa_kernel costs about 34 us a call, a third of
            # a decoding step's attention in a small model)
            return contextlib.nullcontext()
        return sdpa_kernel(BACKENDS[self.backend])

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["backend_ran"] = self.backend_ran
        return d
