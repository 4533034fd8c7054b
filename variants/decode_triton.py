"""Split-K decoding on CUDA (flash-decoding, Dao et al. 2023) as a Triton kernel: ``chunked``'s decode
step on its Triton path.

A decode step has few queries (``Nq`` per head, often 1) against a long cache. The forward kernel of
:mod:`variants.chunked_triton` gives each (query tile, head) one program, so a step is ``B H``
programs, each walking every key with 127 of its 128 rows empty: a GPU of 132 SMs runs a few of them
and waits on one long loop. Here each program takes one K/V head and one range of its keys, with every
query row of that head's group in one tile (``G Nq`` rows: grouped heads read each cached row once),
so a step is ``B Hkv splits`` programs, enough to fill the GPU; each keeps an online softmax over its
range and writes its rows' partial output and log2-sum-exp, and the ranges are merged by
log-sum-exp (a few PyTorch operations on ``B Hkv splits G Nq Dv`` floats).

It takes what the forward kernel takes (causal aligned bottom-right, key padding, a boolean
``attn_mask`` and a float ``bias`` read through their strides, soft-capping, ``Dv != D``); no
gradient (a step that needs one runs the forward and backward kernels). A row that sees no key
outputs zeros.

Time ``O(B Hkv Nk (G Nq)(D + Dv))`` with each cached row read once; memory ``O(B Hkv splits G Nq
Dv)`` floats for the partial results.
"""

from __future__ import annotations

import math

import torch

from .base import Workload
from .chunked_triton import (
    LOG2E_PY,
    PREC32,
    Launch,
    _mask_args,
    _pad,
    _run,
    _within_32_bits,
    refusal,
    sink_args,
    tile_class,
    tl,
    triton,
)

_MIN_TILES_PER_SPLIT = 4  # a range shorter than this costs more to merge than it saves
_PROGRAMS_PER_SM = 4  # enough programs in flight to hide each one's memory latency
_INTERPRETED_SMS = 4  # stands in for the SM count under the interpreter (tests: several splits)

#: ``(BLOCK_N, warps, stages)`` per input width (16-bit or float32), head-size bucket (64, 128, 256) and
#: row bucket (query rows per K/V head, ``G Nq``, padded to 16, 32 or 64; a call takes the smallest
#: bucket that holds its rows, and one with more rows than the largest is refused). Of the tiles tried,
#: those compiled for sm_80 and sm_90 (Triton 3.9's ptxas, ``tests/test_decode_triton.py``) with no
#: register spilled and within an A100's shared memory, the largest key tile first; float32 at head
#: size 256 spills 88-136 bytes at every tile tried, and float32 (three TF32 products a dot) fills
#: shared memory at more rows.
TILES: dict[tuple[int, int, int], tuple[int, int, int]] = {
    (16, 64, 16): (64, 8, 3),
    (16, 64, 64): (32, 4, 2),
    (16, 128, 32): (64, 8, 3),
    (16, 128, 64): (32, 4, 2),
    (16, 256, 16): (64, 8, 3),
    (16, 256, 32): (32, 8, 2),
    (32, 64, 16): (64, 8, 3),
    (32, 64, 32): (32, 8, 2),
    (32, 64, 64): (16, 4, 2),
    (32, 128, 32): (16, 4, 2),
    (32, 256, 16): (16, 4, 2),
}


def _row_buckets(d: int, dv: int, dtype: torch.dtype) -> list[int]:
    """The row buckets :data:`TILES` has for these head sizes and dtype."""
    cls = tile_class(d, dv, dtype)
    return [rows for (*key, rows) in TILES if tuple(key) == cls]


def tile(d: int, dv: int, rows: int, dtype: torch.dtype) -> tuple[int, int, int] | None:
    """``(BLOCK_N, warps, stages)`` for head sizes ``d``, ``dv`` and ``rows`` query rows per K/V head
    (:data:`TILES`), or None when no tile takes that many rows. ``O(1)``."""
    fits = [r for r in _row_buckets(d, dv, dtype) if r >= rows]
    return TILES[(*tile_class(d, dv, dtype), min(fits))] if fits else None


def max_rows(d: int, dv: int, dtype: torch.dtype) -> int:
    """The most query rows per K/V head a tile of :data:`TILES` takes at these head sizes and dtype."""
    return max(_row_buckets(d, dv, dtype))


