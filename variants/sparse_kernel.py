"""Block-sparse attention forward on the CPU: a C kernel (``sparse_kernel.c``, built on first use,
:mod:`variants.ckernel`) that computes each query block against only its listed key blocks, with
causal, key padding, band (``local_window``) and packed-document masks at token level.

PyTorch has no block-sparse CPU kernel, so ``sparse``'s other CPU routes gather every query block's
key blocks into a copy and hand them to a dense kernel with a mask. This kernel reads K and V in
place: one task per (query block, batch, head) over all threads, each an online softmax over its key
blocks in tiles (scores held keys x queries so the softmax runs along the vector lanes). Its backward
recomputes the probabilities from the saved log-sum-exp (FlashAttention-2): dQ per query task, dK and
dV per task of keys over the query blocks that see them, so nothing is written twice.

Time ``O(B H P (D + Dv))`` for ``P`` visible pairs per head; memory ``O(threads block (D + Dv))``
besides the inputs and the output.
"""

from __future__ import annotations

import ctypes

import torch

from .base import Workload, first_order_only
from .ckernel import CKernel
from .masks import document_bounds, document_starts

MAX_DIM = 256  # head sizes it takes (MAX_DIM in the C source)
MAX_KEYS = 2**24  # sequence lengths it takes (MAX_KEYS: positions are compared as float32)


def _declare(lib: ctypes.CDLL) -> None:
    f = lib.sparse_fwd
    f.restype = ctypes.c_int
    f.argtypes = [*(ctypes.c_void_p,) * 10, *(ctypes.c_int,) * 9, ctypes.c_float, *(ctypes.c_int,) * 4]
    f = lib.sparse_bwd
    f.restype = ctypes.c_int
    f.argtypes = [
        *(ctypes.c_void_p,) * 14,
        ctypes.c_int,
        *(ctypes.c_void_p,) * 2,
        *(ctypes.c_int,) * 9,
        ctypes.c_float,
        *(ctypes.c_int,) * 4,
    ]


_KERNEL = CKernel("sparse_kernel.c", "the block-sparse kernel", _declare)


def kernel() -> ctypes.CDLL | None:
    """The built kernel (built now if needed, once per process), or None if it cannot be built."""
    return _KERNEL.load()


def build_error() -> str | None:
    """Why the kernel could not be built (after :func:`kernel` returned None), else None."""
    return _KERNEL.error


def refusal(w: Workload) -> str | None:
    """Why the kernel cannot take the call ``w`` (one line), or None. ``O(1)``."""
    if w.device != "cpu" or w.dtype != torch.float32:
        dtype = str(w.dtype).replace("torch.", "")
        return f"the block-sparse kernel takes float32 CPU tensors, not {dtype} on {w.device}"
    if w.nk > MAX_KEYS:
        return f"the block-sparse kernel takes up to {MAX_KEYS:,} keys, not {w.nk:,}"
    if max(w.head_dim, w.v_head_dim) > MAX_DIM:
        return (
            f"the block-sparse kernel takes head sizes up to {MAX_DIM}, not {max(w.head_dim, w.v_head_dim)}"
        )
    return None


def unusable(w: Workload) -> str | None:
    """Why the kernel cannot run ``w`` here: :func:`refusal`, or why it could not be built; None if it
    can. What a variant's ``auto`` asks on the CPU."""
    return _KERNEL.unusable(refusal(w))


Layout = tuple[torch.Tensor, ...]  # (qblock, rowptr, cols, kptr, qrows), int32, see layout()


def layout(rows: list[tuple[int, list[int]]], key_blocks: int) -> Layout:
    """The kernel's form of ``rows`` (``(query block, [key blocks])`` each, put heavy rows first: the
    kernel starts them first) over ``key_blocks`` key blocks: the query block of each row ``(R,)``, row
    offsets ``(R + 1,)`` and the key blocks of all rows; and for the backward the transpose, per key block the
    query blocks that see it (offsets ``(key_blocks + 1,)``, then the query blocks). Build it once per
    shape, not per call: ``O(pairs of blocks)``."""
    rows = sorted(rows, key=lambda row: -len(row[1]))
    seen_by: list[list[int]] = [[] for _ in range(key_blocks)]
    for r, cs in rows:
        for c in cs:
            seen_by[c].append(r)

    def offsets(lists) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor([len(x) for x in lists]).cumsum(0).tolist()], dtype=torch.int32)

    def flat(lists) -> torch.Tensor:
        return torch.tensor([x for xs in lists for x in xs], dtype=torch.int32)

    qblock = torch.tensor([r for r, _ in rows], dtype=torch.int32)  # (R,)
    cs = [c for _, c in rows]
    return qblock, offsets(cs), flat(cs), offsets(seen_by), flat(seen_by)


