"""``chunked``'s GPU path (``impl=triton``): its online softmax and block-recomputing backward as three
Triton kernels, so that a call is three launches instead of a Python loop of small ones.

- Forward: one program per (query tile, batch-head) walks the key tiles its rows can see (causal: up
  to the diagonal) with the running max, sum and weighted sum in registers, in base 2, and writes the
  output and each row's log2-sum-exp ``L``.
- Backward (FlashAttention-2, Dao 2023): dK and dV by one program per (key tile, batch, K/V head),
  over every query head of its group and every query tile that sees it; dQ by one program per (query
  tile, batch-head) over its key tiles. Both recompute the probabilities as ``2^(S log2 e - L)``; each
  output row has one writer, so there are no atomics.

The masks are the PyTorch path's: causal aligned bottom-right, key padding ``(B, Nk)``, a boolean
``attn_mask`` and a float ``bias`` broadcast to ``(B, H, Nq, Nk)``, read through their strides (a
broadcast dimension has stride 0: nothing is expanded), soft-capping ``c tanh(s / c)`` before the bias.
Grouped K/V heads are read in place. float16/bfloat16 dots run on tensor cores with float32
accumulation; float32 dots as three TF32 products (``tf32x3``: float32's accuracy on tensor cores,
where one TF32 product would lose it, which PyTorch's matmul by default does not either). A row that
sees no key outputs zeros (``L = +inf``, so its gradients are zero too).

Time ``O(B H Nq Nk D)`` (causal: half), memory ``O(B H Nq)`` beyond the inputs and outputs.

It runs on CUDA, and on the CPU only under Triton's interpreter, which the tests use
(``TRITON_INTERPRET=1`` before Triton is imported: it reads it then, its own library functions being
kernels too).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Workload, first_order_only

try:
    import triton
    import triton.language as tl
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    IMPORT_ERROR: str | None = None
    #: what a kernel that does not build for this GPU raises (a Triton other than the one the tiles were
    #: sized with may need more shared memory than the card has): ``auto`` then runs the PyTorch path
    BUILD_ERRORS: tuple[type[Exception], ...] = (CompilationError, OutOfResources)
except Exception as exc:  # not installed, or broken: the PyTorch path stays, the record says why
    triton = tl = None
    IMPORT_ERROR = f"Triton could not be imported ({type(exc).__name__}: {exc}); pip install triton"
    BUILD_ERRORS = ()

LOG2E_PY = 1.4426950408889634  # log2 e, for the host's side of the base-2 softmax
MAX_DIM = 256  # the largest head size the tiles take (padded to a power of two)
PREC32 = "tf32x3"  # float32 dots: three TF32 products, float32 accuracy on tensor cores
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def refusal(w: Workload) -> str | None:
    """Why the Triton path cannot take the call ``w`` (one line), or None. ``O(1)``."""
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    if w.device != "cuda" and not interpreting():
        return f"the Triton kernels run on CUDA, not {w.device} (TRITON_INTERPRET=1 runs them on the CPU)"
    if w.dtype not in DTYPES:
        return (
            f"the Triton kernels take float16, bfloat16 or float32, not {str(w.dtype).replace('torch.', '')}"
        )
    if max(w.head_dim, w.v_head_dim) > MAX_DIM:
        return f"the Triton kernels take head sizes up to {MAX_DIM}, not {max(w.head_dim, w.v_head_dim)}"
    if max(w.batch, w.heads) > 65535:  # the launch grid's heads and batch axes (CUDA's limit)
        return f"the Triton kernels launch up to 65535 heads and batches, not {max(w.batch, w.heads)}"
    if max(w.nq, w.nk) * max(w.head_dim, w.v_head_dim) >= 2**31:
        return "the Triton kernels index one batch-head's rows in 32 bits: N x D must stay below 2^31"
    return None


#: ``(BLOCK_M, BLOCK_N, warps, stages)`` per kernel, 16-bit or float32 inputs and head sizes up to 64, 128
#: or 256: of the tiles tried (M, N in 32, 64, 128), those compiled for sm_90 with the fewest spilled
#: registers on a causal call, then the largest, within an sm_80's shared memory (Triton 3.9's ptxas;
#: ``compile_for``). 16-bit at head size <= 128 spills nothing; float32 (three TF32 products a dot)
#: spills at every size, and at 256 takes smaller tiles to fit.
TILES: dict[tuple[str, int, int], tuple[int, int, int, int]] = {
    ("fwd", 16, 64): (128, 64, 8, 3),
    ("fwd", 16, 128): (128, 64, 8, 3),
    ("fwd", 16, 256): (32, 32, 4, 3),
    ("dkdv", 16, 64): (128, 64, 8, 2),
    ("dkdv", 16, 128): (128, 64, 8, 2),
    ("dkdv", 16, 256): (32, 32, 4, 2),
    ("dq", 16, 64): (128, 64, 8, 2),
    ("dq", 16, 128): (64, 64, 4, 2),
    ("dq", 16, 256): (32, 32, 4, 2),
    ("fwd", 32, 64): (32, 32, 4, 2),
    ("fwd", 32, 128): (32, 32, 4, 2),
    ("fwd", 32, 256): (32, 32, 4, 2),
    ("dkdv", 32, 64): (32, 32, 4, 2),
    ("dkdv", 32, 128): (64, 32, 4, 2),
    ("dkdv", 32, 256): (32, 16, 4, 2),
    ("dq", 32, 64): (32, 32, 4, 2),
    ("dq", 32, 128): (32, 32, 4, 2),
    ("dq", 32, 256): (16, 32, 4, 2),
}


def tile_class(d: int, dv: int, dtype: torch.dtype) -> tuple[int, int]:
    """What a tile table is keyed by: the input width in bits (16, or 32 for float32) and the head-size
    bucket (64, 128 or 256) that holds ``max(d, dv)``."""
    width = max(d, dv)
    return 32 if dtype == torch.float32 else 16, 64 if width <= 64 else 128 if width <= 128 else 256


def tile(kernel: str, d: int, dv: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, warps, stages)`` of ``kernel`` (``fwd``, ``dkdv``, ``dq``) for head sizes
    ``d``, ``dv`` (:data:`TILES`; ``tests/test_chunked_triton.py`` compiles them for sm_80 and sm_90)."""
    return TILES[(kernel, *tile_class(d, dv, dtype))]


