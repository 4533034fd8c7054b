"""The attention patterns of the pattern variants, each defined once, as plain functions.

A pattern is which (query, key) pairs may interact; call-time masks (key padding, ``attn_mask``)
come on top of it. Each pattern is written here as a ``mask_mod``-style predicate ``(q_idx, kv_idx)
-> bool tensor`` on broadcastable index tensors (what FlexAttention's block masks are built from,
:mod:`variants.flex_kernel`), with its dense ``(Nq, Nk)`` boolean form (the predicate on the whole
grid: what ``pattern()`` returns and the float64 oracle reads) and its pair count (analytic where
there is one: FLOPs are counted from it).

Positions follow DESIGN.md with ``Nq <= Nk`` aligned bottom-right: query ``i`` is position ``i + Nk -
Nq`` of the keys' sequence (the last ``Nq`` positions: decoding, a prefill onto a cache), and causal
masking keeps key ``j`` iff ``j <= i + Nk - Nq``. (With ``Nq > Nk``, which neither pattern variant
takes, query ``i`` is position ``i``.)

- The sliding-window **band** (``local_window``; Longformer, Beltagy et al., 2020): the query at
  position ``p`` sees key ``j`` iff ``|p - j| <= window``; with ``sink_tokens = s > 0`` also every key
  ``j < s`` (StreamingLLM's attention sinks, Xiao et al., 2023: the first tokens stay visible to every
  query), a key in both counted once.
- The **block-sparse layout** (``sparse``; BigBird, Zaheer et al., 2020, plus the Sparse Transformer's
  strided blocks, Child et al., 2019): a table of key blocks per query block (:func:`block_layout`),
  its ``(nb, nb)`` block matrix (:func:`layout_blocks`), and the token-level pattern of that matrix.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from .base import causal_offset

#: ``(q_idx, kv_idx) -> bool``: True where the query may see the key (broadcastable index tensors)
MaskMod = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _first_position(nq: int, nk: int) -> int:
    """Position of query 0 in a pattern's sequence: the queries are its last ``Nq`` positions."""
    return max(0, nk - nq)


