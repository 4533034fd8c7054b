"""The gated and delta-rule recurrences that ``ssd``, ``gla``, ``deltanet`` and ``gated_deltanet`` share.

Per head, a state ``S (Dk, Dv)`` runs over the positions ``t``; with log decay ``g_t <= 0`` (a scalar,
or a vector over ``Dk``), write strength ``beta_t`` in (0, 1) (delta rule only) and the scaled query
``s q_t``:

    gated:       S_t = diag(a_t) S_{t-1} + k_t v_t^T,                          a_t = exp(g_t)
    delta rule:  S_t = (I - beta_t k_t k_t^T) (a_t S_{t-1}) + beta_t k_t v_t^T
    output:      o_t = S_t^T (s q_t)

(the delta rule's state in the issue's orientation is ``S^T``). Both are one recurrence
``S_t = a_t S_{t-1} + k_t u_t^T`` with values ``u_t = v_t`` (gated) or ``u_t = beta_t (v_t - (a_t
S_{t-1})^T k_t)`` (delta rule). A padded key is a token that is not there: no write, no decay.

:func:`chunked_recurrence` is the chunked parallel form (the published one: GLA's for the gates,
DeltaNet's WY representation for the delta rule). In a chunk of ``c`` positions, with ``G`` the
chunk-local cumulative log decay (through position ``i``, inclusive):

- every output is ``o_i = (q_i * e^{G_i}) . S_0 + sum_{j <= i} (q_i . k_j) e^{G_i - G_j} u_j`` (``S_0``
  the state before the chunk; a vector decay multiplies feature by feature);
- delta rule: the chunk's values solve a unit lower-triangular system, ``(I + L) U = diag(beta) (V -
  e^G K S_0)`` with ``L_ij = beta_i e^{G_i - G_j} (k_i . k_j)`` for ``j < i``, so ``U = U_0 - W S_0`` with
  ``U_0``, ``W`` computed for every chunk at once (one batched triangular solve); only ``W S_0`` waits
  for the state;
- the state after the chunk is ``e^{G_c} S_0 + sum_j (k_j e^{G_c - G_j}) u_j^T``.

Everything but the state's carry is batched over all chunks; the carry is a loop over the ``N / c``
chunks of ``O(Dk Dv)`` work each (``O(c Dk Dv)`` with the delta rule's ``W S_0``). Time ``O(N c (Dk +
Dv) + N Dk Dv)`` (``+ O(N c (Dk + Dv))`` for the solve), memory ``O(N c + (N / c) Dk Dv)``, never an
``N x N`` tensor. ``chunk=1`` is the recurrent form, ``chunk >= N`` the parallel form.

A vector decay is split as ``q e^{G}`` and ``k e^{-G}`` inside a chunk (GLA's form): ``e^{-G}`` grows
with the chunk, so a variant with vector gates bounds ``g`` from below (``gla``: ``g >= -1``, and
``chunk <= 64``: ``e^{64}`` is far inside float32).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as fn

from .base import AttentionVariant, Unsupported, Workload, repeat_kv
from .gated_reference import Gate, gated_graph_bytes, gated_oracle_bytes, gated_recurrence_reference
from .linear_core import (
    KernelState,
    chunk_segments,
    decode_workload,
    refuse_pairwise,
    step_workload,
    work_dtype,
)
from .masks import document_starts

NEG_INF = float("-inf")


def chunked_recurrence(
    q: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    chunk: int,
    s0: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The recurrence above over ``N`` positions, in chunks of ``chunk``.

    ``q (B, H, N, Dk)`` already scaled, or None (a prefill: the state only); ``k (B, H, N, Dk)``;
    ``v (B, H, N, Dv)``; ``g`` the log decay ``(B, H, N)`` (scalar) or ``(B, H, N, Dk)`` (vector), or
    None (no decay); ``beta (B, H, N)`` for the delta rule, or None; ``s0 (B, H, Dk, Dv)`` the state
    before the first position, or None (zeros); ``starts (B, N)`` boolean, True where a packed
    document begins (its position sees no state from before it: ``S_{t-1}`` is dropped), or None.
    Returns ``(o (B, H, N, Dv) or None, S_N (B, H, Dk, Dv))``. The delta rule takes a scalar decay only.

    A document start inside a chunk splits it into segments (``seg``: how many starts lie at or before a
    position in its chunk): a pair counts only within one segment, a query reads the state before the
    chunk only in segment 0, and the state after the chunk keeps only the last segment's writes (and
    the state before, if no start lies in the chunk). Nothing else changes, so the cost is the same.
    """
    b, h, n, dk = k.shape
    dv = v.shape[-1]
    vector = g is not None and g.dim() == 4
    if vector and beta is not None:
        raise ValueError("the delta rule's chunked form here takes a scalar decay per position")
    c = max(1, min(chunk, n))
    m = -(-n // c)
    pad = m * c - n
    if pad:  # positions after the end: no key, no value, no decay, no write
        k, v = fn.pad(k, (0, 0, 0, pad)), fn.pad(v, (0, 0, 0, pad))  # (B, H, m c, Dk|Dv)
        q = None if q is None else fn.pad(q, (0, 0, 0, pad))
        if g is not None:
            g = fn.pad(g, (0, 0, 0, pad)) if vector else fn.pad(g, (0, pad))
        if beta is not None:
            beta = fn.pad(beta, (0, pad))
        if starts is not None:
            starts = fn.pad(starts, (0, pad))
    kc = k.view(b, h, m, c, dk)  # (B, H, m c, Dk) -> (B, H, m, c, Dk)
    vc = v.view(b, h, m, c, dv)  # (B, H, m, c, Dv)
    qc = None if q is None else q.view(b, h, m, c, dk)  # (B, H, m, c, Dk)
    lower = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()  # (c, c): j <= i
    strict = torch.ones(c, c, dtype=torch.bool, device=k.device).tril(-1)  # (c, c): j < i
    first = last = None  # packed documents: which positions read the state before, which write the after
    if starts is not None:
        same, first, last, keep = chunk_segments(starts, m, c)
        lower, strict = lower & same, strict & same  # (B, 1, m, c, c)

    # --- decay factors within each chunk
    if g is None:
        decay_end, q_in, k_out, gam = None, qc, kc, None
    elif vector:
        big = g.view(b, h, m, c, dk).cumsum(3)  # (B, H, m, c, Dk): G_i, chunk-local
        end = big[:, :, :, -1:]  # (B, H, m, 1, Dk)
        decay_end = end.squeeze(3).exp()  # (B, H, m, Dk)
        k_out = kc * (end - big).exp()  # (B, H, m, c, Dk): k_j e^{G_c - G_j} <= k_j
        q_in = None if qc is None else qc * big.exp()  # q_i e^{G_i}
        gam = None
    else:
        # in float64: a chunk's G reaches thousands under strong decays, where a float32 difference
        # G_i - G_j of two neighbours would keep ~3 digits (vector gates are bounded instead),
        # and each g at least -1e4 (e^-1e4 is 0 in every float type, so nothing changes): decays of
        # 1e20 beside decays of 1 would leave no digit of G_i - G_j even in float64
        big = g.view(b, h, m, c).double().clamp(min=-1e4).cumsum(3)  # (B, H, m, c): G_i, chunk-local
        end = big[..., -1:]  # (B, H, m, 1)
        decay_end = end.squeeze(3).exp().to(k.dtype)  # (B, H, m)
        k_out = kc * (end - big).exp().to(k.dtype)[..., None]  # (B, H, m, c, Dk)
        q_in = None if qc is None else qc * big.exp().to(k.dtype)[..., None]
        gam = None
        if qc is not None or beta is not None:  # a prefill of the gated form needs no pairs
            # the difference in float64, the exponential in the work dtype (in place: a (c, c)
            # matrix per chunk and head is the largest tensor here, and fresh pages cost more than exp)
            diff = (big[..., :, None] - big[..., None, :]).to(k.dtype)  # (B, H, m, c, c): G_i - G_j
            gam = diff.masked_fill_(~lower, NEG_INF).exp_()  # e^{G_i - G_j} for j <= i, else 0
    q_read = q_in  # the queries as they read the state before their chunk
    if starts is not None:  # a document's first chunk reads no state before it, its last writes one
        k_out = k_out * last[..., None]  # (B, H, m, c, Dk)
        q_read = None if q_in is None else q_in * first[..., None]
        carry = keep.to(k.dtype)  # (B, 1, m)
        decay_end = carry if decay_end is None else decay_end * (carry[..., None] if vector else carry)

    # --- the values each chunk writes: v (gated), or U_0 - W S_0 (delta rule)
    if beta is not None:
        bc = beta.view(b, h, m, c, 1)  # (B, H, m, c, 1)
        kk = kc @ kc.transpose(-1, -2)  # (B, H, m, c, c)
        lmat = bc * (kk if gam is None else kk * gam)
        lmat = lmat.masked_fill(~strict, 0.0) + torch.eye(c, dtype=k.dtype, device=k.device)  # I + L
        ke = kc if g is None else kc * big.exp().to(k.dtype)[..., None]  # (B, H, m, c, Dk): e^{G_i} k_i
        if first is not None:
            ke = ke * first[..., None]  # only a chunk's first document follows the state before it
        rhs = bc * torch.cat([vc, ke], -1)  # (B, H, m, c, Dv + Dk)
        x = torch.linalg.solve_triangular(lmat, rhs, upper=False, unitriangular=True)
        u0, w = x[..., :dv], x[..., dv:]  # (B, H, m, c, Dv), (B, H, m, c, Dk)

    # --- the state across chunks
    state = s0 if s0 is not None else k.new_zeros(b, h, dk, dv)  # (B, H, Dk, Dv)
    # the states before each chunk and the delta rule's values, kept only for the outputs (a prefill
    # keeping them would hold m states)
    keep = qc is not None
    befores: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    if beta is None:
        # each chunk's writes in the loop, not batched: all chunks' (Dk, Dv) writes at once would be
        # another (B, H, m, Dk, Dv) tensor, as large as the states before them (4 GiB at 128k keys, 32
        # heads of 128), for no time saved. unbind, not indexing in the loop: each index's backward
        # would allocate the whole gradient
        steps = zip(k_out.unbind(2), vc.unbind(2), _unbind(decay_end, m), strict=True)
        for ko_t, v_t, a_t in steps:
            if keep:
                befores.append(state)
            state = ko_t.transpose(-1, -2) @ v_t + (state if a_t is None else _decayed(state, a_t))
    else:
        steps = zip(u0.unbind(2), w.unbind(2), k_out.unbind(2), _unbind(decay_end, m), strict=True)
        for u0_t, w_t, ko_t, a_t in steps:
            u_t = u0_t - w_t @ state  # (B, H, c, Dv)
            if keep:
                befores.append(state)
                writes.append(u_t)
            state = ko_t.transpose(-1, -2) @ u_t + (state if a_t is None else _decayed(state, a_t))
    if qc is None:
        return None, state
    before = torch.stack(befores, 2)  # (B, H, m, Dk, Dv): the state before each chunk
    u = vc if beta is None else torch.stack(writes, 2)  # (B, H, m, c, Dv)
    if vector:
        k_in = kc * (-big).exp()  # (B, H, m, c, Dk): e^{-G_j} <= e^{c |g_min|}
        scores = (q_in @ k_in.transpose(-1, -2)).masked_fill(~lower, 0.0)  # (B, H, m, c, c)
    else:
        scores = qc @ kc.transpose(-1, -2)  # (B, H, m, c, c)
        scores = scores.masked_fill(~lower, 0.0) if gam is None else scores * gam
    out = (q_read @ before).add_(scores @ u)  # (B, H, m, c, Dv); in place: matmul keeps no output
    return out.reshape(b, h, m * c, dv)[:, :, :n], state  # (B, H, m, c, Dv) -> (B, H, N, Dv)


#: positions per pass when a long context only leaves a state (prefill, the keys before the queries)
SEGMENT = 8192


def _upto(x: torch.Tensor | None, a: int, b: int | None) -> torch.Tensor | None:
    """Positions ``a:b`` of a ``(B, 1, N)`` validity mask or ``(B, N)`` document starts (None stays
    None)."""
    return None if x is None else x[..., a:b]


def _unbind(x: torch.Tensor | None, m: int) -> list[torch.Tensor | None] | tuple[torch.Tensor, ...]:
    """``x (B, H, m[, Dk])`` split along its chunk dimension, or ``m`` Nones."""
    return [None] * m if x is None else x.unbind(2)


def _decayed(state: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``diag(a) S`` for ``S (B, H, Dk, Dv)`` and ``a (B, H)`` (scalar) or ``(B, H, Dk)`` (vector)."""
    return state * (a[..., None] if a.dim() == 3 else a[..., None, None])


def recurrence_flops(n: int, dk: int, dv: int, chunk: int, delta: bool, queries: bool = True) -> int:
    """FLOPs of :func:`chunked_recurrence` over ``n`` positions of one batch element and head, as it
    computes them: the chunks' writes ``2 N Dk Dv``; with ``queries``, the intra-chunk scores ``2 N c
    Dk``, their product with the values ``2 N c Dv`` and the reading of the state ``2 N Dk Dv`` (a
    prefill, ``queries=False``, has none of these); the delta rule adds ``K K^T`` (``2 N c Dk``), the
    triangular solve (``N c (Dv + Dk)``) and ``W S_0`` (``2 N Dk Dv``). ``c = min(chunk, N)``, and ``N``
    rounded up to whole chunks, as computed (the last chunk is padded)."""
    c = max(1, min(chunk, n))
    n = -(-n // c) * c
    flops = 2 * n * dk * dv
    if queries:
        flops += 2 * n * c * (dk + dv) + 2 * n * dk * dv
    if delta:
        flops += 2 * n * c * dk + n * c * (dv + dk) + 2 * n * dk * dv
    return flops


class GatedRecurrence(AttentionVariant):
    """What the gated and delta-rule variants share: the forward (causal, bottom-right), the decoding
    state and its size, the FLOPs and the refusals. Each supplies its gates from the keys
    (:meth:`_gates`) and its gate FLOPs (:meth:`_gate_flops`); ``delta`` says whether it is a delta rule
    (its keys are L2-normalised).

    The gates are projections of the key (the core is handed ``q, k, v``, not the token: a key is a
    linear map of its token, so a projection of it is one of the token too), per query head.
    """

    exact = False  # a recurrence, not softmax attention
    supports_noncausal = False  # a recurrence runs over the past (refused in check with the reason)
    supports_cross = False  # the queries are positions of the keys' sequence (Nq <= Nk)
    supports_attn_mask = False  # refused with the reason by refuse_pairwise
    supports_state = True
    native_scale = True  # the scale multiplies q
    has_params = True
    #: the delta rule (keys L2-normalised, the write strength beta)
    delta: ClassVar[bool] = False
    #: a decay per key feature (gla), not one per head and position
    vector_gate: ClassVar[bool] = False
    chunk: int = 64

    def oracle_bytes(self, w: Workload, rows: int | None = None) -> int:
        """What the float64 recurrence holds: a few blocks of keys' work and the checked rows (all when
        ``rows`` is None), never a float64 copy of the inputs or a (rows, keys) tensor
        (:func:`~variants.gated_reference.gated_oracle_bytes`). ``O(1)``."""
        sizes = (w.batch, w.heads, self.oracle_rows(w, rows), w.nk, w.head_dim, w.v_head_dim)
        return gated_oracle_bytes(*sizes, self.vector_gate, self.delta)

    def oracle_graph_bytes(self, w: Workload, rows: int | None = None) -> int:
        """The checkpointed recurrence's graph (:func:`~variants.gated_reference.gated_graph_bytes`),
        counted for every row whatever ``rows`` (it runs over every key before the last checked row;
        all rows at once cost little more), and float64 ``q``, ``k``, ``v`` with their gradients
        twice (each segment's, then summed). ``O(1)``."""
        sizes = (w.batch, w.heads, w.nq, w.nk, w.head_dim, w.v_head_dim)
        return gated_graph_bytes(*sizes, self.vector_gate, self.delta) + 3 * self._oracle_input_bytes(w)

    def check(self, w: Workload) -> None:
        who = self.name or type(self).__name__
        refuse_pairwise(who, w)
        if not w.causal and not w.cross:  # (cross: refused as such by the base class)
            raise Unsupported(f"{who} is a recurrence over the past: causal only (pass causal=True)")
        if w.head_dim != self.head_dim or w.heads != self.heads:
            raise Unsupported(
                f"{who} was built for heads={self.heads}, head_dim={self.head_dim} (its gate "
                f"projections); got heads={w.heads}, head_dim={w.head_dim}"
            )
        super().check(w)

    def _keep_sizes(self, heads: int, head_dim: int, chunk: int) -> None:
        """Check and keep the sizes every gated variant is built with (one ``ValueError`` line)."""
        if heads < 1 or head_dim < 1 or chunk < 1:
            raise ValueError(f"heads, head_dim and chunk must be >= 1; got {heads}, {head_dim}, {chunk}")
        self.heads, self.head_dim, self.chunk = heads, head_dim, chunk

    def oracle_forward(
        self, q, k, v, *, causal=True, key_padding_mask=None, attn_mask=None, scale=None, rows=None
    ) -> torch.Tensor:
        """The float64 recurrence token by token (:func:`~variants.gated_reference.
        gated_recurrence_reference`) with this instance's gates in float64 (:meth:`_reference_gates`),
        keys L2-normalised for a delta rule, ``(B, H, R, Dv)`` for the query ``rows`` (all ``Nq`` when
        None); the parameters get their gradients through it."""
        if attn_mask is not None or not causal:
            who = self.name or type(self).__name__
            raise Unsupported(f"{who} is a causal recurrence: no attn_mask, no non-causal form")
        log_decay, beta = self._reference_gates()
        return gated_recurrence_reference(
            q,
            k,
            v,
            log_decay=log_decay,
            beta=beta,
            key_padding_mask=key_padding_mask,
            scale=scale,
            normalize_keys=self.delta,
            rows=rows,
            params=tuple(self.parameters()),
        )

    def _reference_gates(self) -> tuple[Gate, Gate]:
        """``(log_decay, beta)`` for the oracle: float64 functions of a block of keys ``(B, H, kb, D)``
        per query head (:data:`~variants.gated_reference.Gate`), written apart from :meth:`_gates`;
        None where the variant has none."""
        raise NotImplementedError

    def _gates(self, k: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(g, beta)`` for keys ``k (B, H, N, D)`` in the work dtype: the log decay ``(B, H, N)`` or
        ``(B, H, N, D)`` (None: none) and the delta rule's write strength ``(B, H, N)`` (None)."""
        raise NotImplementedError

    def _gate_flops(self, w: Workload) -> int:
        """FLOPs of the gates for every key of ``w``."""
        raise NotImplementedError

    def _inputs(
        self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(k, v, g, beta)`` for the core from keys and values ``(B, H, N, D|Dv)`` in the work dtype;
        ``valid (B, 1, N)`` marks real keys: a padded one writes nothing and decays nothing."""
        g, beta = self._gates(k)
        if self.delta:
            k = fn.normalize(k, dim=-1, eps=1e-6)  # (B, H, N, D): unit keys
        if valid is not None:
            k = torch.where(valid[..., None], k, 0.0)
            v = torch.where(valid[..., None], v, 0.0)
            if g is not None:
                g = torch.where(valid[..., None] if g.dim() == 4 else valid, g, 0.0)
            if beta is not None:
                beta = torch.where(valid, beta, 0.0)
        return k, v, g, beta

    def native_documents(self, w: Workload) -> bool:
        # the state is dropped where a document begins (the chunks split there): no mask, no extra work
        return True

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None, documents=None):
        work = work_dtype(q.dtype)
        s = q.shape[-1] ** -0.5 if scale is None else scale
        valid = None if key_padding_mask is None else key_padding_mask[:, None, :]  # (B, 1, Nk)
        starts = None if documents is None else document_starts(documents)  # (B, Nk)
        # the queries are the last Nq positions: the earlier ones are only the state they leave
        ctx = k.shape[2] - q.shape[2]
        s0 = None
        if ctx:
            s0 = self._context_state(
                k[:, :, :ctx], v[:, :, :ctx], _upto(valid, 0, ctx), work, starts=_upto(starts, 0, ctx)
            )
        kk, vv, g, beta = self._inputs(
            k[:, :, ctx:].to(work), v[:, :, ctx:].to(work), _upto(valid, ctx, None)
        )
        out, _ = chunked_recurrence(q.to(work) * s, kk, vv, g, beta, self.chunk, s0, _upto(starts, ctx, None))
        return out.to(q.dtype)

    def _context_state(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor | None,
        work: torch.dtype,
        heads: int = 0,
        starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The state ``(B, H, Dk, Dv)`` after keys ``k (B, Hkv, N, Dk)`` and values ``v``, ``valid (B, 1,
        N)`` or None, documents beginning at ``starts (B, N)`` or None, taken :data:`SEGMENT` positions
        at a time (gates, repeated heads and the chunks' temporaries of one segment at once: a
        128k-key context on 32 heads would otherwise hold several GiB per tensor). The recurrence
        carries across segments exactly."""
        heads = heads or k.shape[1]
        state = None
        for a in range(0, k.shape[2], SEGMENT):
            b = min(a + SEGMENT, k.shape[2])
            kk, vv = (repeat_kv(x[:, :, a:b], heads).to(work) for x in (k, v))  # (B, H, seg, Dk|Dv)
            inputs = self._inputs(kk, vv, _upto(valid, a, b))
            _, state = chunked_recurrence(None, *inputs, self.chunk, state, _upto(starts, a, b))
        return state

    # ------------------------------------------------------------------ the decoding state
    def prefill(self, k, v, *, key_padding_mask=None, scale=None, heads=None) -> KernelState:
        """The state after the context (see :meth:`AttentionVariant.prefill`): the chunked form
        without queries, ``O(N (c + Dk) Dv)``; ``N = 0`` gives the empty state."""
        heads = heads or k.shape[1]
        w = decode_workload(self, heads, k, v, key_padding_mask, scale)
        work = work_dtype(k.dtype)
        s = w.head_dim**-0.5 if scale is None else float(scale)
        valid = None if key_padding_mask is None else key_padding_mask[:, None, :]  # (B, 1, N)
        state = self._context_state(k, v, valid, work, heads) if w.nk else None
        if state is None:  # no context: the empty state
            state = k.new_zeros(k.shape[0], heads, w.head_dim, w.v_head_dim, dtype=work)
        return KernelState(state, None, w.nk, s)

    def step(self, q, k_new, v_new, state) -> tuple[torch.Tensor, KernelState]:
        """The causal output of the ``T`` new positions and the state after them (see
        :meth:`AttentionVariant.step`): the chunked form started from the state."""
        if state is None:
            state = self.prefill(k_new[:, :, :0], v_new[:, :, :0], heads=q.shape[1])
        w = step_workload(self, q, k_new, v_new, state)
        work = state.kv.dtype
        k, v = repeat_kv(k_new, w.heads), repeat_kv(v_new, w.heads)  # (B, H, T, D|Dv)
        kk, vv, g, beta = self._inputs(k.to(work), v.to(work), None)
        out, s = chunked_recurrence(q.to(work) * state.scale, kk, vv, g, beta, self.chunk, state.kv)
        return out.to(q.dtype), KernelState(s, None, state.length + w.nk, state.scale)

    def state_bytes(self, w: Workload) -> int:
        """``H`` heads of a ``Dk x Dv`` state: independent of ``w.nk``."""
        elem = torch.empty((), dtype=work_dtype(w.dtype)).element_size()
        return w.heads * w.head_dim * w.v_head_dim * elem

    def flops(self, w: Workload, mode: str = "fwd") -> int:
        """The gates, the keys' normalisation (delta rule) and the chunked recurrence
        (:func:`recurrence_flops`): over the ``Nq`` query positions, and the ``Nk - Nq`` keys before
        them as the state they leave (no scores, no reads: :meth:`_context_state`, in segments of
        :data:`SEGMENT`), for every batch element and head; not pairs. Backward counts 2.5x forward as
        elsewhere."""
        core = recurrence_flops(w.nq, w.head_dim, w.v_head_dim, self.chunk, self.delta)
        for a in range(0, w.nk - w.nq, SEGMENT):  # each segment's chunks: c = min(chunk, its length)
            seg = min(SEGMENT, w.nk - w.nq - a)
            core += recurrence_flops(seg, w.head_dim, w.v_head_dim, self.chunk, self.delta, queries=False)
        norm = 3 * w.nk * w.head_dim if self.delta else 0
        fwd = w.batch * w.heads * (core + norm + w.nq * w.head_dim) + self._gate_flops(w)
        return int(fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode])

    def knobs(self) -> dict[str, object]:
        return {"chunk": self.chunk}


def init_uniform_(p: torch.Tensor, bound: float) -> None:
    """``p`` uniform in ``[-bound, bound]`` (deterministic given torch's global seed)."""
    with torch.no_grad():
        p.uniform_(-bound, bound)


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """``x`` with ``softplus(x) = y`` (``y > 0``): ``y + log(-expm1(-y))``."""
    return y + torch.log(-torch.expm1(-y))


def dt_init(heads: int, lo: float = 1e-3, hi: float = 1e-1) -> torch.Tensor:
    """Mamba's time-step bias: ``softplus(bias)`` log-uniform in ``[lo, hi]`` per head, ``(H,)``."""
    u = torch.rand(heads)
    return inverse_softplus(torch.exp(u * (math.log(hi) - math.log(lo)) + math.log(lo)))
