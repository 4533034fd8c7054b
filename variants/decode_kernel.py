"""Split-K decoding on the CPU (flash-decoding, Dao et al. 2023): a C kernel (``decode_kernel.c``)
built on first use with the system's C compiler and called through ``ctypes``.

A decode step's few queries against a long cache leave PyTorch's kernels little to parallelise and
run their products at a fraction of the GEMM rate (B=1, 32 query heads on 4 K/V heads, D=128, 64k
keys, fp32: fused SDPA at a quarter of the copy bandwidth on this project's 2-core VM). The kernel
splits every K/V head's keys into ranges, one task per (head, range) over all threads, reads each
cached row once for all the query heads that share it (grouped heads are not repeated), keeps an
online softmax per range and merges the ranges by log-sum-exp.

Built once per machine (:mod:`variants.ckernel`). Where it cannot be built, :func:`kernel` returns
None and :func:`build_error` says why: the caller falls back to PyTorch and its record says which ran.

Time ``O(B Hkv R Nk (D + Dv))`` for ``R`` query rows per K/V head; memory ``O(B Hkv splits R Dv)``.
"""

from __future__ import annotations

import ctypes

import torch

from .base import Workload
from .ckernel import CKernel

MAX_ROWS = 64  # query rows per K/V head (G * Nq) the kernel takes (MAX_ROWS in the C source)
MAX_DIM = 256  # head sizes it takes (MAX_DIM)
_MIN_KEYS_PER_SPLIT = 512  # a range shorter than this costs more to merge than it saves


def _declare(lib: ctypes.CDLL) -> None:
    f = lib.decode_splitk
    f.restype = ctypes.c_int
    f.argtypes = [
        *(ctypes.c_void_p,) * 4,
        ctypes.c_long,
        *(ctypes.c_int,) * 2,
        ctypes.c_long,
        *(ctypes.c_int,) * 2,
        *(ctypes.c_long,) * 4,
        ctypes.c_float,
        *(ctypes.c_int,) * 3,
        ctypes.c_void_p,
    ]


_KERNEL = CKernel("decode_kernel.c", "the decode kernel", _declare)


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
        return f"the decode kernel takes float32 CPU tensors, not {dtype} on {w.device}"
    if w.backward:
        return "the decode kernel has no backward"
    if w.key_padding or w.attn_mask or w.bias or w.softcap is not None or w.documents:
        return (
            "the decode kernel takes causal masking only (no padding mask, attn_mask, bias, softcap or "
            "packed documents)"
        )
    if w.nq >= w.nk:
        return f"the decode kernel is for fewer queries than keys (Nq={w.nq}, Nk={w.nk})"
    rows = w.heads // w.hkv * w.nq
    if rows > MAX_ROWS:
        return f"the decode kernel takes at most {MAX_ROWS} query rows per K/V head, not {rows}"
    if max(w.head_dim, w.v_head_dim) > MAX_DIM:
        return f"the decode kernel takes head sizes up to {MAX_DIM}, not {max(w.head_dim, w.v_head_dim)}"
    return None


def unusable(w: Workload) -> str | None:
    """Why the kernel cannot run ``w`` here: :func:`refusal`, or why it could not be built; None if it
    can."""
    return _KERNEL.unusable(refusal(w))


def _pair_step(t: torch.Tensor) -> int | None:
    """The elements from one (batch, K/V head) pair of ``t (B, Hkv, N, E)`` to the next, where one
    stride walks them all (rows of E contiguous), else None. With one K/V head the pairs are the batch
    rows: the step is the batch stride, whatever the head's (torch calls a ``(B, 1, N, E)`` view of a
    ``(B, N, 1, E)`` cache contiguous, with a head stride of ``E``: stepping by it read row ``b`` at
    ``b E``, inside row 0)."""
    if t.stride(-1) != 1:
        return None
    if t.shape[1] == 1:
        return t.stride(0)
    if t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1):
        return t.stride(1)
    return None


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q (B, H, Nq, D)`` over ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` (float32, CPU,
    no gradient, query head ``h`` on K/V head ``h // (H / Hkv)``; causal bottom-right):
    ``(B, H, Nq, Dv)``. ``sinks (B|1, H, Nq|1)``: a logit per row that joins its softmax for a zero
    value, merged as one more key range (no copy of the cache). The caller checked :func:`refusal` and
    that :func:`kernel` is not None."""
    lib = kernel()
    assert lib is not None, "kernel() returned None: the caller must fall back"
    b, h, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = h // hkv
    qr = q.reshape(b * hkv, g * nq, d).contiguous()  # (B*Hkv, G*Nq, D): row r is query r % Nq
    # the kernel steps from one (batch, K/V head) pair to the next by one stride: true of a contiguous
    # cache and of a view of one along N; anything else is copied once
    k = k if _pair_step(k) is not None else k.contiguous()
    v = v if _pair_step(v) is not None else v.contiguous()
    kstep, vstep = _pair_step(k), _pair_step(v)
    out = torch.empty(b * hkv, g * nq, dv, dtype=torch.float32)  # (B*Hkv, G*Nq, Dv)
    if sinks is not None:  # (B, H, Nq) -> (B*Hkv, G*Nq): row g*Nq + i of a pair is query i of head hkv*G + g
        sinks = sinks.to(torch.float32).expand(b, h, nq).reshape(b * hkv, g * nq).contiguous()
    threads = torch.get_num_threads()
    splits = max(1, min(nk // _MIN_KEYS_PER_SPLIT, -(-8 * threads // (b * hkv))))
    rc = lib.decode_splitk(
        qr.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        b * hkv,
        g * nq,
        nq,
        nk,
        d,
        dv,
        kstep,
        k.stride(2),
        vstep,
        v.stride(2),
        scale,
        int(causal),
        splits,
        threads,
        None if sinks is None else sinks.data_ptr(),
    )
    if rc != 0:
        raise RuntimeError(f"decode kernel refused sizes it was checked for (rc={rc})")
    return out.view(b, h, nq, dv)  # (B*Hkv, G*Nq, Dv) -> (B, H, Nq, Dv): head hkv*G + g