def _pad(n: int) -> int:
    """The power of two (at least 16, a tensor-core dot's minimum) that holds ``n``."""
    return max(16, triton.next_power_of_2(n))


if triton is not None:
    LOG2E = tl.constexpr(LOG2E_PY)

    @triton.jit
    def _at(P, base, r0, r_stride, rr, c_stride, cc):
        """Pointers ``(R, C)`` to rows ``r0 + rr`` and columns ``cc`` of the matrix at ``P + base``: the
        tile's start in 64 bits (a mask's ``Nq x Nk`` passes 2^31 from N = 46341 on), the offsets within
        it in 32. Only where the offsets are not reused across a loop: the compiler keeps reused ones in
        registers (q, k and v read this way spilled at head size 128), so those index a batch-head's
        rows in 32 bits (:func:`_within_32_bits`)."""
        start = base + tl.cast(r0, tl.int64) * r_stride
        return P + start + rr[:, None] * r_stride + cc[None, :] * c_stride

    # fmt: off
    @triton.jit
    def _scores(
        q, k, m0, n0, b, h, nq, nk, qk_scale, cap,
        KPM, kpm_b, kpm_n, AM, am_b, am_h, am_m, am_n, BIAS, bias_b, bias_h, bias_m, bias_n,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_CAP: tl.constexpr, PREC: tl.constexpr,
    ):
    # fmt: on
        """The scores ``(M, N)`` of the query rows from ``m0`` against the key rows from ``n0``, in base 2
        (times log2 e), -inf where masked; and the cap's slope ``1 - tanh^2`` (1.0 without a cap)."""
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (M, N), natural units
        slope = 1.0
        if HAS_CAP:  # tanh from exp(-2|x|): no overflow at any |x|
            x = s / cap
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            t = tl.where(x < 0, -t, t)
            s = cap * t
            slope = 1.0 - t * t
        rm, rn = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
        rows, cols = (m0 + rm)[:, None], (n0 + rn)[None, :]  # (M, 1), (1, N) positions
        inside = (rows < nq) & (cols < nk)
        if HAS_BIAS:
            base = b * bias_b + h * bias_h + tl.cast(n0, tl.int64) * bias_n
            at = _at(BIAS, base, m0, bias_m, rm, bias_n, rn)
            s += tl.load(at, mask=inside, other=0.0).to(tl.float32)
        valid = cols < nk
        if CAUSAL:  # query i is position i + nk - nq
            valid = valid & (cols <= rows + (nk - nq))
        if HAS_KPM:
            pad = tl.load(KPM + b * kpm_b + cols * kpm_n, mask=cols < nk, other=0)
            valid = valid & (pad != 0)
        if HAS_AM:
            base = b * am_b + h * am_h + tl.cast(n0, tl.int64) * am_n
            at = _at(AM, base, m0, am_m, rm, am_n, rn)
            valid = valid & (tl.load(at, mask=inside, other=0) != 0)
        return tl.where(valid, s * LOG2E, float("-inf")), slope

    # fmt: off
    @triton.jit
    def _fwd(
        Q, K, V, OUT, L,
        q_b, q_h, q_m, q_d, k_b, k_h, k_n, k_d, v_b, v_h, v_n, v_d,
        o_b, o_h, o_m, o_d, SINK, sink_b, sink_h, sink_m,
        KPM, kpm_b, kpm_n, AM, am_b, am_h, am_m, am_n, BIAS, bias_b, bias_h, bias_m, bias_n,
        nq, nk, heads, group, qk_scale, cap,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_CAP: tl.constexpr, PREC: tl.constexpr, HAS_SINK: tl.constexpr,
    ):
    # fmt: on
        """Output ``O (B, H, Nq, DV)`` and log2-sum-exp ``L (B H, Nq)`` of one query tile (program axis
        0) of one head (axis 1) and batch (axis 2); with ``HAS_SINK``, each row's sink logit ``SINK[b,
        h, m]`` (strides 0 where broadcast) is one more term of its softmax, for a zero value."""
        h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        hk = h // group
        m0 = tl.program_id(0) * BLOCK_M
        rm, rn = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        rows = m0 + rm < nq
        q = tl.load(
            Q + b * q_b + h * q_h + (m0 + rm)[:, None] * q_m + offs_d[None, :] * q_d,
            mask=rows[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )  # (M, BLOCK_D)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base 2)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of 2^(s - m)
        if HAS_SINK:  # the sink starts the sums: its term is 2^(sink - sink) = 1, its value 0
            sink = tl.load(SINK + b * sink_b + h * sink_h + (m0 + rm) * sink_m, mask=rows, other=0.0)
            m_i = sink.to(tl.float32) * LOG2E
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # running sum of 2^(s - m) v
        hi = nk
        if CAUSAL:  # no key past the tile's last row
            hi = tl.minimum(nk, m0 + BLOCK_M + (nk - nq))
        for n0 in range(0, hi, BLOCK_N):
            keys = (n0 + rn)[:, None] < nk
            k = tl.load(
                K + b * k_b + hk * k_h + (n0 + rn)[:, None] * k_n + offs_d[None, :] * k_d,
                mask=keys & (offs_d[None, :] < D),
                other=0.0,
            )  # (N, BLOCK_D)
            s, _ = _scores(
                q, k, m0, n0, b, h, nq, nk, qk_scale, cap,
                KPM, kpm_b, kpm_n, AM, am_b, am_h, am_m, am_n, BIAS, bias_b, bias_h, bias_m, bias_n,
                BLOCK_M, BLOCK_N, CAUSAL, HAS_KPM, HAS_AM, HAS_BIAS, HAS_CAP, PREC,
            )  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: p = 0
            p = tl.math.exp2(s - m_safe[:, None])  # (M, N)
            alpha = tl.math.exp2(m_i - m_safe)  # rescales what was summed under the old max
            v = tl.load(
                V + b * v_b + hk * v_h + (n0 + rn)[:, None] * v_n + offs_dv[None, :] * v_d,
                mask=keys & (offs_dv[None, :] < DV),
                other=0.0,
            )  # (N, BLOCK_DV)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        seen = l_i > 0
        l_i = tl.where(seen, l_i, 1.0)
        out = acc / l_i[:, None]  # a row that sees nothing: 0 / 1 = 0
        tl.store(
            OUT + b * o_b + h * o_h + (m0 + rm)[:, None] * o_m + offs_dv[None, :] * o_d,
            out.to(OUT.dtype.element_ty),
            mask=rows[:, None] & (offs_dv[None, :] < DV),
        )
        # a row that sees nothing gets L = +inf: 2^(S - L) = 0 in the backward
        lse = tl.where(seen, m_i + tl.math.log2(l_i), float("inf"))
        tl.store(L + (b * heads + h) * nq + m0 + rm, lse, mask=rows)

    # fmt: off
    @triton.jit
    def _bwd_dkdv(
        Q, K, V, DO, L, DELTA, DK, DV_,
        q_b, q_h, q_m, q_d, k_b, k_h, k_n, k_d, v_b, v_h, v_n, v_d,
        do_b, do_h, do_m, do_d,
        KPM, kpm_b, kpm_n, AM, am_b, am_h, am_m, am_n, BIAS, bias_b, bias_h, bias_m, bias_n,
        nq, nk, heads, group, qk_scale, cap,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_CAP: tl.constexpr, PREC: tl.constexpr,
    ):
    # fmt: on
        """dK ``(B, Hkv, Nk, D)`` and dV ``(B, Hkv, Nk, DV)`` of one key tile (program axis 0) of one
        K/V head (axis 1) and batch (axis 2), summed over the query heads of its group (``DK``/``DV_``
        contiguous, head sizes padded to the tile)."""
        hk, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        n0 = tl.program_id(0) * BLOCK_N
        rm, rn = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        keys = (n0 + rn)[:, None] < nk
        k = tl.load(
            K + b * k_b + hk * k_h + (n0 + rn)[:, None] * k_n + offs_d[None, :] * k_d,
            mask=keys & (offs_d[None, :] < D),
            other=0.0,
        )  # (N, BLOCK_D)
        v = tl.load(
            V + b * v_b + hk * v_h + (n0 + rn)[:, None] * v_n + offs_dv[None, :] * v_d,
            mask=keys & (offs_dv[None, :] < DV),
            other=0.0,
        )  # (N, BLOCK_DV)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        lo = 0
        if CAUSAL:  # no query tile wholly before this key tile's first key
            lo = tl.maximum(0, n0 - (nk - nq)) // BLOCK_M * BLOCK_M
        for g in range(0, group):
            h = hk * group + g
            for m0 in range(lo, nq, BLOCK_M):
                rows = m0 + rm < nq
                q = tl.load(
                    Q + b * q_b + h * q_h + (m0 + rm)[:, None] * q_m + offs_d[None, :] * q_d,
                    mask=rows[:, None] & (offs_d[None, :] < D),
                    other=0.0,
                )  # (M, BLOCK_D)
                do = tl.load(
                    DO + b * do_b + h * do_h + (m0 + rm)[:, None] * do_m + offs_dv[None, :] * do_d,
                    mask=rows[:, None] & (offs_dv[None, :] < DV),
                    other=0.0,
                )  # (M, BLOCK_DV)
                row = (b * heads + h) * nq + m0 + rm
                lse = tl.load(L + row, mask=rows, other=float("inf"))
                delta = tl.load(DELTA + row, mask=rows, other=0.0)
                s, slope = _scores(
                    q, k, m0, n0, b, h, nq, nk, qk_scale, cap,
                    KPM, kpm_b, kpm_n, AM, am_b, am_h, am_m, am_n, BIAS, bias_b, bias_h, bias_m, bias_n,
                    BLOCK_M, BLOCK_N, CAUSAL, HAS_KPM, HAS_AM, HAS_BIAS, HAS_CAP, PREC,
                )  # fmt: skip
                p = tl.math.exp2(s - lse[:, None])  # (M, N)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
                dp = tl.dot(do, tl.trans(v), input_precision=PREC)  # (M, N)
                ds = p * (dp - delta[:, None]) * slope  # dS = P (dP - rowsum(dO O)), through the cap
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
        bhk = b * (heads // group) + hk
        dk_at = _at(DK, bhk * nk * BLOCK_D, n0, BLOCK_D, rn, 1, offs_d)
        tl.store(dk_at, (dk * qk_scale).to(DK.dtype.element_ty), mask=keys)
        dv_at = _at(DV_, bhk * nk * BLOCK_DV, n0, BLOCK_DV, rn, 1, offs_dv)
        tl.store(dv_at, dv.to(DV_.dtype.element_ty), mask=keys)

    # fmt: off
    @triton.jit
    def _bwd_dq(
        Q, K, V, DO, L, DELTA, DQ,
        q_b, q_h, q_m, q_d, k_b, k_h, k_n, k_d, v_b, v_h, v_n, v_d,
        do_b, do_h, do_m, do_d,
        KPM, kpm_b, kpm_n, AM, am_b, am_h, am_m, am_n, BIAS, bias_b, bias_h, bias_m, bias_n,
        nq, nk, heads, group, qk_scale, cap,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_CAP: tl.constexpr, PREC: tl.constexpr,
    ):
    # fmt: on
        """dQ ``(B, H, Nq, D)`` (``DQ`` contiguous, head size padded to ``BLOCK_D``) of one query tile
        (program axis 0) of one head (axis 1) and batch (axis 2)."""
        h, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        hk = h // group
        m0 = tl.program_id(0) * BLOCK_M
        rm, rn = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        rows = m0 + rm < nq
        q = tl.load(
            Q + b * q_b + h * q_h + (m0 + rm)[:, None] * q_m + offs_d[None, :] * q_d,
            mask=rows[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )  # (M, BLOCK_D)
        do = tl.load(
            DO + b * do_b + h * do_h + (m0 + rm)[:, None] * do_m + offs_dv[None, :] * do_d,
            mask=rows[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )  # (M, BLOCK_DV)
        row = (b * heads + h) * nq + m0 + rm
        lse = tl.load(L + row, mask=rows, other=float("inf"))
        delta = tl.load(DELTA + row, mask=rows, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = nk
        if CAUSAL:
            hi = tl.minimum(nk, m0 + BLOCK_M + (nk - nq))
        for n0 in range(0, hi, BLOCK_N):
            keys = (n0 + rn)[:, None] < nk
            k = tl.load(
                K + b * k_b + hk * k_h + (n0 + rn)[:, None] * k_n + offs_d[None, :] * k_d,
                mask=keys & (offs_d[None, :] < D),
                other=0.0,
            )  # (N, BLOCK_D)
            v = tl.load(
                V + b * v_b + hk * v_h + (n0 + rn)[:, None] * v_n + offs_dv[None, :] * v_d,
                mask=keys & (offs_dv[None, :] < DV),
                other=0.0,
            )  # (N, BLOCK_DV)
            s, slope = _scores(
                q, k, m0, n0, b, h, nq, nk, qk_scale, cap,
                KPM, kpm_b, kpm_n, AM, am_b, am_h, am_m, am_n, BIAS, bias_b, bias_h, bias_m, bias_n,
                BLOCK_M, BLOCK_N, CAUSAL, HAS_KPM, HAS_AM, HAS_BIAS, HAS_CAP, PREC,
            )  # fmt: skip
            p = tl.math.exp2(s - lse[:, None])  # (M, N)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None]) * slope
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
        tl.store(
            _at(DQ, (b * heads + h) * nq * BLOCK_D, m0, BLOCK_D, rm, 1, offs_d),
            (dq * qk_scale).to(DQ.dtype.element_ty),
            mask=rows[:, None],
        )


def _mask_args(
    kpm: torch.Tensor | None, am: torch.Tensor | None, bias: torch.Tensor | None, ref: torch.Tensor
) -> tuple[Any, ...]:
    """The masks' pointers and strides as the kernels take them: ``kpm (B, Nk)``, ``am`` and ``bias``
    as 4-D views ``(B|1, H|1, Nq|1, Nk)`` (stride 0 on a broadcast dimension); ``ref`` stands in for
    an absent one (never read: its flag is off)."""
    args: list[Any] = []
    kpm = None if kpm is None else kpm.view(torch.uint8)  # bool read as bytes, no copy
    args += [ref, 0, 0] if kpm is None else [kpm, *kpm.stride()]
    for t, is_mask in ((am, True), (bias, False)):
        if t is None:
            args += [ref, 0, 0, 0, 0]
            continue
        t = t.view(torch.uint8) if is_mask else t
        args += [t, *_broadcast_strides(t)]
    return tuple(args)


def _broadcast_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides with 0 on every dimension of size 1, so a kernel reads it broadcast there."""
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride(), strict=True))


Launch = tuple[Any, tuple[int, int, int], tuple[Any, ...], dict[str, Any]]  # kernel, grid, args, keywords


def _common(q, k, v, kpm, am, bias, causal: bool, scale: float, cap) -> tuple[tuple[Any, ...], dict]:
    """The arguments every kernel takes after its tensors: masks, sizes, scale and cap; and the
    keywords (head sizes, flags) but the tiles."""
    b, h, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    args = (*_mask_args(kpm, am, bias, q), nq, nk, h, h // hkv, scale, 1.0 if cap is None else float(cap))
    meta = {
        "D": d,
        "DV": dv,
        "BLOCK_D": _pad(d),
        "BLOCK_DV": _pad(dv),
        "CAUSAL": causal,
        "HAS_KPM": kpm is not None,
        "HAS_AM": am is not None,
        "HAS_BIAS": bias is not None,
        "HAS_CAP": cap is not None,
        "PREC": PREC32 if q.dtype == torch.float32 else "tf32",  # tf32 is ignored for 16-bit inputs
    }
    return args, meta


def _tiled(kernel: str, q: torch.Tensor, v: torch.Tensor, meta: dict) -> dict:
    """``meta`` with ``kernel``'s tile and launch shape (:func:`tile`)."""
    m, n, warps, stages = tile(kernel, q.shape[-1], v.shape[-1], q.dtype)
    return {**meta, "BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": stages}


def sink_args(sinks: torch.Tensor | None, ref: torch.Tensor) -> tuple[Any, ...]:
    """The sink logits ``(B|1, H, Nq|1)`` as a kernel takes them: the tensor and its strides, 0 on a
    broadcast dimension; ``ref`` stands in for absent ones (never read: ``HAS_SINK`` is off)."""
    return (ref, 0, 0, 0) if sinks is None else (sinks, *_broadcast_strides(sinks))


def forward_launch(
    q, k, v, out, lse, kpm, am, bias, causal: bool, scale: float, cap, sinks: torch.Tensor | None = None
) -> Launch:
    """The forward kernel's launch: ``out (B, H, Nq, Dv)`` and ``lse (B H, Nq)`` float32 are written;
    ``sinks (B|1, H, Nq|1)`` join each row's softmax."""
    args, meta = _common(q, k, v, kpm, am, bias, causal, scale, cap)
    meta = {**_tiled("fwd", q, v, meta), "HAS_SINK": sinks is not None}
    grid = (triton.cdiv(q.shape[2], meta["BLOCK_M"]), q.shape[1], q.shape[0])  # (tiles, H, B): each < 65536
    tensors = (q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *sink_args(sinks, q))
    return _fwd, grid, (*tensors, *args), meta


def backward_launches(
    q, k, v, grad_out, lse, delta, dq, dk, dv, kpm, am, bias, causal: bool, scale: float, cap
) -> list[Launch]:
    """The backward kernels' launches: ``dq (B, H, Nq, BLOCK_D)``, ``dk (B, Hkv, Nk, BLOCK_D)`` and ``dv
    (B, Hkv, Nk, BLOCK_DV)``, contiguous (:func:`_grad`), are written."""
    args, meta = _common(q, k, v, kpm, am, bias, causal, scale, cap)
    strides = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride())
    b, h, nq = q.shape[:3]
    hkv, nk = k.shape[1], k.shape[2]
    dkdv, dq_ = _tiled("dkdv", q, v, meta), _tiled("dq", q, v, meta)
    return [
        (
            _bwd_dkdv,
            (triton.cdiv(nk, dkdv["BLOCK_N"]), hkv, b),
            (q, k, v, grad_out, lse, delta, dk, dv, *strides, *args),
            dkdv,
        ),
        (
            _bwd_dq,
            (triton.cdiv(nq, dq_["BLOCK_M"]), h, b),
            (q, k, v, grad_out, lse, delta, dq, *strides, *args),
            dq_,
        ),
    ]


def _run(launch: Launch) -> None:
    kernel, grid, args, meta = launch
    q = args[0]
    if q.is_cuda:  # Triton launches on the current device: make it q's (cuda:1 from a cuda:0 process)
        with torch.cuda.device(q.device):
            kernel[grid](*args, **meta)
    else:  # the interpreter
        kernel[grid](*args, **meta)


def compile_for(launch: Launch, arch: int) -> dict[str, int]:
    """Compile ``launch``'s kernel for an NVIDIA GPU of compute capability ``arch`` (80: A100, 90:
    H100/H200) on this machine, GPU or not, with Triton's own ``ptxas``: its ``shared`` memory in bytes,
    its registers per thread ``regs`` and its ``stack`` bytes (above 0: registers spilled)."""
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    kernel, _, args, meta = launch
    consts = {n: v for n, v in meta.items() if n not in ("num_warps", "num_stages")}
    names = [n for n in kernel.arg_names if n not in consts]
    signature = {n: mangle_type(a) for n, a in zip(names, args, strict=True)} | dict.fromkeys(
        consts, "constexpr"
    )
    source = ASTSource(fn=kernel, signature=signature, constexprs=consts)
    options = {"num_warps": meta["num_warps"], "num_stages": meta["num_stages"]}
    built = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(built.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True)
    fields = dict(
        part.split(":", 1) for part in usage.stdout.split("Function", 1)[1].split()[1:] if ":" in part
    )
    return {"shared": built.metadata.shared, "regs": int(fields["REG"]), "stack": int(fields["STACK"])}


class _TritonChunked(torch.autograd.Function):
    """``softmax(q k^T scale, masked) v`` by the kernels above, with their backward."""

    @staticmethod
    def forward(ctx: Any, q, k, v, kpm, am, bias, sinks, causal: bool, scale: float, cap):
        b, h, nq, _ = q.shape
        out = torch.empty(b, h, nq, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(b * h, nq, dtype=torch.float32, device=q.device)  # log2-sum-exp per row
        _run(forward_launch(q, k, v, out, lse, kpm, am, bias, causal, scale, cap, sinks))
        ctx.save_for_backward(q, k, v, out, lse, kpm, am, bias, sinks)
        ctx.cfg = (causal, scale, cap)
        return out

    @staticmethod
    @first_order_only  # its gradients carry no graph: a second derivative is refused, never wrong
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, out, lse, kpm, am, bias, sinks = ctx.saved_tensors
        causal, scale, cap = ctx.cfg
        grad_out = _within_32_bits(grad_out)
        b, h, nq, d = q.shape
        hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
        delta = (grad_out.float() * out.float()).sum(-1).reshape(b * h, nq)  # rowsum(dO O) = rowsum(P dP)
        want_q, want_k, want_v = ctx.needs_input_grad[:3]
        none = q.new_empty(0)  # stands in for a gradient no kernel writes
        dq = _grad(q, (b, h, nq), d) if want_q else none
        dk, dvv = (
            (_grad(k, (b, hkv, nk), d), _grad(v, (b, hkv, nk), dv)) if want_k or want_v else (none, none)
        )
        dkdv, dq_ = backward_launches(
            q, k, v, grad_out, lse, delta, dq, dk, dvv, kpm, am, bias, causal, scale, cap
        )
        if want_k or want_v:  # one kernel writes both
            _run(dkdv)
        if want_q:
            _run(dq_)
        dq, dk, dvv = dq[..., :d], dk[..., :d], dvv[..., :dv]  # (B, H|Hkv, N, D|Dv): the padding dropped
        # (no copy where the buffer was in the input's dtype and unpadded)
        grads = (
            dq.to(q.dtype) if want_q else None,
            dk.to(k.dtype) if want_k else None,
            dvv.to(v.dtype) if want_v else None,
        )
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[6]:
            # the sink's weight is P = 2^(sink log2 e - L) and its value 0, so dsink = P (0 - rowsum(dO O))
            p = torch.exp2(sinks.float().expand(b, h, nq).reshape(b * h, nq) * LOG2E_PY - lse)  # (B H, Nq)
            dsinks = (-p * delta).view(b, h, nq)  # (B, H, Nq): summed over the sinks' broadcast dims
            dims = [d for d in range(3) if sinks.shape[d] == 1]
            dsinks = (dsinks.sum(dims, keepdim=True) if dims else dsinks).to(sinks.dtype)
        return *grads, None, None, None, dsinks, None, None, None


def _grad(like: torch.Tensor, rows: tuple[int, int, int], d: int) -> torch.Tensor:
    """The buffer ``(*rows, BLOCK_D)`` a backward kernel writes a gradient of head size ``d`` to (whole
    tile rows, contiguous): in ``like``'s dtype when ``d`` is already a tile width (the kernels round
    their float32 sums once, at the store), else float32, cut and cast after."""
    pad = _pad(d)
    return torch.empty(*rows, pad, dtype=like.dtype if pad == d else torch.float32, device=like.device)


def _within_32_bits(t: torch.Tensor) -> torch.Tensor:
    """``t (B, H, N, D)``, or a contiguous copy where one batch-head's rows reach past 2^31 elements
    (a ``(B, N, H, D)`` layout on a very long sequence): the kernels index within a batch-head in 32
    bits."""
    reach = (t.shape[2] - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3)
    return t if reach < 2**31 else t.contiguous()


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q (B, H, Nq, D)`` against ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` (``H % Hkv == 0``);
    ``attn_mask`` and ``bias`` as 4-D views ``(B|1, H|1, Nq|1, Nk)``; ``sinks (B|1, H, Nq|1)``, a logit
    per row that joins its softmax for a zero value (with its gradient). Returns ``(B, H, Nq, Dv)`` in
    ``q``'s dtype. Call :func:`refusal` first."""
    q, k, v = (_within_32_bits(t) for t in (q, k, v))
    return _TritonChunked.apply(q, k, v, key_padding_mask, attn_mask, bias, sinks, causal, scale, softcap)
