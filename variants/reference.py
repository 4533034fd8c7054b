"""The float64 oracle: dense attention restricted to a variant's own pattern.

Kept apart from ``naive`` on purpose: it is the yardstick tests and accuracy measurements use, written
for clarity, never for speed. Memory ``O(B * H * Nq * Nk)`` float64.
"""

from __future__ import annotations

import torch

from .base import AttentionVariant, grouped_matmul, repeat_kv, takes_rows
from .masks import attend_each_document, combined_mask, document_mask, safe_softmax


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    allowed: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(scores + bias) @ v`` in float64 with ``scores = q k^T * scale`` unless given
    (``scale`` defaults to ``1/sqrt(D)``).

    ``sinks`` (``(H,)`` or ``(B, H, Nq)``): each row's softmax runs over its allowed scores and the
    sink's logit, and the sink's share is dropped: ``p_j = e^{s_j} / (e^{sink} + sum_allowed e^{s_l})``.

    ``k``, ``v`` may have fewer heads than ``q`` (grouped: each query head reads its key head by
    broadcasting, :func:`grouped_matmul`; never a float64 copy per query head). ``allowed`` (bool,
    broadcastable to ``(B, H, Nq, Nk)``) restricts the softmax; an empty row gives zeros. Returns
    ``(B, H, Nq, Dv)`` float64.
    """
    if scores is None:
        s = q.shape[-1] ** -0.5 if scale is None else scale
        scores = grouped_matmul(q.double(), k.double().transpose(-2, -1)) * s  # (B, H, Nq, Nk)
    if bias is not None:
        scores = scores.double() + bias.double()
    scores = scores.double()
    if sinks is None:
        return grouped_matmul(safe_softmax(scores, allowed), v.double())
    b, h, nq, nk = scores.shape
    sink = (sinks.view(1, h, 1) if sinks.dim() == 1 else sinks).double()  # (B|1, H, Nq|1)
    full = torch.cat([scores, sink.expand(b, h, nq)[..., None]], -1)  # (B, H, Nq, Nk + 1): the sink last
    if allowed is not None:
        seen = allowed.expand(b, h, nq, nk)
        allowed = torch.cat([seen, seen.new_ones(b, h, nq, 1)], -1)  # the sink is always there
    return grouped_matmul(safe_softmax(full, allowed)[..., :nk], v.double())


def _window_band(nq: int, nk: int, window: int, device: torch.device) -> torch.Tensor:
    """``(Nq, Nk)``: key ``j`` within ``window`` of the query's position ``p = i + Nk - Nq``, written
    here apart from the variants' band."""
    pos = torch.arange(nq, device=device)[:, None] + (nk - nq)
    return (pos - torch.arange(nk, device=device)[None, :]).abs() <= window


def _check_rows(rows: torch.Tensor | None, nq: int) -> None:
    """One ``ValueError`` unless ``rows`` is None or 1-D distinct integer indices in ``[0, Nq)``: the
    row forms place row ``r`` at position ``r + Nk - Nq``, which a negative index would shift."""
    if rows is None:
        return
    if rows.dim() != 1 or rows.dtype.is_floating_point or rows.dtype == torch.bool:
        raise ValueError(
            f"rows must be 1-D integer query indices, not {rows.dtype} of shape {tuple(rows.shape)}"
        )
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= nq):
        raise ValueError(
            f"rows must lie in [0, {nq}) (the queries); got {int(rows.min())}..{int(rows.max())}"
        )
    if len(rows.unique()) != len(rows):
        raise ValueError("rows must be distinct query indices")


def _rows_of(mask: torch.Tensor | None, rows: torch.Tensor | None, nq: int) -> torch.Tensor | None:
    """``mask`` restricted to query ``rows`` (when it has a query dimension)."""
    if mask is None or rows is None or mask.dim() < 2 or mask.shape[-2] != nq:
        return mask
    return mask[..., rows, :]


