"""The float64 oracle of the gated and delta-rule recurrences (``ssd``, ``gla``, ``deltanet``,
``gated_deltanet``), written apart from their chunked form (``gated_core.py``).

Every key is read in blocks of at most :data:`BLOCK_BYTES` of float64 work, repeated to the query
heads and made float64 as it is read, and its gates are computed from that block (a gate given as a
function of the keys): no float64 tensor over all ``Nk`` keys per query head is ever held, so the
oracle's memory is its inputs, ``O(R (D + Dv))`` per head for the ``R`` checked rows and a few blocks
(:func:`gated_oracle_bytes` counts it). A float64 copy of a 128k-key cache on 32 heads of 128 would
be 4 GiB per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from .base import repeat_kv
from .reference import query_positions

#: a few queries: the closed form's O(Nq Nk D) beats the recurrence's O(Nk D Dv) step per key
DENSE_MAX_QUERIES = 64
#: float64 bytes of one block of keys' work (the closed form's (R, keys, D) products, the loop's keys)
BLOCK_BYTES = 2**25
#: blocks' worth of float64 alive at once at the peak, measured with some margin: the closed form's
#: differences, decays and products beside a block's keys, values and the gate's temporaries; the
#: loop's keys, their unit copy, values and gates (each a part of the block) and the gate's temporaries
DENSE_LIVE_BLOCKS = 5
LOOP_LIVE_BLOCKS = 2


def dense_per_key(rows: int, d: int, dv: int, dg: int) -> int:
    """Float64 numbers per key and head in a block of the closed form: the rows' decays ``(R, D|1)``,
    the key and the value."""
    return rows * dg + d + dv


def loop_per_key(d: int, dv: int) -> int:
    """Float64 numbers per key and head in a block of the loop: keys, their unit copy, values, and
    a scalar or vector gate (sized for a vector one)."""
    return 2 * d + dv + 1


#: a gate: ``(B, H, Nk)`` or ``(B, H, Nk, D)`` whole, or a function of a block's keys ``(B, H, kb, D)``
#: float64 (repeated to the query heads) returning that block's ``(B, H, kb[, D])``; None: no gate
Gate = torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None


def softplus_reference(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + e^x)`` in float64, written out (stable for large ``x``)."""
    x = x.double()
    return torch.where(x > 30, x, torch.log1p(torch.exp(torch.clamp(x, max=30))))


def _gate_block(gate: Gate, keys: torch.Tensor, j0: int, j1: int) -> torch.Tensor | None:
    """Float64 gate of keys ``j0:j1``: cut from a whole one, or computed from the block's ``keys``."""
    if gate is None:
        return None
    return (gate(keys) if callable(gate) else gate[:, :, j0:j1]).double()


