"""Fused SDPA over gathered key blocks, chunk by chunk, with a backward that keeps no gathered copy.

Block-sparse attention on a dense kernel: query block ``i`` (``b`` queries) is scored against its own
``L`` keys, gathered by token index from K and V; every query block is one "head" of PyTorch's fused
``scaled_dot_product_attention`` with an additive mask. Query blocks go a chunk at a time
(:data:`~variants.masks.CHUNK_BYTES`), so the gathered copies are one chunk's size.

Under autograd, saving each chunk's gathered keys and values for the backward would keep copies of K
and V ``L / b`` times their size (sparse at N=16384: 2.1x local_window's fwd+bwd peak for 1.5x its
pairs). :class:`_GatheredSdpa` saves only the inputs, the output and the kernel's log-sum-exp; the
backward gathers each chunk again, runs the fused kernel's own backward on it (on the CPU,
``_scaled_dot_product_flash_attention_for_cpu_backward``, which needs one head size for keys and
values; elsewhere the chunk's forward is recomputed under autograd) and adds the chunk's key and value
gradients back into place (``index_add_``).
Time ``O(B H nr b L D)``; memory ``O(B H nr b Dv)`` for the output and one chunk's copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import first_order_only
from .masks import additive_mask, blocks_per_chunk

#: under autograd a chunk is 1 / GRAD_SHARE of the forward's: its backward holds the gathered copies,
#: their gradients and the kernel's buffers at once (sparse fwd+bwd at N=1024, B=1, H=8, D=64, on this
#: project's CPU: peak 43.8 MiB with forward-sized chunks, 20.8 MiB with a quarter, time within 10%)
GRAD_SHARE = 4


def _chunk_inputs(q, k, v, key_idx, blocked, s, m):
    """Chunk ``s .. s+m`` of the query blocks as the fused kernel's 4-D operands: queries
    ``(B*H, m, b, D)``, gathered keys and values ``(B*H, m, L, D|Dv)``, the additive mask
    ``(B*H|1, m, b|1, L)`` and the rows that see no key ``(B*H|1, m, b, 1)`` (None when none: such a
    row is let see its first key and zeroed after, so the kernel never makes NaN)."""
    bsz, h, _, b, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    grp = h // hkv
    ii = key_idx[s : s + m].reshape(-1)  # (m*L,)
    ln = key_idx.shape[1]
    # each K/V head to its G query heads: a copy of the gathered keys only (a view when G = 1)
    kg = k.index_select(2, ii).view(bsz, hkv, 1, m, ln, d).expand(bsz, hkv, grp, m, ln, d)
    vg = v.index_select(2, ii).view(bsz, hkv, 1, m, ln, dv).expand(bsz, hkv, grp, m, ln, dv)
    bc = blocked[..., s : s + m, :, :]  # (m, b|1, L) or (B, 1, m, b|1, L)
    if bc.dim() == 5:  # key padding: per batch element, repeated over heads
        bc = bc.expand(bsz, h, *bc.shape[2:]).reshape(bsz * h, *bc.shape[2:])  # (B*H, m, b|1, L)
    else:
        bc = bc[None]  # (1, m, b|1, L)
    bias, empty = additive_mask(bc, q.dtype)  # (B*H|1, m, b|1, L), (B*H|1, m, b|1, 1) or None
    return (
        q[:, :, s : s + m].reshape(bsz * h, m, b, d),  # (B*H, m, b, D)
        kg.reshape(bsz * h, m, ln, d),  # (B*H, m, L, D)
        vg.reshape(bsz * h, m, ln, dv),  # (B*H, m, L, Dv)
        bias,
        empty,
    )


def _forward(q, k, v, key_idx, blocked, step, scale, keep_lse):
    """The output ``(B, H, nr, b, Dv)`` and, with ``keep_lse`` on the CPU, the per-chunk log-sum-exp."""
    bsz, h, nr, b, _ = q.shape
    outs, lses = [], []
    for s in range(0, nr, step):
        m = min(step, nr - s)
        qc, kg, vg, bias, empty = _chunk_inputs(q, k, v, key_idx, blocked, s, m)
        if keep_lse and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]:  # the op's own limits
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qc, kg, vg, attn_mask=bias, scale=scale
            )  # (B*H, m, b, Dv), (B*H, m, b)
            lses.append(lse)
        else:
            o = F.scaled_dot_product_attention(qc, kg, vg, attn_mask=bias, scale=scale)  # (B*H, m, b, Dv)
        if empty is not None:
            o = o.masked_fill(empty, 0.0)
        outs.append(o.view(bsz, h, m, b, -1))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (B, H, nr, b, Dv)
    return out, lses


class _GatheredSdpa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_idx, blocked, step, scale):
        out, lses = _forward(q, k, v, key_idx, blocked, step, scale, keep_lse=True)
        ctx.save_for_backward(q, k, v, out, key_idx, blocked, *lses)
        ctx.step, ctx.scale = step, scale
        return out

    @staticmethod
    @first_order_only  # its gradients carry no graph: a second derivative is refused, never wrong
    def backward(ctx, grad_out):
        q, k, v, out, key_idx, blocked, *lses = ctx.saved_tensors
        step, scale = ctx.step, ctx.scale
        bsz, h, nr, b, d = q.shape
        hkv, dv, ln = k.shape[1], v.shape[-1], key_idx.shape[1]
        grp = h // hkv
        dq = torch.empty_like(q)  # (B, H, nr, b, D)
        dk = torch.zeros_like(k)  # (B, Hkv, N, D)
        dv_ = torch.zeros_like(v)  # (B, Hkv, N, Dv)
        for c, s in enumerate(range(0, nr, step)):
            m = min(step, nr - s)
            qc, kg, vg, bias, empty = _chunk_inputs(q, k, v, key_idx, blocked, s, m)
            go = grad_out[:, :, s : s + m].reshape(bsz * h, m, b, dv)  # (B*H, m, b, Dv)
            if empty is not None:  # those rows were zeroed after the kernel: no gradient flows back
                go = go.masked_fill(empty, 0.0)
            if lses:
                oc = out[:, :, s : s + m].reshape(bsz * h, m, b, dv)  # (B*H, m, b, Dv)
                gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    go.contiguous(), qc, kg, vg, oc, lses[c], 0.0, False, attn_mask=bias, scale=scale
                )
            else:  # no stored log-sum-exp: the chunk's forward again, under autograd
                with torch.enable_grad():
                    qc, kg, vg = (t.detach().requires_grad_() for t in (qc, kg, vg))
                    o = F.scaled_dot_product_attention(qc, kg, vg, attn_mask=bias, scale=scale)
                    gq, gk, gv = torch.autograd.grad(o, (qc, kg, vg), go)
            dq[:, :, s : s + m] = gq.reshape(bsz, h, m, b, d)
            ii = key_idx[s : s + m].reshape(-1)  # (m*L,)
            # the G query heads of a K/V head summed, then added to the keys they were gathered from
            dk.index_add_(2, ii, gk.reshape(bsz, hkv, grp, m * ln, d).sum(2))
            dv_.index_add_(2, ii, gv.reshape(bsz, hkv, grp, m * ln, dv).sum(2))
        return dq, dk, dv_, None, None, None, None


def gathered_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_idx: torch.Tensor,
    blocked: torch.Tensor,
    bytes_per_block: int,
) -> torch.Tensor:
    """Each query block of ``q (B, H, nr, b, D)`` against its own keys ``k[:, :, key_idx[i]]``
    (``k (B, Hkv, N, D)``, ``v (B, Hkv, N, Dv)``, ``key_idx (nr, L)``, query head ``h`` on K/V head
    ``h // (H / Hkv)``), scaled by ``D ** -0.5``, with the ``blocked`` entries (True, broadcastable to
    ``(nr, b, L)`` or ``(B, 1, nr, b, L)``) left out and zeros on rows that see no key. A fused call
    takes as many query blocks as fit :data:`~variants.masks.CHUNK_BYTES` at ``bytes_per_block``
    (its gathered keys, values and mask), a quarter of that under autograd (:data:`GRAD_SHARE`).
    Returns ``(B, H, nr, b, Dv)``. See the module docstring for time, memory and the backward."""
    scale = q.shape[-1] ** -0.5
    nr = q.shape[2]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        step = blocks_per_chunk(bytes_per_block * GRAD_SHARE, nr)
        return _GatheredSdpa.apply(q, k, v, key_idx, blocked, step, scale)
    return _forward(q, k, v, key_idx, blocked, blocks_per_chunk(bytes_per_block, nr), scale, keep_lse=False)[
        0
    ]
