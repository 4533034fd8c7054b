"""Mask helpers shared by the variants: combining masks and a softmax that is safe on empty rows."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def combined_mask(
    batch: int,
    nq: int,
    nk: int,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor | None:
    """Boolean mask (True = may attend) broadcastable to ``(B, H, Nq, Nk)``, or None for no mask.

    Shape is ``(B or 1, H or 1, Nq, Nk)``. Memory ``O(B * Nq * Nk)`` bytes when any mask is given.
    """
    mask: torch.Tensor | None = None
    if causal:
        # bottom-right: query i is position i + Nk - Nq of the keys' sequence
        mask = torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq)[None, None]  # (1,1,Nq,Nk)
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(device)[:, None, None, :]  # (B, 1, 1, Nk)
        mask = kpm if mask is None else mask & kpm
    if attn_mask is not None:
        am = attn_mask.to(device)
        while am.dim() < 4:  # broadcast (Nq, Nk) or (H, Nq, Nk) up to 4-D
            am = am.unsqueeze(0)
        mask = am if mask is None else mask & am
    if mask is not None and mask.shape[-2:] != (nq, nk):
        mask = mask.expand(*mask.shape[:-2], nq, nk)
    return mask


def document_mask(documents: torch.Tensor, nq: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, 1, Nq, Nk)`` boolean, True where query and key lie in the same packed document, from the
    ids ``documents (B, Nk)`` (one per key position; the queries are the last ``Nq``); with ``rows``
    (1-D query indices) only those rows, ``(B, 1, R, Nk)``. ``O(B R Nk)``."""
    q_ids = documents[:, documents.shape[1] - nq :]  # (B, Nq)
    if rows is not None:
        q_ids = q_ids[:, rows]  # (B, R)
    return (q_ids[:, :, None] == documents[:, None, :])[:, None]  # (B, R, Nk) -> (B, 1, R, Nk)


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """``(B, Nk)`` boolean, True at each position that begins a packed document after the first, from
    the ids ``documents (B, Nk)``: where a recurrence drops its state. Each document must be one
    contiguous run, since a state cannot rejoin a document it has left (the mask would join two runs
    with one id): on the CPU a row that reuses an id is one ``ValueError`` naming it; on a device the
    check is an asynchronous assert (no wait for the stream). ``O(B Nk log Nk)``."""
    starts = F.pad(documents[:, 1:] != documents[:, :-1], (1, 0))  # (B, Nk)
    ordered = documents.sort(-1).values  # (B, Nk)
    distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(-1)  # (B,): distinct ids less one
    reused = distinct != starts.sum(-1)  # (B,): fewer distinct ids than runs
    if documents.device.type == "cpu":
        if reused.any():
            row = int(reused.nonzero()[0])
            raise ValueError(f"documents: row {row} gives one id to two separate runs; number each run apart")
    else:
        torch._assert_async(~reused.any(), "documents: a row gives one id to two separate runs")
    return starts


def document_bounds(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, last)``, each ``(B, Nk)``: the first and the last position of the packed document
    holding each position, from :func:`document_starts`' ``starts (B, Nk)``. ``O(B Nk)``."""
    nk = starts.shape[1]
    pos = torch.arange(nk, device=starts.device).expand_as(starts)  # (B, Nk)
    first = torch.where(starts, pos, 0).cummax(1).values  # (B, Nk): the latest start at or before
    ends = F.pad(starts[:, 1:], (0, 1), value=True)  # (B, Nk): True where a document ends
    last = torch.where(ends, pos, nk - 1).flip(1).cummin(1).values.flip(1)  # the earliest end at or after
    return first, last


