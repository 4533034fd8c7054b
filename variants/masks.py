"""Mask helpers shared by the variants: combining masks and a softmax that is safe on empty rows."""

from __future__ import annotations

import torch


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
        mask = torch.ones(nq, nk, dtype=torch.bool, device=device).tril()[None, None]  # (1,1,Nq,Nk)
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