def _padding(key_padding_mask: torch.Tensor | None, b: int, nk: int) -> torch.Tensor | None:
    """The key padding mask as the kernel reads it: ``(B, Nk)`` bytes, 1 = keep."""
    return None if key_padding_mask is None else key_padding_mask.to(torch.uint8).expand(b, nk).contiguous()


def document_spans(documents: torch.Tensor | None) -> torch.Tensor | None:
    """Packed documents as the kernel reads them: for ids ``documents (B, Nk)`` (each document one
    run, :func:`variants.masks.document_starts` checks it), the first and last position of the
    document holding each position, ``(B, Nk, 2)`` int32. ``O(B Nk)``."""
    if documents is None:
        return None
    bounds = document_bounds(document_starts(documents))  # (B, Nk) x 2
    return torch.stack(bounds, -1).to(torch.int32).contiguous()  # (B, Nk, 2)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _forward(q, k, v, rows, block, causal, kpm, ds, scale, window, sinks, want_lse):
    """``(out (B, H, Nq, Dv), lse (B, H, Nq) or None)``; q, k, v contiguous float32."""
    b, h, nq = q.shape[:3]
    out = torch.empty(b, h, nq, v.shape[3])
    lse = torch.empty(b, h, nq) if want_lse else None  # base 2, of the scaled scores
    qblock, rowptr, cols = rows[:3]
    rc = kernel().sparse_fwd(
        *map(_ptr, (q, k, v, out, lse, kpm, ds, qblock, rowptr, cols)),
        len(qblock),
        *_sizes(q, k, v, block, scale, causal, window, sinks),
    )
    _check(rc)
    return out, lse


def _sizes(q, k, v, block, scale, causal, window, sinks) -> tuple:
    """The arguments both entry points end with (see the C source)."""
    b, h, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    # the C side takes ints: a window or sink count past Nk means the same as Nk, and a larger Python
    # int would wrap (a window of 2**32 read as 0, 2**31 sinks as none)
    window = -1 if window is None else min(window, nk)
    sinks = min(sinks, nk)
    return b, h, hkv, nq, nk, d, dv, block, scale, int(causal), window, sinks, torch.get_num_threads()


def _check(rc: int) -> None:
    if rc != 0:
        raise RuntimeError(f"block-sparse kernel refused sizes it was checked for (rc={rc})")


class _KernelAttention(torch.autograd.Function):
    """The kernel's forward, saving its log-sum-exp, and its backward (``sparse_bwd``)."""

    @staticmethod
    def forward(ctx, q, k, v, rows, block, causal, kpm, ds, scale, window, sinks):
        out, lse = _forward(q, k, v, rows, block, causal, kpm, ds, scale, window, sinks, want_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (rows, block, causal, kpm, ds, scale, window, sinks)
        return out

    @staticmethod
    @first_order_only  # its gradients carry no graph: a second derivative is refused, never wrong
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        rows, block, causal, kpm, ds, scale, window, sinks = ctx.args
        dout = dout.contiguous().float()
        di = (dout * out).sum(-1)  # (B, H, Nq): FlashAttention-2's D_i
        dq, dk, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        qblock, rowptr, cols, kptr, qrows = rows
        rc = kernel().sparse_bwd(
            *map(_ptr, (q, k, v, dout, lse, di, dq, dk, dv_, kpm, ds, qblock, rowptr, cols)),
            len(qblock),
            _ptr(kptr),
            _ptr(qrows),
            len(kptr) - 1,
            *_sizes(q, k, v, block, scale, causal, window, sinks),
        )
        _check(rc)
        return dq, dk, dv_, *(None,) * 8


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: Layout,
    block: int,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    scale: float,
    window: int | None = None,
    sinks: int = 0,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q (B, H, Nq, D)`` over ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` (float32,
    CPU; query head ``h`` on K/V head ``h // (H / Hkv)``; query ``i`` at position ``i + Nk - Nq``)
    where query block ``r`` (positions ``r*block ..``) sees only the key blocks listed for it in
    ``rows`` (:func:`layout`; every block holding a query must have a row), and causal masking and
    ``key_padding_mask (B, Nk)`` (True = keep) at token level; with ``window``, a query at ``p`` sees
    only keys ``j`` with ``|p - j| <= window`` besides the first ``sinks`` keys (``local_window``'s
    band); with ``documents`` (ids ``(B, Nk)``, each document one run), only keys of the query's own
    document. A query that sees no key comes out zero. Differentiable in q, k and v (the kernel's own
    backward). Returns ``(B, H, Nq, Dv)``. The caller checked :func:`refusal` and that :func:`kernel`
    is not None."""
    assert kernel() is not None, "kernel() returned None: the caller must fall back"
    kpm = _padding(key_padding_mask, q.shape[0], k.shape[2])
    args = (rows, block, causal, kpm, document_spans(documents), scale, window, sinks)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _KernelAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), *args)
    return _forward(q.contiguous(), k.contiguous(), v.contiguous(), *args, want_lse=False)[0]