def attend_each_document(
    attend: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each packed document of ``documents (B, Nk)`` (ids, each document one run: checked by
    :func:`document_starts`) as a sequence of its own: ``attend(q_d, k_d, v_d, kpm_d)`` on its queries
    ``(1, H, n_q, D)`` (its positions among the last ``Nq``, as ``q (B, H, Nq, D)`` holds them), its
    keys and values ``(1, Hkv, n_k, D|Dv)`` and their padding mask (or None), joined into ``(B, H, Nq,
    Dv)``. One call per document that holds queries; reads the boundaries on the host.

    ``rows`` (1-D query indices): only those rows, ``(B, H, R, Dv)`` in their order; each document is
    called with ``rows=`` its own among its queries (indices into ``q_d``), and one without any is not
    called."""
    document_starts(documents)
    b, nq, nk = q.shape[0], q.shape[2], k.shape[2]
    first = nk - nq  # the first query's position
    out = []
    for i in range(b):
        _, counts = torch.unique_consecutive(documents[i], return_counts=True)
        parts, start = [], 0
        kept = None  # (1, H, R, Dv) in the dtype the calls return
        for n in counts.tolist():
            end, a = start + n, max(start, first)
            if a < end:  # the document holds queries
                kpm = None if key_padding_mask is None else key_padding_mask[i : i + 1, start:end]
                keys = (k[i : i + 1, :, start:end], v[i : i + 1, :, start:end])  # (1, Hkv, n_k, D|Dv)
                mine = q[i : i + 1, :, a - first : end - first]  # (1, H, n_q, D)
                if rows is None:
                    parts.append(attend(mine, *keys, kpm))  # (1, H, n_q, Dv)
                else:
                    local = rows.to(q.device) - (a - first)  # the rows' indices among its queries
                    inside = (local >= 0) & (local < end - a)
                    if inside.any():
                        got = attend(mine, *keys, kpm, rows=local[inside])  # (1, H, R_d, Dv)
                        if kept is None:
                            kept = got.new_zeros(1, got.shape[1], len(rows), got.shape[-1])
                        kept[:, :, inside] = got
            start = end
        if rows is not None and kept is None:  # no rows asked
            kept = q.new_zeros(1, q.shape[1], 0, v.shape[-1])
        out.append(torch.cat(parts, dim=2) if rows is None else kept)  # (1, H, Nq|R, Dv)
    return torch.cat(out, dim=0)


def safe_softmax(scores: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim restricted to ``allowed``; rows with no allowed key give zeros.

    Unlike ``masked_fill(-inf)`` + softmax (NaN on empty rows) or filling with the dtype minimum
    (a uniform average), this returns exact zeros with zero, finite gradients.
    """
    if allowed is None:
        return torch.softmax(scores, dim=-1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    # the max is only for stability: detach it (softmax does not depend on it) and use 0 for empty rows
    m = scores.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)
    s = e.sum(dim=-1, keepdim=True)
    return e / torch.where(s > 0, s, torch.ones_like(s))


def empty_rows(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``(B|1, H|1, Nq, 1)`` True where a query row can see no key at all, or None without a mask."""
    if mask is None:
        return None
    return ~mask.any(dim=-1, keepdim=True)


def softmax_blocked_(scores: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` with the ``blocked`` entries (True) left out.

    Same result as :func:`safe_softmax` on every row that has an allowed key, in about
    a third of its passes over memory: ``scores`` is overwritten in place (pass a fresh tensor, such as
    a matmul output, which autograd does not keep) and the fused ``torch.softmax`` does the rest.
    Blocked entries get the dtype's minimum rather than -inf, so a row with no allowed key comes out
    as a finite uniform average instead of NaN: the caller must zero those rows **at its output**
    (see :func:`zero_empty_rows`), which is cheaper than touching the probabilities again and gives
    them zero gradients.
    """
    if blocked is not None:
        scores = scores.masked_fill_(blocked, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1)


def zero_empty_rows(out: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """``out (..., M, Dv)`` with exact zeros (and zero gradients) where ``blocked (..., M, K)`` blocks a
    whole row: the "no visible key -> zeros" rule after :func:`softmax_blocked_`."""
    if blocked is None:
        return out
    empty = blocked.all(dim=-1, keepdim=True)  # (..., M, 1)
    return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)


def additive_mask(blocked: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused kernel's additive mask for ``blocked (..., Lq, Lk)`` (True = left out: -inf) and the
    rows that see no key ``(..., Lq, 1)`` (on the CPU None when there are none). Such a row is let see
    key 0, so the kernel makes no NaN; the caller zeroes it in the output, which also zeroes its
    gradients. Off the CPU the empty rows are not counted: reading a device value on the host would
    stall the stream each call and cannot be captured in a CUDA graph."""
    empty = blocked.all(dim=-1, keepdim=True)  # (..., Lq, 1)
    if blocked.device.type != "cpu" or bool(empty.any()):
        blocked = blocked & ~(empty & (torch.arange(blocked.shape[-1], device=blocked.device) == 0))
    else:
        empty = None
    bias = torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill_(blocked, float("-inf"))
    return bias, empty


def sdpa_blocked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocked: torch.Tensor, enable_gqa: bool = False
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with the ``blocked`` entries (True) left out, zeros on rows
    that see nothing.

    ``q (G, M, Lq, D)``, ``k (G, M, Lk, D)``, ``v (G, M, Lk, Dv)``; ``blocked`` 4-D, broadcastable to
    ``(G, M, Lq, Lk)`` (4-D so the CPU takes its fused flash kernel, not the math path). A row with no
    visible key would come out NaN: it is let see key 0 and zeroed after, which also zeroes its
    gradients. Returns ``(G, M, Lq, Dv)``. ``enable_gqa``: ``k`` and ``v`` have fewer heads (dim 1)
    than ``q``, each shared by a group of them (SDPA's own grouping, no copy).
    """
    bias, empty = additive_mask(blocked, q.dtype)
    gqa = {"enable_gqa": True} if enable_gqa else {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, **gqa)  # (G, M, Lq, Dv)
    return out if empty is None else out.masked_fill(empty, 0.0)


#: bytes of gathered keys, values and mask per call of the fused kernel: chunks this size are reused
#: from the C allocator's heap, while one large buffer per call (above glibc's mmap threshold, at most
#: 32 MiB) is fresh pages every call (at N=8192, sparse fwd: 254 ms in one piece, 134 ms in chunks
#: of 8-16 query blocks, measured on this project's CPU)
CHUNK_BYTES = 16 * 2**20


def blocks_per_chunk(bytes_per_block: int, total_blocks: int) -> int:
    """How many query blocks to hand the fused kernel at once (at least 1, at most all)."""
    return max(1, min(total_blocks, CHUNK_BYTES // max(1, bytes_per_block)))


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes ``(H,)`` (Press et al., 2022, "Train Short, Test Long"): the geometric
    sequence ``2^(-8/H), 2^(-16/H), ...`` for ``H`` a power of two; otherwise that sequence for the
    power of two below ``H`` followed by every other slope of the one for twice that power."""
    p = 2 ** math.floor(math.log2(heads))
    slopes = [2 ** (-8 * (i + 1) / p) for i in range(p)]
    extra = [2 ** (-4 * (i + 1) / p) for i in range(2 * p)][0::2][: heads - p]
    return torch.tensor(slopes + extra, dtype=torch.float64)


def alibi_bias(
    heads: int,
    nq: int,
    nk: int,
    *,
    causal: bool = True,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """ALiBi's additive bias ``(1, H, Nq, Nk)``: ``-slope_h * |p - j|`` for the query at position
    ``p = i + Nk - Nq`` (the queries are the last ``Nq`` positions) and key ``j``. Causal attention
    masks ``j > p`` anyway, so one formula serves both. Memory ``O(H Nq Nk)``."""
    p = torch.arange(nk - nq, nk, device=device, dtype=torch.float64)[:, None]  # (Nq, 1) positions
    j = torch.arange(nk, device=device, dtype=torch.float64)[None, :]  # (1, Nk)
    dist = (p - j).abs()  # (Nq, Nk)
    return (-alibi_slopes(heads).to(device)[:, None, None] * dist).to(dtype)[None]  # (1, H, Nq, Nk)
