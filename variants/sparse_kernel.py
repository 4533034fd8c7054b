"""Block-sparse attention forward on the CPU: a C kernel (``sparse_kernel.c``, built on first use,
:mod:`variants.ckernel`) that computes each query block against only its listed key blocks, with
causal, key padding and band (``local_window``) masks at token level.

PyTorch has no block-sparse CPU kernel, so ``sparse``'s other CPU routes gather every query block's
key blocks into a copy and hand them to a dense kernel with a mask. This kernel reads K and V in
place: one task per (query block, batch, head) over all threads, each an online softmax over its key
blocks in tiles (scores held keys x queries so the softmax runs along the vector lanes). No
gradient: a call that needs one takes another route.

Time ``O(B H P (D + Dv))`` for ``P`` visible pairs per head; memory ``O(threads block (D + Dv))``
besides the inputs and the output.
"""

from __future__ import annotations

import ctypes

import torch

from .base import Workload
from .ckernel import CKernel

MAX_DIM = 256  # head sizes it takes (MAX_DIM in the C source)
MAX_KEYS = 2**24  # sequence lengths it takes (MAX_KEYS: positions are compared as float32)


def _declare(lib: ctypes.CDLL) -> None:
    f = lib.sparse_fwd
    f.restype = ctypes.c_int
    f.argtypes = [*(ctypes.c_void_p,) * 8, *(ctypes.c_int,) * 9, ctypes.c_float, *(ctypes.c_int,) * 4]


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
    if w.backward:
        return "the block-sparse kernel has no backward"
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
    why = refusal(w)
    if why is None and kernel() is None:
        why = build_error()
    return why


Layout = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (qblock, rowptr, cols), int32, see layout()


def layout(rows: list[tuple[int, list[int]]]) -> Layout:
    """The kernel's form of ``rows`` (``(query block, [key blocks])`` each, heavy rows first: the kernel
    starts them first): the query block of each row ``(R,)``, row offsets ``(R + 1,)`` and the key
    blocks of all rows ``(rowptr[-1],)``. Build it once per shape, not per call."""
    qblock = torch.tensor([r for r, _ in rows], dtype=torch.int32)  # (R,)
    rowptr = torch.tensor([0, *torch.tensor([len(c) for _, c in rows]).cumsum(0).tolist()], dtype=torch.int32)
    cols = torch.tensor([c for _, cs in rows for c in cs], dtype=torch.int32)  # (rowptr[-1],)
    return qblock, rowptr, cols


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
) -> torch.Tensor:
    """Attention of ``q (B, H, Nq, D)`` over ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` (float32,
    CPU, no gradient; query head ``h`` on K/V head ``h // (H / Hkv)``; query ``i`` at position
    ``i + Nk - Nq``) where query block ``r`` (positions ``r*block ..``) sees only the key blocks listed
    for it in ``rows`` (:func:`layout`; every block holding a query must have a row), and causal
    masking and ``key_padding_mask (B, Nk)`` (True = keep) at token level; with ``window``, a query
    at ``p`` sees only keys ``j`` with ``|p - j| <= window`` besides the first ``sinks`` keys
    (``local_window``'s band). A query that sees no key comes out zero. Returns ``(B, H, Nq, Dv)``.
    The caller checked :func:`refusal` and that :func:`kernel` is not None."""
    lib = kernel()
    assert lib is not None, "kernel() returned None: the caller must fall back"
    b, h, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # no copy when they already are
    qblock, rowptr, cols = rows
    kpm = None
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(torch.uint8).expand(b, nk).contiguous()  # (B, Nk): 1 = keep
    out = torch.empty(b, h, nq, dv)
    rc = lib.sparse_fwd(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        kpm.data_ptr() if kpm is not None else None,
        qblock.data_ptr(),
        rowptr.data_ptr(),
        cols.data_ptr(),
        len(qblock),
        b,
        h,
        hkv,
        nq,
        nk,
        d,
        dv,
        block,
        scale,
        int(causal),
        -1 if window is None else window,
        sinks,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"block-sparse kernel refused sizes it was checked for (rc={rc})")
    return out  # (B, H, Nq, Dv)