def block_width(batch: int, heads: int, per_key: int, block_bytes: int = BLOCK_BYTES) -> int:
    """Keys per block such that ``per_key`` float64 numbers per key and head fill ``block_bytes``."""
    return max(1, block_bytes // (8 * batch * heads * per_key))


def _key_blocks(
    k: torch.Tensor, heads: int, width: int, key_padding_mask: torch.Tensor | None
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
    """``(j0, j1, keys (B, H, kb, D) float64, real (B, 1, kb) or None)`` for each block of keys."""
    for j0 in range(0, k.shape[2], width):
        j1 = min(k.shape[2], j0 + width)
        keys = repeat_kv(k[:, :, j0:j1], heads).double()  # (B, H, kb, D): per query head
        real = None if key_padding_mask is None else key_padding_mask[:, None, j0:j1].to(k.device)
        yield j0, j1, keys, real


def gated_oracle_bytes(
    batch: int,
    heads: int,
    rows: int,
    nk: int,
    head_dim: int,
    v_head_dim: int,
    vector_gate: bool,
    delta: bool,
) -> int:
    """Float64 bytes :func:`gated_recurrence_reference` holds beyond its inputs to check ``rows``
    query rows against ``nk`` keys (no graph): the rows' queries, outputs and cumulative gates, the
    state (the loop form), and a few blocks of keys' work (:data:`DENSE_LIVE_BLOCKS`,
    :data:`LOOP_LIVE_BLOCKS`). ``O(1)``."""
    dg = head_dim if vector_gate else 1
    per_head = rows * (head_dim + v_head_dim + dg)
    if not delta and rows <= DENSE_MAX_QUERIES:  # the closed form's block: (R, kb, D|1) products
        per_key, live = dense_per_key(rows, head_dim, v_head_dim, dg), DENSE_LIVE_BLOCKS
    else:  # the loop: a (D, Dv) state and its update, a block of keys, values and gates
        per_head += 4 * head_dim * v_head_dim
        per_key, live = loop_per_key(head_dim, v_head_dim), LOOP_LIVE_BLOCKS
    block = 8 * batch * heads * min(nk, block_width(batch, heads, per_key)) * per_key
    return 8 * batch * heads * per_head + live * block


def gated_graph_bytes(
    batch: int, heads: int, nq: int, nk: int, head_dim: int, v_head_dim: int, vector_gate: bool, delta: bool
) -> int:
    """Float64 bytes :func:`gated_recurrence_reference` holds beyond its inputs for the gradients of
    all ``nq`` rows. The closed form keeps every block's decays and products. The loop, checkpointed
    (:class:`_Segment`), keeps the state at each segment's start and the rows' outputs with their
    upstream gradients, and in the backward one segment's graph (a state per key, the delta rule its
    decayed state too, padding the kept one, and the keys and values per query head): at B=1, H=8,
    D=64, 441 MiB at N=32768 where the graph of every key was 24.5 GiB. ``O(1)``."""
    if not delta and nq <= DENSE_MAX_QUERIES:
        per_key = 4 * nq * (head_dim if vector_gate else 1) + 2 * (head_dim + v_head_dim)
        return 8 * batch * heads * nk * per_key
    state = head_dim * v_head_dim
    width = checkpoint_width(nk)
    saved = -(-nk // width) * state
    segment = width * (3 * state + 2 * (head_dim + v_head_dim))
    return 8 * batch * heads * (saved + segment + nq * 2 * v_head_dim)


def gated_recurrence_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: Gate,
    beta: Gate,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    normalize_keys: bool = False,
    rows: torch.Tensor | None = None,
    params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Float64 gated / delta-rule recurrence (Yang et al. 2024, 2025), causal with the ``Nq`` queries
    as the last positions of the ``Nk`` keys' sequence.

    ``log_decay`` (``g_t``: ``(B, H, Nk)`` or ``(B, H, Nk, D)``, or a function of a block's keys, see
    :data:`Gate`; None: none) and ``beta`` (None: the gated form) are per query head. With ``a_t =
    exp(g_t)``, a state ``S (D, Dv)``: ``S = a_t S``; then ``S = S + k_t v_t^T`` (gated) or ``S = S +
    beta_t k_t (v_t - S^T k_t)^T`` (delta rule, keys L2-normalised when ``normalize_keys``, after
    the gates read them); ``o_t = S^T (s q_t)``. A padded key is skipped (no write, no decay). ``(B,
    H, R, Dv)`` for the query ``rows`` (all ``Nq`` when None); ``O(Nk D Dv)`` per head, token by token
    in a Python loop; memory :func:`gated_oracle_bytes`, with the graph of its gradients
    :func:`gated_graph_bytes`. ``params``: the tensors a gate function reads (a variant's
    parameters), which get their gradients through the loop's checkpoints.

    The gated form with few rows (``R <= DENSE_MAX_QUERIES``: decoding against a long context, a
    check of a few rows) is computed in its closed form instead (:func:`gated_dense_reference`, the same
    numbers without a step per key); a test holds the two forms equal.
    """
    checked = q.shape[2] if rows is None else len(rows)
    if beta is None and not normalize_keys and checked <= DENSE_MAX_QUERIES:
        return gated_dense_reference(
            q, k, v, log_decay=log_decay, key_padding_mask=key_padding_mask, scale=scale, rows=rows
        )
    return gated_loop_reference(
        q, k, v, log_decay, beta, key_padding_mask, scale, normalize_keys, rows, params=params
    )


def checkpoint_width(nk: int) -> int:
    """Keys per checkpointed segment of the loop under autograd: ``ceil(sqrt(Nk))``, so that the
    segments' saved states (one ``(D, Dv)`` per head each) and one segment's graph, recomputed in
    the backward (:func:`gated_graph_bytes`), both grow as ``sqrt(Nk)``. ``O(1)``."""
    return math.isqrt(nk - 1) + 1 if nk > 1 else 1


class _Segment(torch.autograd.Function):
    """A segment of the loop, run without a graph and run again in the backward (a checkpoint).
    Gradients reach its tensor inputs: the state, the rows' queries, keys, values, a whole gate's
    slice and the parameters a gate function reads (handed in as ``params``; the registry-wide tests
    compare a variant's parameters' gradients with the oracle's). Against ``torch.utils.checkpoint``:
    the reentrant form accumulates into ``.grad`` and returns nothing to ``torch.autograd.grad``;
    the other records a graph node per step in the forward, which the allocator's heap does not give
    back (RSS 934 MiB against 418 MiB after the forward at N=4096, B=1, H=8, D=64), in 6x the
    forward's time. A second derivative runs the segment again on the saved inputs themselves, so its
    graph reaches theirs."""

    @staticmethod
    def forward(ctx, run, state, qs, keys, values, gate, *params):
        ctx.run = run
        ctx.save_for_backward(state, qs, keys, values, gate, *params)
        return run(state, qs, keys, values, gate)

    @staticmethod
    def backward(ctx, d_state, d_out):
        second = torch.is_grad_enabled()  # create_graph: the gradients must be differentiable
        saved = ctx.saved_tensors
        # a fresh leaf per tensor input (the parameters stay themselves: the gates read those)
        fresh = [t if t is None or second else t.detach().requires_grad_(t.requires_grad) for t in saved[:5]]
        inputs = [*fresh, *saved[5:]]
        with torch.enable_grad():
            state, out = ctx.run(*fresh)
        wrt = [t for t in inputs if t is not None and t.requires_grad]
        # a segment without kept rows has an output of none, made without a graph
        outs, ups = zip(
            *[(o, g) for o, g in ((state, d_state), (out, d_out)) if o.requires_grad], strict=True
        )
        grads = iter(torch.autograd.grad(outs, wrt, ups, allow_unused=True, create_graph=second))
        return (None, *(next(grads) if t is not None and t.requires_grad else None for t in inputs))


def gated_loop_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: Gate,
    beta: Gate,
    key_padding_mask: torch.Tensor | None,
    scale: float | None,
    normalize_keys: bool,
    rows: torch.Tensor | None = None,
    block_bytes: int = BLOCK_BYTES,
    params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """:func:`gated_recurrence_reference`'s recurrence, one key at a time, whatever ``Nq``, over
    blocks of keys (their gates computed from each block); the output kept at the query ``rows`` only
    (all when None), ``(B, H, R, Dv)``.

    Under autograd each block is a checkpointed segment of :func:`checkpoint_width` keys
    (:class:`_Segment`): the graph keeps the state at each segment's start and the backward runs one
    segment again at a time, so a gradient check holds ``O(sqrt(Nk))`` states, not the graph's three
    per key (24.5 GiB at N=32768, B=1, H=8, D=64), for a second pass of the forward loop. A gate given as
    a function gets its parameters' gradients where they are handed in as ``params``."""
    b, h, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    s = d**-0.5 if scale is None else scale
    # the kept rows' positions in the keys' sequence, in the order of ``rows``, and sorted
    pos = query_positions(nq, nk, rows, q.device)
    steps, order = pos.sort()
    graph = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *params))
    width = block_width(b, h, loop_per_key(d, dv), block_bytes)
    if graph:
        width = min(width, checkpoint_width(nk))
    starts = range(0, nk, width)
    counts = torch.bincount(steps // width, minlength=len(starts)).tolist()  # kept rows per block
    marks = steps.tolist()  # the kept rows' steps, sorted
    # one split per input (a single node in the graph): per-step indexing would give each step's
    # gradient the whole input's size
    q_blocks = q[:, :, steps - (nk - nq)].split(counts, 2)  # (B, H, r, D) each, in position order
    k_blocks, v_blocks = k.split(width, 2), v.split(width, 2)
    whole = None if callable(log_decay) or log_decay is None else log_decay.split(width, 2)

    def run(state, qs, kb, vb, gb, *, j0: int, kept_at: list[int]):
        """The state after keys ``j0:j0+kb`` from ``state`` ``(B, H, D, Dv)``, and the outputs
        ``(B, H, r, Dv)`` of the kept rows among them (at steps ``kept_at``), in position order."""
        j1 = j0 + kb.shape[2]
        keys = repeat_kv(kb, h).double()  # (B, H, kb, D): per query head
        real = None if key_padding_mask is None else key_padding_mask[:, None, j0:j1].to(k.device)
        g = gb.double() if gb is not None else _gate_block(log_decay, keys, j0, j1)  # (B, H, kb[, D])
        strength = _gate_block(beta, keys, j0, j1)  # (B, H, kb)
        values = repeat_kv(vb, h).double()  # (B, H, kb, Dv)
        if normalize_keys:
            keys = keys / keys.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        queries = (s * qs.double()).unbind(2)  # (B, H, D) each
        kept = []
        gates = g.unbind(2) if g is not None else [None] * kb.shape[2]
        for t, (kt, vt, gt) in enumerate(zip(keys.unbind(2), values.unbind(2), gates, strict=True), j0):
            new = state
            if gt is not None:
                a = gt.exp()
                new = new * (a[..., None] if a.dim() == 3 else a[..., None, None])
            u = (
                vt
                if strength is None
                else strength[:, :, t - j0, None] * (vt - (new * kt[..., None]).sum(-2))
            )
            new = new + kt[..., :, None] * u[..., None, :]
            state = new if real is None else torch.where(real[:, :, t - j0, None, None], new, state)
            while len(kept) < len(kept_at) and kept_at[len(kept)] == t:  # this step's rows
                kept.append((state * queries[len(kept)][..., :, None]).sum(-2))  # (B, H, Dv)
        return state, torch.stack(kept, 2) if kept else state.new_zeros(b, h, 0, dv)

    state = q.new_zeros(b, h, d, dv, dtype=torch.float64)
    outs = []  # (B, H, r, Dv) per block, the rows in position order
    done = 0
    for i, j0 in enumerate(starts):
        block = partial(run, j0=j0, kept_at=marks[done : done + counts[i]])
        done += counts[i]
        call = (state, q_blocks[i], k_blocks[i], v_blocks[i], None if whole is None else whole[i])
        state, out = _Segment.apply(block, *call, *params) if graph else block(*call)
        outs.append(out)
    return torch.cat(outs, 2)[:, :, torch.argsort(order)]  # position order -> the order of ``rows``


def gated_dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: Gate,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    block_bytes: int = BLOCK_BYTES,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 gated recurrence (no delta rule) in its closed form: for the query at position ``i``
    (the ``Nq`` queries are the last positions of the ``Nk`` keys' sequence),

        o_i = sum_{j <= i} ((s q_i) * e^{G_i - G_j}) . k_j  v_j,    G_t = sum_{u <= t} g_u

    over real keys (a padded key adds nothing to ``G`` and is in no sum); a scalar ``g`` multiplies
    the whole product, a vector ``g`` feature by feature. Two passes over blocks of keys of at most
    ``block_bytes`` of float64 work each: the first finds ``G`` at the queries, the second sums.
    ``(B, H, R, Dv)`` for the query ``rows`` (all ``Nq`` when None); ``O(R Nk D)`` time.
    """
    h, nq0 = q.shape[1], q.shape[2]
    q = (q if rows is None else q[:, :, rows]).double()  # (B, H, R, D)
    b, _, nq, d = q.shape
    nk, dv = k.shape[2], v.shape[-1]
    s = d**-0.5 if scale is None else scale
    pos = query_positions(nq0, nk, rows, q.device)  # (R,): the queries' positions
    probe = _gate_block(log_decay, repeat_kv(k[:, :, :1], h).double(), 0, 1)  # the first key's gate
    dg = d if probe is not None and probe.dim() == 4 else 1  # a vector gate, or a scalar one
    width = block_width(b, h, dense_per_key(nq, d, dv, dg), block_bytes)

    def cumulative() -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """``(j0, j1, keys (B, H, kb, D), G (B, H, kb, D|1))`` block by block, ``G`` carried over."""
        carry = 0.0
        for j0, j1, keys, real in _key_blocks(k, h, width, key_padding_mask):
            g = _gate_block(log_decay, keys, j0, j1)
            # each g at least -1000: e^-1000 is 0 in float64 as e^g was, and G then never grows so
            # large that its differences lose their digits (a decay of -1e24 beside ones of -0.01
            # would leave none)
            g = keys.new_zeros(b, h, j1 - j0) if g is None else g.clamp(min=-1000.0)
            g = g if g.dim() == 4 else g[..., None]  # (B, H, kb, D|1)
            if real is not None:
                g = torch.where(real[..., None], g, 0.0)
                keys = torch.where(real[..., None], keys, 0.0)
            big = carry + g.cumsum(2)  # (B, H, kb, D|1): G_t
            carry = big[:, :, -1:]
            yield j0, j1, keys, big

    at_queries = None  # (B, H, R, D|1): G at each query's position
    for j0, j1, _, big in cumulative():
        if at_queries is None:
            at_queries = big.new_zeros(b, h, nq, big.shape[-1])
        inside = (pos >= j0) & (pos < j1)
        at_queries[:, :, inside] = big[:, :, pos[inside] - j0]
    qs = s * q  # (B, H, R, D)
    out = q.new_zeros(b, h, nq, dv)
    for j0, j1, keys, big in cumulative():
        seen = pos[:, None] >= torch.arange(j0, j1, device=q.device)[None, :]  # (R, kb)
        diff = at_queries[:, :, :, None, :] - big[:, :, None, :, :]  # (B, H, R, kb, D|1): G_i - G_j
        decay = diff.masked_fill(~seen[..., None], float("-inf")).exp()  # 0 for a key after the query
        del diff
        values = repeat_kv(v[:, :, j0:j1], h).double()  # (B, H, kb, Dv)
        if decay.shape[-1] == 1:  # scalar: (s q_i . k_j) e^{G_i - G_j}
            weights = (qs @ keys.transpose(-1, -2)) * decay[..., 0]  # (B, H, R, kb)
        else:
            weights = (qs[:, :, :, None, :] * decay * keys[:, :, None, :, :]).sum(-1)  # (B, H, R, kb)
        out = out + weights @ values
    return out