def oracle(
    variant: AttentionVariant,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    cross: bool = False,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
    documents: torch.Tensor | None = None,
    pattern: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 output ``variant`` should produce: full attention over its pattern and the masks.

    ``documents`` (ids ``(B, Nk)``, the queries the last ``Nq`` positions): a query sees only the keys
    whose id is its own; a variant with its own formula (``oracle_forward``: a recurrence, say) runs it
    on each document alone, each document then one contiguous run of ids.

    ``window=w`` keeps only keys ``j`` with ``|p - j| <= w`` (``p`` the query's position), and the pairs
    of the variant's ``window_exempt(nq, nk, causal)`` where it defines one (local_window's attention
    sinks, which a call's window does not hide).

    ``softcap=c`` turns each score ``s`` (scaled, before the bias) into ``c tanh(s / c)``.

    ``cross`` (cross-attention) changes nothing for a variant that supports it: its output does not
    depend on how query and key positions line up; it is refused for one that does not.

    ``rows`` (1-D indices) limits the result to those query rows, ``(B, H, len(rows), Dv)``, so long
    sequences can be checked in ``O(rows * Nk)``. A variant that is not a restricted softmax
    (``axial``: rows then columns) defines ``oracle_forward`` built from :func:`reference_attention`;
    one that takes ``rows=`` computes those rows alone (the others' whole output is cut to them).
    Over its pattern, only the keys some checked row reaches are computed (unless the variant scores
    pairs itself, ``reference_scores``): a window's rows cost ``O(rows * (rows + window))``, not
    ``O(rows * Nk)``.

    ``pattern``: ``variant.pattern(Nq, Nk, causal)`` when the caller has it already (a check that
    calls the oracle once per block of rows builds it once: local_window's takes 2 s at N=16384);
    refused for a variant with its own formula, which has no pattern to take.
    """
    if cross and not variant.supports_cross:
        raise ValueError(f"{variant.name or type(variant).__name__} has no cross-attention form to check")
    if sinks is not None and not variant.supports_sinks:
        raise ValueError(f"{variant.name or type(variant).__name__} takes no sinks to check")
    if softcap is not None and not variant.supports_softcap:
        raise ValueError(f"{variant.name or type(variant).__name__} soft-caps no scores to check")
    _check_rows(rows, q.shape[2])
    custom = getattr(variant, "oracle_forward", None)
    if pattern is not None:
        _check_pattern(variant, pattern, custom, q.shape[2], k.shape[2])
    if custom is not None and (sinks is not None or softcap is not None):
        raise ValueError(f"{variant.name or type(variant).__name__}'s own oracle takes no sinks or softcap")
    if custom is not None and documents is not None:  # its own formula, on each document alone
        if attn_mask is not None or window is not None or bias is not None:
            raise ValueError(
                f"{variant.name or type(variant).__name__}'s own oracle takes packed documents alone, "
                "without an attn_mask, window or bias beside them"
            )
        extra = {} if scale is None else {"scale": scale}
        by_rows = rows is not None and takes_rows(custom)  # each document's checked rows alone

        def alone(qd, kd, vd, kpm, **rows_d):  # one document as a sequence of its own (from zero)
            out = custom(qd, kd, vd, causal=causal, key_padding_mask=kpm, attn_mask=None, **extra, **rows_d)
            if rows_d:
                _check_returned_rows(variant, out, len(rows_d["rows"]))
            return out

        out = attend_each_document(alone, q, k, v, documents, key_padding_mask, rows if by_rows else None)
        return out if rows is None or by_rows else out[:, :, rows]  # (B, H, Nq|R, Dv)
    if custom is not None and window is not None:  # its own formula over the band, as an attn_mask
        band = _window_band(q.shape[2], k.shape[2], window, q.device)
        attn_mask, window = (band if attn_mask is None else attn_mask & band), None
    if custom is not None:
        extra = {k_: x for k_, x in (("scale", scale), ("bias", bias)) if x is not None}
        if rows is not None and takes_rows(custom):  # it computes only the checked rows
            extra["rows"] = rows
        out = custom(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask, **extra)
        if "rows" in extra:
            _check_returned_rows(variant, out, len(rows))
        return out if rows is None or "rows" in extra else out[:, :, rows]
    nq, nk = q.shape[2], k.shape[2]
    allowed = (variant.pattern(nq, nk, causal) if pattern is None else pattern).to(q.device)  # (Nq, Nk)
    if window is not None:
        band = _window_band(nq, nk, window, q.device)
        exempt = getattr(variant, "window_exempt", None)  # pairs a call's window leaves in place
        if exempt is not None:  # (local_window: its attention sinks)
            band = band | exempt(nq, nk, causal).to(q.device)
        allowed = allowed & band
    allowed = _rows_of(allowed, rows, nq)[None, None]  # (1, 1, R, Nk)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(q.device)[:, None, None, :]  # (B, 1, R, Nk)
    if attn_mask is not None:
        allowed = allowed & _rows_of(attn_mask.to(q.device), rows, nq)
    if documents is not None:  # only the checked rows' ids against every key's
        allowed = allowed & document_mask(documents.to(q.device), nq, rows)  # (B, 1, R, Nk)
    if bias is not None:
        bias = _rows_of(bias.to(q.device), rows, nq)
    own_scorer = type(variant).reference_scores is not AttentionVariant.reference_scores
    # a scorer of its own might read a key's position from its index: it gets every key
    reached = None if own_scorer else _reached_keys(allowed)
    if reached is not None:  # the keys no checked row reaches: zero weight, left out
        k, v, allowed = k[:, :, reached], v[:, :, reached], allowed[..., reached]  # (.., Nk', ..)
        if bias is not None and bias.shape[-1] == nk:
            bias = bias[..., reached]  # (B|1, H|1, R, Nk')
    q_rows = q if rows is None else q[:, :, rows]
    if own_scorer:
        k = repeat_kv(k, q.shape[1])  # (B, H, Nk, D): a scorer of its own reads one key head per query head
    scores = variant.reference_scores(q_rows, k, **({} if scale is None else {"scale": scale}))
    if softcap is not None:
        scores = softcap * torch.tanh(scores.double() / softcap)
    if sinks is not None and sinks.dim() == 3 and rows is not None and sinks.shape[-1] == nq:
        sinks = sinks[..., rows.to(sinks.device)]  # (B, H, R): per-query sinks of the checked rows
    return reference_attention(q_rows, k, v, allowed=allowed, scores=scores, bias=bias, sinks=sinks)


def _reached_keys(allowed: torch.Tensor) -> torch.Tensor | None:
    """The key indices some row of ``allowed`` (``(.., R, Nk)`` bool) reaches, or None when every key
    is: the others' softmax weight is exactly zero, so leaving them out changes no output or gradient.
    At least one key is kept, so a block of rows that reaches none still has a (masked) score to give
    its zeros. ``O(R * Nk)``."""
    seen = allowed.reshape(-1, allowed.shape[-1]).any(0)  # (Nk,)
    if bool(seen.all()):
        return None
    keep = seen.nonzero().flatten()  # (Nk',)
    return keep if keep.numel() else keep.new_zeros(1)


def _check_pattern(
    variant: AttentionVariant, pattern: torch.Tensor, custom: object, nq: int, nk: int
) -> None:
    """One ``ValueError`` unless ``pattern`` can stand for ``variant.pattern(Nq, Nk, causal)``."""
    who = variant.name or type(variant).__name__
    if custom is not None:
        raise ValueError(f"{who} computes its own formula (oracle_forward): it takes no pattern")
    if pattern.dtype != torch.bool or tuple(pattern.shape) != (nq, nk):
        raise ValueError(
            f"pattern must be the bool (Nq, Nk) = ({nq}, {nk}) of {who}.pattern, "
            f"not {pattern.dtype} of shape {tuple(pattern.shape)}"
        )


def _check_returned_rows(variant: AttentionVariant, out: torch.Tensor, asked: int) -> None:
    """Refuse, in one line, an own formula whose ``oracle_forward(rows=)`` returned ``out (B, H, R, Dv)``
    with ``R`` not the ``asked`` rows (a third party's formula: a wrong count would be compared, or
    scattered, as if it were those rows)."""
    if out.shape[2] != asked:
        raise ValueError(
            f"{variant.name or type(variant).__name__}.oracle_forward(rows=) returned {out.shape[2]} "
            f"rows for {asked} asked"
        )


def full_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    cross: bool = False,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 full softmax attention with the call's masks, scale and bias (what approximations
    deviate from).

    ``rows`` limits the result to those query rows, as in :func:`oracle`; ``cross`` changes nothing
    (full attention does not depend on how query and key positions line up); ``documents`` (ids ``(B,
    Nk)``) keeps each query to its own document's keys.
    """
    nq, nk = q.shape[2], k.shape[2]
    allowed = combined_mask(
        q.shape[0], nq, nk, causal=causal, key_padding_mask=key_padding_mask, device=q.device
    )
    allowed = _rows_of(allowed, rows, nq)
    if attn_mask is not None:
        am = _rows_of(attn_mask.to(q.device), rows, nq)
        allowed = am if allowed is None else allowed & am
    if documents is not None:
        same = document_mask(documents.to(q.device), nq, rows)  # (B, 1, R, Nk): the checked rows only
        allowed = same if allowed is None else allowed & same
    if bias is not None:
        bias = _rows_of(bias.to(q.device), rows, nq)
    q_rows = q if rows is None else q[:, :, rows]
    return reference_attention(q_rows, k, v, allowed=allowed, scale=scale, bias=bias)


def nystrom_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    landmarks: int,
    pinv_iters: int,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 Nystromformer (Xiong et al. 2021, eq. 15), written densely for the ``nystrom`` tests.

    ``softmax(Q K~^T) Z softmax(Q~ K^T) V`` with ``Q`` scaled by ``scale`` (default ``1/sqrt(D)``);
    ``Q~``, ``K~`` are the means of each segment of a row's real tokens (``l = ceil(L / landmarks)``
    of its ``L`` real tokens each, counted from its last, so the first segment is the short one: the
    row's layout alone, whatever the padding), taken as an averaging matrix; ``Z`` is the paper's
    iterative pseudo-inverse of ``A = softmax(Q~ K~^T)`` (``pinv_iters`` steps from ``A^T / (||A||_1
    ||A||_inf)`` per batch element and head). Landmarks with no real token and padded keys are left out of
    the softmaxes. ``q (B, H, N, D)``, ``k``/``v`` with ``H`` or fewer heads; returns ``(B, H, R, Dv)``
    float64 for the query ``rows`` (all ``N`` when None). Memory ``O(B H N (D + m))``: the product is
    taken as ``(F Z) (B V)``, never forming the ``(N, N)`` matrix ``F Z B``.
    """
    b, h, n, d = q.shape
    k, v = repeat_kv(k, h).double(), repeat_kv(v, h).double()  # (B, H, N, D|Dv)
    qs = q.double() * (d**-0.5 if scale is None else scale)
    real = torch.ones(b, n, dtype=torch.bool) if key_padding_mask is None else key_padding_mask.cpu()
    member = torch.zeros(b, min(landmarks, n), n, dtype=torch.bool)  # (B, m, N): token j in landmark i
    for row in range(b):  # each row's segments over its own real tokens, counted from its last one
        where = real[row].nonzero().flatten().tolist()
        seg = -(-len(where) // landmarks)  # ceil
        short = -(-len(where) // seg) * seg - len(where) if where else 0  # the first segment's gap
        for rank, j in enumerate(where):
            member[row, (rank + short) // seg, j] = True
    counts = member.sum(-1)  # (B, m)
    average = (member.double() / counts.clamp_min(1)[:, :, None]).to(q.device)  # (B, m, N)
    has = (counts > 0).to(q.device)  # (B, m)
    real = real.to(q.device)
    q_land = average[:, None] @ qs  # (B, H, m, D)
    k_land = average[:, None] @ k  # (B, H, m, D)
    q_rows = qs if rows is None else qs[:, :, rows.to(q.device)]  # (B, H, R, D)
    f = safe_softmax(q_rows @ k_land.mT, has[:, None, None, :])  # (B, H, R, m)
    a = safe_softmax(q_land @ k_land.mT, has[:, None, :, None] & has[:, None, None, :])  # (B, H, m, m)
    bm = safe_softmax(q_land @ k.mT, has[:, None, :, None] & real[:, None, None, :])  # (B, H, m, N)
    norm = a.sum(-2).max(-1).values * a.sum(-1).max(-1).values  # (B, H)
    z = a.mT / torch.where(norm > 0, norm, 1.0)[..., None, None]
    eye = torch.eye(member.shape[1], dtype=torch.float64, device=q.device)
    for _ in range(pinv_iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return (f @ z) @ (bm @ v)  # (B, H, R, m) @ (B, H, m, Dv)


def linformer_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor,
    f: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 Linformer (Wang et al. 2020): ``softmax(Q (E K)^T * scale) (F V)`` with the length
    projections ``E``, ``F (P, max_len)`` cut to their first ``Nk`` columns, padded keys and values
    zeroed first. ``q (B, H, Nq, D)``, ``k``/``v`` with ``H`` or fewer heads; returns
    ``(B, H, R, Dv)`` float64 for the query ``rows`` (all ``Nq`` when None; differentiable in ``e``
    and ``f`` too)."""
    h, nk = q.shape[1], k.shape[2]
    k, v = repeat_kv(k, h).double(), repeat_kv(v, h).double()  # (B, H, Nk, D|Dv)
    if key_padding_mask is not None:
        real = key_padding_mask[:, None, :, None].to(q.device)  # (B, 1, Nk, 1)
        k, v = k * real, v * real
    k_proj = e[:, :nk].double() @ k  # (P, Nk) @ (B, H, Nk, D) -> (B, H, P, D)
    v_proj = f[:, :nk].double() @ v  # (B, H, P, Dv)
    q = q if rows is None else q[:, :, rows.to(q.device)]  # (B, H, R, D)
    return reference_attention(q, k_proj, v_proj, scale=scale)


# ---------------------------------------------------------------- the kernelized family (issue 31)
# linear, retention and performer written densely: the (B, H, Nq, Nk) weights, then their sum over
# the visible keys. Nothing here is shared with variants/linear_core.py.


def query_positions(nq: int, nk: int, rows: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``(R,)`` positions in the keys' sequence of the query ``rows`` (all ``Nq`` when None): the
    queries are the last ``Nq`` positions (bottom-right), so row ``i`` is at ``i + Nk - Nq``."""
    i = torch.arange(nq, device=device) if rows is None else rows.to(device)
    return i + (nk - nq)


def _kernel_visible(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 ``(B|1, 1, R, Nk)``: 1 where query row ``i`` (of ``rows``, all ``Nq`` when None; at
    position ``i + Nk - Nq``) sees key ``j``."""
    nk = k.shape[2]
    i = query_positions(q.shape[2], nk, rows, q.device)[:, None]  # (R, 1)
    j = torch.arange(nk, device=q.device)[None, :]  # (1, Nk)
    seen = (j <= i) if causal else torch.ones(i.shape[0], nk, dtype=torch.bool, device=q.device)
    seen = seen[None, None]  # (1, 1, R, Nk)
    if key_padding_mask is not None:
        seen = seen & key_padding_mask.to(q.device)[:, None, None, :]  # (B, 1, R, Nk)
    return seen.double()


def _kernel_sum(weights: torch.Tensor, v: torch.Tensor, normalize: bool) -> torch.Tensor:
    """``weights (B, H, Nq, Nk) @ v (B, Hkv, Nk, Dv)`` (grouped heads, :func:`grouped_matmul`), divided by
    the row sums when ``normalize`` (a zero row: 0)."""
    out = grouped_matmul(weights, v)  # (B, H, Nq, Dv)
    if normalize:
        den = weights.sum(-1, keepdim=True)  # (B, H, Nq, 1)
        out = out / torch.where(den == 0, torch.ones_like(den), den)
    return out


def linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map: str,
    normalize: bool,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 linear attention (Katharopoulos et al. 2020): weights ``s phi(q_i) . phi(k_j)`` over
    the visible keys, ``sum_j w_ij v_j`` (divided by ``sum_j w_ij`` when ``normalize``); ``phi`` is
    ``elu1`` (x + 1 for x > 0, e^x otherwise), ``relu`` or ``identity``. ``(B, H, R, Dv)`` for the
    query ``rows`` (all ``Nq`` when None), ``O(R Nk)`` memory."""
    phi = _FEATURE_MAPS[feature_map]
    visible = _kernel_visible(q, k, causal, key_padding_mask, rows)  # (B|1, 1, R, Nk)
    q = q if rows is None else q[:, :, rows]  # (B, H, R, D)
    q, k, v = q.double(), k.double(), v.double()  # k, v keep their Hkv heads
    s = q.shape[-1] ** -0.5 if scale is None else scale
    weights = s * grouped_matmul(phi(q), phi(k).transpose(-2, -1)) * visible
    return _kernel_sum(weights, v, normalize)


_FEATURE_MAPS = {
    "elu1": lambda x: torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0))),
    "relu": lambda x: torch.clamp(x, min=0),
    "identity": lambda x: x,
}


def window_linear_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    feature_map: str,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 window + linear attention (Based's composition), causal: for the query at position
    ``p`` (bottom-right), the softmax of ``s q_p . k_j`` over the keys ``p - window <= j <= p``, plus
    the normalised linear attention ``s phi(q_p) . phi(k_j)`` over the keys ``j < p - window`` (0 where
    there is none); padded keys in neither. ``(B, H, R, Dv)`` for the query ``rows`` (all ``Nq`` when
    None), ``O(R Nk)`` memory."""
    nk = k.shape[2]
    p = query_positions(q.shape[2], nk, rows, q.device)[:, None]  # (R, 1): positions of the queries
    q = q if rows is None else q[:, :, rows]  # (B, H, R, D)
    j = torch.arange(nk, device=q.device)[None, :]  # (1, Nk)
    real = (
        torch.ones(1, nk, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    )
    real = real.to(q.device)[:, None, None, :]  # (B|1, 1, 1, Nk)
    near = ((j <= p) & (j >= p - window))[None, None] & real  # (B|1, 1, R, Nk)
    far = (j < p - window)[None, None] & real
    phi = _FEATURE_MAPS[feature_map]
    qd, kd, vd = q.double(), k.double(), v.double()  # k, v keep their Hkv heads
    s = q.shape[-1] ** -0.5 if scale is None else scale
    soft = reference_attention(q, k, v, allowed=near, scale=s)
    weights = s * grouped_matmul(phi(qd), phi(kd).transpose(-2, -1)) * far.double()
    return soft + _kernel_sum(weights, vd, True)


def retention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 retention (RetNet, Sun et al. 2023): ``o_i = sum_{j <= i} gamma_h^(i-j) (s q_i . k_j)
    v_j`` with ``gamma_h = 1 - 2^(-5-h)``, ``i`` the query's position (bottom-right), padded keys out
    of the sum. Causal only. ``(B, H, R, Dv)`` for the query ``rows`` (all ``Nq`` when None),
    ``O(R Nk)`` memory."""
    if not causal:
        raise ValueError("retention is causal only")
    nk, h = k.shape[2], q.shape[1]
    pos = query_positions(q.shape[2], nk, rows, q.device)  # (R,)
    visible = _kernel_visible(q, k, True, key_padding_mask, rows)  # (B|1, 1, R, Nk)
    q = q if rows is None else q[:, :, rows]  # (B, H, R, D)
    q, k, v = q.double(), k.double(), v.double()  # k, v keep their Hkv heads
    s = q.shape[-1] ** -0.5 if scale is None else scale
    gamma = 1 - 2.0 ** (-5.0 - torch.arange(h, dtype=torch.float64, device=q.device))  # (H,)
    dist = pos[:, None] - torch.arange(nk, device=q.device)  # (R, Nk)
    decay = gamma[:, None, None] ** dist.clamp(min=0).double()  # (H, R, Nk); masked where dist < 0
    return grouped_matmul(s * grouped_matmul(q, k.transpose(-2, -1)) * decay * visible, v)


def performer_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    projection: torch.Tensor,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 FAVOR+ (Choromanski et al. 2021) with the random directions ``projection (m, D)``:
    ``phi(x) = exp(W x - |x|^2 / 2) / sqrt(m)`` of ``x = sqrt(s) q`` and ``sqrt(s) k``, weights
    ``phi(q_i) . phi(k_j)`` over the visible keys, normalised by their sum. Unstabilised: for inputs
    of moderate size. ``(B, H, R, Dv)`` for the query ``rows`` (all ``Nq`` when None), ``O(R Nk)``
    memory."""
    visible = _kernel_visible(q, k, causal, key_padding_mask, rows)  # (B|1, 1, R, Nk)
    q = q if rows is None else q[:, :, rows]  # (B, H, R, D)
    q, k, v = q.double(), k.double(), v.double()  # k, v keep their Hkv heads
    s = q.shape[-1] ** -0.5 if scale is None else scale
    w = projection.double().to(q.device)

    def phi(x: torch.Tensor) -> torch.Tensor:
        x = x * s**0.5
        return torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / w.shape[0] ** 0.5  # (B, H, N, m)

    weights = grouped_matmul(phi(q), phi(k).transpose(-2, -1)) * visible
    return _kernel_sum(weights, v, True)