def dense(mask_mod: MaskMod, nq: int, nk: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The predicate on every pair: boolean ``(Nq, Nk)``. Time and memory ``O(Nq Nk)``."""
    return mask_mod(torch.arange(nq, device=device)[:, None], torch.arange(nk, device=device)[None, :])


def causal_mask_mod(nq: int, nk: int) -> MaskMod:
    """Causal masking, bottom-right aligned: key ``j`` visible to query ``i`` iff ``j <= i + Nk - Nq``."""
    off = causal_offset(nq, nk)
    return lambda qi, ki: ki <= qi + off


# ------------------------------------------------------------------------------------ the band
def band_mask_mod(nq: int, nk: int, window: int, causal: bool, sink_tokens: int = 0) -> MaskMod:
    """The band as a predicate: the query at position ``p = i + Nk - Nq`` sees key ``j`` iff ``|p - j|
    <= window`` or ``j < sink_tokens`` (the attention sinks), and ``j <= p`` if causal. ``O(1)`` per
    pair."""
    off = _first_position(nq, nk)

    def seen(qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        near = (qi + off - ki).abs() <= window
        # band OR sinks in one predicate: a key in both is one pair, never two
        return near | (ki < sink_tokens) if sink_tokens > 0 else near

    if not causal:
        return seen
    past = causal_mask_mod(nq, nk)
    return lambda qi, ki: seen(qi, ki) & past(qi, ki)


def band_pattern(nq: int, nk: int, window: int, causal: bool, sink_tokens: int = 0) -> torch.Tensor:
    """The band (and sinks) on every pair: boolean ``(Nq, Nk)`` (:func:`band_mask_mod`). ``O(Nq Nk)``."""
    return dense(band_mask_mod(nq, nk, window, causal, sink_tokens), nq, nk)


def band_pairs(nq: int, nk: int, window: int, causal: bool, sink_tokens: int = 0) -> int:
    """Number of pairs (query position ``p``, key ``j < nk``) with ``|p - j| <= window`` or ``j <
    sink_tokens`` (and ``j <= p`` if causal), the queries at positions ``off .. off + nq - 1`` with
    ``off = max(0, nk - nq)``.

    The band is summed diagonal by diagonal (``d = p - j``): diagonal ``d`` holds ``min(off + nq, nk +
    d) - max(off, d)`` pairs. Each sink key ``j`` then adds the queries outside its band: ``p > j +
    window`` (always after ``j``, so causal keeps them all) and, not causal, ``p < j - window``. Cost
    ``O(window + sink_tokens)``, not ``O(nq * nk)``.
    """
    off = _first_position(nq, nk)
    end = off + nq  # one past the last query position
    lo = 0 if causal else -min(window, nk - 1)  # causal keeps d >= 0; diagonals past the edge are empty
    hi = min(window, end - 1)
    pairs = sum(max(0, min(end, nk + d) - max(off, d)) for d in range(lo, hi + 1))
    for j in range(min(sink_tokens, nk)):  # sink keys: the queries whose band misses them
        pairs += max(0, end - max(off, j + window + 1))
        if not causal:
            pairs += max(0, min(end, j - window) - off)
    return pairs


# ------------------------------------------------------------------------- the block-sparse layout
def block_layout(
    nb: int,
    window_blocks: int,
    global_blocks: int,
    random_blocks: int,
    seed: int,
    causal: bool = False,
    stride_blocks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-block table of a BigBird layout (plus optional strided blocks) over ``nb`` blocks.

    Returns ``(index, valid)``, both ``(nb, S)`` with ``S = 2 wb + 1 + g + t + r`` slots per query
    block (``wb``, ``g``, ``r`` the knobs clipped to what ``nb`` blocks allow; ``t = ceil(nb /
    stride_blocks)``, 0 without a stride): slots ``[0, 2wb]`` are the window (offsets ``-wb .. wb``),
    then ``g`` global slots, then the strided slots (every block ``j`` with ``(i - j) % stride_blocks
    == 0`` outside the window and global blocks: the Sparse Transformer's strided pattern, Child et
    al. 2019), then ``r`` random slots drawn from the blocks left. ``valid`` is False for a slot off
    the end, repeating an earlier one or unused; its ``index`` is then a harmless 0. Global query
    rows are not marked here (they see everything). ``causal`` keeps strided and random blocks in
    the past (before the window), where a causal query can use them. Cost ``O(nb * (S + nb))``.
    """
    wb = min(window_blocks, nb - 1)
    g = min(global_blocks, nb)
    r = min(random_blocks, max(0, nb - g))
    t = -(-nb // stride_blocks) if stride_blocks > 0 else 0
    width = 2 * wb + 1 + g + t + r
    rng = random.Random(seed)  # one stream, rows in order: the same (nb, knobs) give the same table
    index = torch.zeros(nb, width, dtype=torch.long)
    valid = torch.zeros(nb, width, dtype=torch.bool)
    for i in range(nb):
        row = list(range(i - wb, i + wb + 1))  # window slots, may fall off either end
        ok = [0 <= c < nb for c in row]
        row += list(range(g))  # global slots; those already in the window are duplicates
        ok += [abs(i - c) > wb for c in range(g)]
        lo, hi = max(i - wb, g), min(i + wb, nb - 1)  # the window's blocks outside the global ones
        # the blocks not seen yet, in order: g..nb-1 minus the window (causal: only g..lo-1)
        rest = [j for j in range(g, lo if causal else nb) if not lo <= j <= hi]
        strided = [j for j in rest if stride_blocks > 0 and (i - j) % stride_blocks == 0]
        row += strided + [0] * (t - len(strided))
        ok += [True] * len(strided) + [False] * (t - len(strided))
        taken = set(strided)
        rest = [j for j in rest if j not in taken]
        chosen = [rest[x] for x in sorted(rng.sample(range(len(rest)), min(r, len(rest))))]
        row += chosen + [0] * (r - len(chosen))
        ok += [True] * len(chosen) + [False] * (r - len(chosen))
        index[i] = torch.tensor([c if o else 0 for c, o in zip(row, ok, strict=True)])
        valid[i] = torch.tensor(ok)
    return index, valid


def layout_blocks(index: torch.Tensor, valid: torch.Tensor, global_blocks: int) -> torch.Tensor:
    """Boolean ``(nb, nb)``: which key blocks each query block sees, from a :func:`block_layout` table
    ``(nb, S)``, the first ``global_blocks`` query rows seeing every block. ``O(nb^2)``."""
    nb = index.shape[0]
    blocks = torch.zeros(nb, nb, dtype=torch.bool)
    blocks[torch.arange(nb)[:, None].expand_as(index)[valid], index[valid]] = True
    blocks[: min(global_blocks, nb)] = True
    return blocks


def layout_mask_mod(nq: int, nk: int, blocks: torch.Tensor, block: int, causal: bool) -> MaskMod:
    """The layout as a predicate: the query at position ``p = i + Nk - Nq`` sees key ``j`` iff
    ``blocks[p // block, j // block]`` (and ``j <= p`` if causal). ``blocks (nb, nb)`` is read where
    the indices are (put it on their device); ``O(1)`` per pair."""
    off = _first_position(nq, nk)
    if not causal:
        return lambda qi, ki: blocks[(qi + off) // block, ki // block]
    past = causal_mask_mod(nq, nk)
    return lambda qi, ki: blocks[(qi + off) // block, ki // block] & past(qi, ki)


def layout_pattern(nq: int, nk: int, blocks: torch.Tensor, block: int, causal: bool) -> torch.Tensor:
    """The layout on every pair: boolean ``(Nq, Nk)`` (:func:`layout_mask_mod`). ``O(Nq Nk)``."""
    return dense(layout_mask_mod(nq, nk, blocks, block, causal), nq, nk, blocks.device)


def layout_pairs(
    n: int, index: torch.Tensor, valid: torch.Tensor, block: int, global_blocks: int, causal: bool
) -> int:
    """Number of pairs of the layout of self-attention over ``n`` tokens in ``block``-wide blocks,
    from its :func:`block_layout` table ``(nb, S)``: ``O(nb S)``, not ``O(n^2)``."""
    b = block
    nb = index.shape[0]
    g = min(global_blocks, nb)
    ng = min(g * b, n)
    # global query rows see every key (or every earlier one)
    total = ng * (ng + 1) // 2 if causal else ng * n
    # other rows: sum over their valid slots of (query rows) x (key columns) of the block pair
    rows = torch.arange(nb)[:, None].expand_as(index)
    sel = valid & (rows >= g)
    qi, kj = rows[sel], index[sel]
    qlen = (n - qi * b).clamp(max=b)
    klen = (n - kj * b).clamp(max=b)
    if causal:
        per = torch.where(kj < qi, qlen * klen, torch.where(kj == qi, qlen * (qlen + 1) // 2, 0))
    else:
        per = qlen * klen
    return total + int(per.sum())