def decode_refusal(w: Workload) -> str | None:
    """Why the split-K kernel cannot take the call ``w`` (one line), or None: the Triton path's
    refusals, a call that is not a decode, one that needs a gradient or has more query rows per K/V
    head than a tile holds (:func:`max_rows`). ``O(1)``."""
    why = refusal(w)
    if why is not None:
        return why
    if w.backward:
        return "the split-K decode kernel has no backward"
    if w.nq >= w.nk:
        return f"the split-K decode kernel is for fewer queries than keys (Nq={w.nq}, Nk={w.nk})"
    rows, most = w.heads // w.hkv * w.nq, max_rows(w.head_dim, w.v_head_dim, w.dtype)
    if rows > most:
        dtype = str(w.dtype).replace("torch.", "")
        return (
            f"the split-K decode kernel takes at most {most} query rows per K/V head (G x Nq) at head "
            f"size {max(w.head_dim, w.v_head_dim)} in {dtype}, not {rows}"
        )
    return None


if triton is not None:
    from .chunked_triton import _at  # a Triton function: defined only where Triton imports

    LOG2E = tl.constexpr(LOG2E_PY)

    # fmt: off
    @triton.jit
    def _decode(
        Q, K, V, OUT, L,
        q_b, q_h, q_m, q_d, k_b, k_h, k_n, k_d, v_b, v_h, v_n, v_d, SINK, sink_b, sink_h, sink_m,
        KPM, kpm_b, kpm_n, AM, am_b, am_h, am_m, am_n, BIAS, bias_b, bias_h, bias_m, bias_n,
        nq, nk, hkv, group, span, splits, qk_scale, cap,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, HAS_AM: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_CAP: tl.constexpr, PREC: tl.constexpr, HAS_SINK: tl.constexpr,
    ):
    # fmt: on
        """The partial output ``OUT (B, Hkv, splits, BLOCK_M, BLOCK_DV)`` and log2-sum-exp ``L (B, Hkv,
        splits, BLOCK_M)`` (float32, contiguous) of one key range (program axis 0) of one K/V head
        (axis 1) and batch (axis 2), for every query row of its group: row ``r`` is query ``r % Nq`` of
        head ``hk G + r // Nq``. With ``HAS_SINK`` the first range's sums start from each row's sink
        logit ``SINK[b, h, i]`` (strides 0 where broadcast; one term, for a zero value), so that the
        merged softmax counts it once."""
        split = tl.program_id(0)
        hk, b = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        rm, rn = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        rows = rm < group * nq
        qi = rm % nq  # the row's query
        h = hk * group + rm // nq  # (M,) its head, 64-bit
        q = tl.load(
            Q + b * q_b + h[:, None] * q_h + qi[:, None] * q_m + offs_d[None, :] * q_d,
            mask=rows[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )  # (M, BLOCK_D)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base 2)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of 2^(s - m)
        if HAS_SINK:
            if split == 0:  # the sink's term is 2^(sink - sink) = 1
                sink = tl.load(SINK + b * sink_b + h * sink_h + qi * sink_m, mask=rows, other=0.0)
                m_i = sink.to(tl.float32) * LOG2E
                l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # running sum of 2^(s - m) v
        lo = split * span
        hi = tl.minimum(nk, lo + span)
        for n0 in range(lo, hi, BLOCK_N):
            cols = n0 + rn  # (N,) key positions
            keys = cols < hi
            k = tl.load(
                K + b * k_b + hk * k_h + cols[:, None] * k_n + offs_d[None, :] * k_d,
                mask=keys[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )  # (N, BLOCK_D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # (M, N), natural units
            if HAS_CAP:  # tanh from exp(-2|x|): no overflow at any |x|
                x = s / cap
                e = tl.exp(-2.0 * tl.abs(x))
                t = (1.0 - e) / (1.0 + e)
                s = cap * tl.where(x < 0, -t, t)
            inside = rows[:, None] & keys[None, :]
            if HAS_BIAS:
                at = BIAS + b * bias_b + h[:, None] * bias_h + qi[:, None] * bias_m + cols[None, :] * bias_n
                s += tl.load(at, mask=inside, other=0.0).to(tl.float32)
            valid = inside
            if CAUSAL:  # query i is position i + nk - nq
                valid = valid & (cols[None, :] <= (qi + (nk - nq))[:, None])
            if HAS_KPM:
                pad = tl.load(KPM + b * kpm_b + cols * kpm_n, mask=keys, other=0)
                valid = valid & (pad != 0)[None, :]
            if HAS_AM:
                at = AM + b * am_b + h[:, None] * am_h + qi[:, None] * am_m + cols[None, :] * am_n
                valid = valid & (tl.load(at, mask=inside, other=0) != 0)
            s = tl.where(valid, s * LOG2E, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: p = 0
            p = tl.math.exp2(s - m_safe[:, None])  # (M, N)
            alpha = tl.math.exp2(m_i - m_safe)  # rescales what was summed under the old max
            v = tl.load(
                V + b * v_b + hk * v_h + cols[:, None] * v_n + offs_dv[None, :] * v_d,
                mask=keys[:, None] & (offs_dv[None, :] < DV),
                other=0.0,
            )  # (N, BLOCK_DV)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]  # a row that sees nothing here: 0
        part = (b * hkv + hk) * splits + split  # this program's slot
        at = _at(OUT, part * BLOCK_M * BLOCK_DV, 0, BLOCK_DV, rm, 1, offs_dv)
        tl.store(at, out)
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(L + part * BLOCK_M + rm, lse)


def splits_for(b: int, hkv: int, nk: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """``(splits, span)``: how many key ranges each K/V head is cut into, of ``span`` keys each (a
    multiple of ``block_n``), so that ``B Hkv splits`` programs fill the GPU (a few per SM) while
    each range keeps at least a few tiles. ``O(1)``."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = _INTERPRETED_SMS
    tiles = triton.cdiv(nk, block_n)
    want = triton.cdiv(_PROGRAMS_PER_SM * sms, b * hkv)
    splits = max(1, min(want, tiles // _MIN_TILES_PER_SPLIT))
    span = triton.cdiv(tiles, splits) * block_n
    return triton.cdiv(nk, span), span


def decode_launch(
    q, k, v, out, lse, kpm, am, bias, causal: bool, scale: float, cap, splits: int, span: int, sinks=None
) -> Launch:
    """The kernel's launch (``kernel, grid, args, keywords``, as :func:`variants.chunked_triton.compile_for`
    takes it): ``out (B, Hkv, splits, BLOCK_M, BLOCK_DV)`` and ``lse (B, Hkv, splits, BLOCK_M)``, float32
    and contiguous, are written."""
    b, h, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    block_n, warps, stages = tile(d, dv, h // hkv * nq, q.dtype)
    meta = {
        "D": d,
        "DV": dv,
        "BLOCK_D": _pad(d),
        "BLOCK_DV": _pad(dv),
        "BLOCK_M": _pad(h // hkv * nq),
        "BLOCK_N": block_n,
        "CAUSAL": causal,
        "HAS_KPM": kpm is not None,
        "HAS_AM": am is not None,
        "HAS_BIAS": bias is not None,
        "HAS_CAP": cap is not None,
        "PREC": PREC32 if q.dtype == torch.float32 else "tf32",  # tf32 is ignored for 16-bit inputs
        "HAS_SINK": sinks is not None,
        "num_warps": warps,
        "num_stages": stages,
    }
    sizes = (nq, nk, hkv, h // hkv, span, splits, scale, 1.0 if cap is None else float(cap))
    tensors = (q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *sink_args(sinks, q))
    return _decode, (splits, hkv, b), (*tensors, *_mask_args(kpm, am, bias, q), *sizes), meta


def decode(
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
    """``q (B, H, Nq, D)`` against ``k (B, Hkv, Nk, D)``, ``v (B, Hkv, Nk, Dv)`` (``H % Hkv == 0``, query
    head ``h`` on K/V head ``h // (H / Hkv)``); ``attn_mask`` and ``bias`` as 4-D views ``(B|1, H|1,
    Nq|1, Nk)``; ``sinks (B|1, H, Nq|1)``, a logit per row that joins its softmax for a zero value.
    Returns ``(B, H, Nq, Dv)`` in ``q``'s dtype, no gradient. Call :func:`decode_refusal` first."""
    q, k, v = (_within_32_bits(t) for t in (q, k, v))
    b, h, nq, _ = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    splits, span = splits_for(b, hkv, nk, tile(q.shape[-1], dv, g * nq, q.dtype)[0], q.device)
    rows, width = _pad(g * nq), _pad(dv)
    part = torch.empty(b, hkv, splits, rows, width, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hkv, splits, rows, dtype=torch.float32, device=q.device)  # log2-sum-exp
    _run(
        decode_launch(
            q, k, v, part, lse, key_padding_mask, attn_mask, bias, causal, scale, softcap, splits, span, sinks
        )
    )
    lse = lse * math.log(2)  # (B, Hkv, S, M), natural
    total = torch.logsumexp(lse, dim=2, keepdim=True)  # (B, Hkv, 1, M); -inf: the row saw no key
    weight = torch.exp(lse - total.nan_to_num(neginf=0.0))  # (B, Hkv, S, M); 0 for an empty range
    merged = (weight[..., None] * part).sum(2)  # (B, Hkv, M, BLOCK_DV)
    merged = merged[:, :, : g * nq, :dv]  # (B, Hkv, G Nq, Dv): row g Nq + i is query i of head hk G + g
    return merged.reshape(b, h, nq, dv).to(q.dtype)  # (B, Hkv, G, Nq, Dv) -> (B, H, Nq, Dv)
