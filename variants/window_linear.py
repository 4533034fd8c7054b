"""``window_linear``: softmax attention over a sliding window plus linear attention over the keys
further back, the composition Based uses (Arora et al. 2024, "Simple linear attention language
models balance the recall-throughput tradeoff"), causal only.

For the query at position ``p`` (bottom-right: ``p = i + Nk - Nq``), window ``w`` and scale ``s``:

    near_p = softmax_{p - w <= j <= p}(s q_p . k_j) v_j                     (local_window's band)
    far_p  = sum_{j <= p - w - 1} phi(q_p) . phi(k_j) v_j / sum_{j <= p - w - 1} phi(q_p) . phi(k_j)
    out_p  = near_p + far_p

so every causal key is read once: exactly by the window when near, through ``linear``'s feature map
``phi`` (``elu1`` by default, scaled by ``s``) when farther; a query with no key beyond the window has
``far = 0``. Based interleaves separate window and linear layers (and a Taylor feature map, and short
convolutions); here the two are one core, so the recall frontier can compare it head to head with
the others at the same model size.

Both parts are the suite's own cores, unchanged: ``local_window`` for ``near`` (``O(N w D)``), and
``linear``'s chunked causal form for ``far``, called on the queries shifted ``w + 1`` positions past
the keys (``q[t0:]`` against ``k[:Nk - w - 1]``, bottom-right aligned: query ``p`` then sees exactly
the keys ``j <= p - w - 1``), ``O(N chunk D + N D Dv)``. Time and memory linear in ``N``.

Packed documents (``documents=`` ids) go to both parts: the window stops at a document's edges, and
the far call gets the ids of its keys, so its state starts empty at each document; a query whose
document begins after ``p - w - 1`` (inside its window) has no far key, and its far part is zeroed.
What a packed call means is each document run alone, as its oracle checks.

Decoding keeps the last ``w`` keys and values (a fixed-size window cache, with a mask of which slots
hold real keys) and the ``D x (Dv + 1)`` linear state per K/V head of the keys that left the window: a
state whose size does not grow with the context. Shapes: ``q (B, H, Nq, D)``, ``k (B, Hkv, Nk, D)``,
``v (B, Hkv, Nk, Dv)`` -> ``(B, H, Nq, Dv)``; key padding and grouped K/V heads are taken, an
arbitrary ``attn_mask`` and a ``bias`` are refused (the far part never forms the scores).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as fn

from .base import AttentionVariant, Unsupported, Workload
from .linear import FEATURE_MAPS, LinearAttention
from .linear_core import absorb, decode_workload, refuse_pairwise, work_dtype
from .local_window import LocalWindowAttention
from .reference import window_linear_reference
from .registry import register


@dataclass
class WindowLinearState:
    """What ``window_linear`` keeps while decoding ``B`` sequences: the last ``w`` keys and values
    (slot ``w - 1`` the newest; slots before the context's start or padded are marked not ``valid``)
    and the linear state of every key before them. Its size does not depend on the context."""

    k_win: torch.Tensor  # (B, Hkv, w, D), the input dtype
    v_win: torch.Tensor  # (B, Hkv, w, Dv)
    valid: torch.Tensor  # (B, w) bool: the slot holds a real key
    far_kv: torch.Tensor  # (B, Hkv, D, Dv + 1), the work dtype: sum_j phi(k_j) [v_j, 1]^T (a group's
    # query heads read one: phi(k) is the key's alone)
    length: int  # positions consumed, padded ones included
    scale: float  # the score scale, fixed at prefill


@register("window_linear")
class WindowLinear(AttentionVariant):
    """Softmax over the ``window`` nearest keys plus normalised linear attention over the rest."""

    exact = False
    supports_noncausal = False  # refused in check with the reason
    supports_cross = False
    supports_attn_mask = False  # refused with the reason by refuse_pairwise
    supports_state = True
    native_gqa = True  # both parts read grouped heads themselves
    native_scale = True  # the scale goes to both parts
    # a window of 3 with several linear chunks; a window of 0 (the far part reads every earlier key);
    # relu features with a wider window
    example_knobs = (
        {"window": 3, "chunk": 5},
        {"window": 0, "chunk": 8},
        {"window": 5, "feature_map": "relu", "chunk": 64},
    )

    def __init__(self, window: int = 64, feature_map: str = "elu1", chunk: int = 64) -> None:
        super().__init__()
        self.near = LocalWindowAttention(window=window)  # validates window
        self.far = LinearAttention(feature_map=feature_map, normalize=True, chunk=chunk)  # and the rest
        self.window = window

    def knobs(self) -> dict[str, object]:
        return {"window": self.window, "feature_map": self.far.feature_map, "chunk": self.far.chunk}

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d["impl_ran"] = self.near.impl_ran  # the window part's implementation
        return d

    def check(self, w: Workload) -> None:
        refuse_pairwise("window_linear", w)
        if not w.causal and not w.cross:  # (cross: refused as such by the base class)
            raise Unsupported(
                "window_linear is causal only: its far part is causal linear attention over the keys "
                "left of the window (pass causal=True)"
            )
        super().check(w)

    def _far_split(self, nq: int, nk: int) -> tuple[int, int]:
        """``(t0, cut)``: queries ``t0..`` have keys beyond the window, which are ``k[:cut]``; the
        shifted call ``far(q[t0:], k[:cut])`` is bottom-right aligned with ``Nq - t0 <= cut``."""
        w = self.window
        return max(0, w + 1 - (nk - nq)), nk - w - 1

    def native_documents(self, w: Workload) -> bool:
        """Both parts take packed documents: the window stops at a document's edges, and the far
        part's state starts empty at each document (see :meth:`_attend`)."""
        return True

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask, scale=None, documents=None):
        out = self.near(
            q, k, v, causal=True, key_padding_mask=key_padding_mask, scale=scale, documents=documents
        )
        nq, nk = q.shape[2], k.shape[2]
        t0, cut = self._far_split(nq, nk)
        if t0 >= nq or cut < 1:
            return out  # no query has a key beyond its window
        kpm = None if key_padding_mask is None else key_padding_mask[:, :cut]  # (B, cut)
        # no scale: the far part is normalised linear attention, in which it cancels (and linear refuses
        # a scale it cannot honour)
        far = self.far(
            q[:, :, t0:],
            k[:, :, :cut],
            v[:, :, :cut],
            causal=True,
            key_padding_mask=kpm,
            documents=None if documents is None else documents[:, :cut],  # (B, cut)
        )  # (B, H, Nq - t0, Dv)
        if documents is not None:
            # the shifted call's query i stands at p - w - 1 (p its own position) and sees the keys of
            # that position's document; a query whose document starts after p - w - 1 has no key
            # beyond its window: its far part is zero
            p = torch.arange(t0, nq, device=q.device) + (nk - nq)  # (Nq - t0,): the queries' positions
            ids = documents.to(q.device)
            same = ids[:, p] == ids[:, p - self.window - 1]  # (B, Nq - t0)
            far = far * same[:, None, :, None]  # (B, H, Nq - t0, Dv)
        return out + fn.pad(far, (0, 0, t0, 0))  # (B, H, Nq, Dv): zeros for the first t0 queries

    def oracle_forward(
        self, q, k, v, *, causal=True, key_padding_mask=None, attn_mask=None, scale=None, rows=None
    ) -> torch.Tensor:
        """Float64, written densely (``window_linear_reference``), ``(B, H, R, Dv)`` for
        the query ``rows`` (all ``Nq`` when None)."""
        if attn_mask is not None or not causal:
            raise Unsupported("window_linear is causal only and takes no attn_mask")
        return window_linear_reference(
            q,
            k,
            v,
            window=self.window,
            feature_map=self.far.feature_map,
            key_padding_mask=key_padding_mask,
            scale=scale,
            rows=rows,
        )

    # ------------------------------------------------------------------ the decoding state
    def _phi_k(self, k: torch.Tensor, scale: float, valid: torch.Tensor | None) -> torch.Tensor:
        """``phi(k)`` for ``k (B, Hkv, N, D)``, 0 where not ``valid (B, 1, N)``."""
        _, kf, _, _ = self.far._features(None, k, scale, valid, 0, None, True)
        return kf  # (B, Hkv, N, D)

    def prefill(self, k, v, *, key_padding_mask=None, scale=None, heads=None) -> WindowLinearState:
        """The state after the context ``k (B, Hkv, N, D)``: its last ``w`` keys in the window cache,
        the earlier ones summed into the linear state, ``O(N D Dv)``."""
        heads = heads or k.shape[1]
        wl = decode_workload(self, heads, k, v, key_padding_mask, scale)
        b, hkv, n, d = k.shape
        s = wl.head_dim**-0.5 if scale is None else float(scale)
        work = work_dtype(k.dtype)
        kpm = (
            torch.ones(b, n, dtype=torch.bool, device=k.device)
            if key_padding_mask is None
            else key_padding_mask
        )
        cut = max(0, n - self.window)
        kf = self._phi_k(k[:, :, :cut].to(work), s, kpm[:, None, :cut])  # (B, Hkv, cut, D)
        vals = self.far._values(v[:, :, :cut].to(work))  # (B, Hkv, cut, Dv + 1)
        far_kv, _ = absorb(kf, vals, None, None, None, None)  # (B, Hkv, D, Dv + 1)
        pad = self.window - (n - cut)  # empty slots before the context's start
        k_win = fn.pad(k[:, :, cut:], (0, 0, pad, 0))  # (B, Hkv, w, D)
        v_win = fn.pad(v[:, :, cut:], (0, 0, pad, 0))  # (B, Hkv, w, Dv)
        valid = fn.pad(kpm[:, cut:], (pad, 0), value=False)  # (B, w)
        return WindowLinearState(k_win, v_win, valid, far_kv, n, s)

    def step(self, q, k_new, v_new, state) -> tuple[torch.Tensor, WindowLinearState]:
        """The causal output of the ``T`` new positions and the state after them, one position at a
        time: softmax over the window cache and the new key, plus the linear state read by
        ``phi(q)``; then the key leaving the window joins the linear state. ``O(T (w D + D Dv))``."""
        if state is None:
            state = self.prefill(k_new[:, :, :0], v_new[:, :, :0], heads=q.shape[1])
        w = Workload.of(q, k_new, v_new, causal=True, scale=state.scale)
        if w.nq != w.nk:
            raise ValueError(f"step takes as many new keys as queries; got {w.nq} queries, {w.nk} keys")
        self.check(w)
        b, h, hkv = w.batch, w.heads, w.hkv
        if state.far_kv.shape[:2] != (b, hkv) or state.k_win.dtype != q.dtype:
            raise ValueError(
                f"the state holds {tuple(state.far_kv.shape[:2])} (B, Hkv) in {state.k_win.dtype}; the "
                f"step's k is ({b}, {hkv}) in {q.dtype}"
            )
        work, g = state.far_kv.dtype, h // hkv
        k_win, v_win, valid, far_kv = state.k_win, state.v_win, state.valid, state.far_kv
        real = valid.new_ones(w.batch, 1)  # (B, 1): a new key is always real
        outs = []
        for t in range(w.nq):
            # a group's g query heads as rows against its K/V head: no repeated keys, values or state
            qt = q[:, :, t].to(work).view(b, hkv, g, -1)  # (B, H, D) -> (B, Hkv, g, D)
            kb = torch.cat([k_win, k_new[:, :, t : t + 1]], 2)  # (B, Hkv, w + 1, D)
            vb = torch.cat([v_win, v_new[:, :, t : t + 1]], 2)  # (B, Hkv, w + 1, Dv)
            vb_valid = torch.cat([valid, real], 1)  # (B, w + 1)
            scores = (qt @ kb.to(work).transpose(-1, -2)) * state.scale  # (B, Hkv, g, w + 1)
            scores = scores.masked_fill(~vb_valid[:, None, None, :], float("-inf"))
            near = scores.softmax(-1) @ vb.to(work)  # (B, Hkv, g, Dv)
            qf = FEATURE_MAPS[self.far.feature_map][0](qt) * state.scale  # (B, Hkv, g, D), as linear's
            far = self.far._finish(qf @ far_kv)  # (B, Hkv, g, Dv)
            outs.append((near + far).view(b, h, 1, -1))  # (B, Hkv, g, Dv) -> (B, H, 1, Dv)
            # the oldest slot leaves the window and joins the linear state (if it holds a real key)
            kf = self._phi_k(kb[:, :, :1].to(work), state.scale, vb_valid[:, None, :1])  # (B, Hkv, 1, D)
            vals = self.far._values(vb[:, :, :1].to(work))  # (B, Hkv, 1, Dv + 1)
            far_kv, _ = absorb(kf, vals, None, None, far_kv, None)
            k_win, v_win, valid = kb[:, :, 1:], vb[:, :, 1:], vb_valid[:, 1:]
        out = torch.cat(outs, 2).to(q.dtype)  # (B, H, T, Dv)
        return out, dataclasses.replace(
            state, k_win=k_win, v_win=v_win, valid=valid, far_kv=far_kv, length=state.length + w.nq
        )

    def state_bytes(self, w: Workload) -> int:
        """The window cache (``Hkv w (D + Dv)`` elements of ``w.dtype`` and ``w`` mask bytes) and ``Hkv``
        linear states of ``D x (Dv + 1)`` in the work dtype: independent of ``w.nk``."""
        elem = torch.empty((), dtype=w.dtype).element_size()
        work = torch.empty((), dtype=work_dtype(w.dtype)).element_size()
        cache = w.hkv * self.window * (w.head_dim + w.v_head_dim) * elem + self.window
        return cache + w.hkv * w.head_dim * (w.v_head_dim + 1) * work

    def flops(self, w: Workload, mode: str = "fwd") -> int:
        """The window's FLOPs plus the linear part's on its shifted call."""
        t0, cut = self._far_split(w.nq, w.nk)
        far = 0
        if t0 < w.nq and cut >= 1:
            far = self.far.flops(dataclasses.replace(w, nq=w.nq - t0, nk=cut), mode)
        return self.near.flops(w, mode) + far
