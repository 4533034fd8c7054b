"""The one interface every attention variant implements.

Conventions (see DESIGN.md): tensors are ``(B, H, N, D)``; boolean masks mean True = may attend;
``key_padding_mask`` is ``(B, Nk)``; ``attn_mask`` broadcasts to ``(B, H, Nq, Nk)``; ``k``/``v`` may have
``Hkv`` heads with ``H % Hkv == 0`` (grouped-query attention: query head ``h`` reads key/value head
``h // (H / Hkv)``); ``causal`` with ``Nq <= Nk`` is aligned bottom-right (the queries are the last ``Nq``
positions: key ``j`` is visible to query ``i`` iff ``j <= i + Nk - Nq``); without ``cross`` the queries
are positions of the keys' sequence (``Nq < Nk``: its last ``Nq``, as when decoding against a cache),
with ``cross=True`` they are another sequence (an encoder-decoder's cross-attention: no position of
one relates to a position of the other, never causal, any ``Nq`` and ``Nk``); ``scale`` defaults to
``1/sqrt(D)``; ``bias`` is an additive float tensor broadcastable to ``(B, H, Nq, Nk)``; a query that can
see no key outputs zeros with zero gradients.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from .masks import document_mask

ALL_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})


class Unsupported(Exception):
    """Raised by :meth:`AttentionVariant.check` before any work, with a human-readable reason."""


class Unavailable(Exception):
    """The device or a library the variant needs is not there, or cannot load (a fact about the
    machine, not the variant); the reason says what is missing and how to get it."""


def first_order_only(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the ``backward`` of an autograd Function computed outside autograd (a C or Triton
    kernel, a loop over tensors its forward made without a graph). Under ``create_graph=True`` such a
    backward returns gradients with no graph, so a loss that reads them (a gradient penalty, a
    Hessian-vector product) silently lost that term (1.0-3.2 off here); torch's ``once_differentiable``
    does not catch it when the incoming gradient is a constant. It is refused instead, in one line."""

    @functools.wraps(backward)
    def checked(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():  # the engine runs a backward in grad mode only for create_graph
            raise Unsupported(
                "no second derivative: this variant's backward is computed outside autograd (a loss "
                "that reads gradients needs a variant autograd differentiates, e.g. naive or sdpa's math)"
            )
        return backward(ctx, *grads)

    return checked


@dataclass(frozen=True)
class Workload:
    """Everything a variant needs to know to decide whether it can run, without any tensor."""

    batch: int
    heads: int
    nq: int
    nk: int
    head_dim: int
    v_head_dim: int
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    causal: bool = False
    key_padding: bool = False
    attn_mask: bool = False
    backward: bool = False
    kv_heads: int | None = None  # None: = heads
    scale: float | None = None  # None: 1/sqrt(head_dim)
    bias: bool = False
    bias_grad: bool = False  # the bias requires a gradient
    cross: bool = False  # the queries are another sequence than the keys' (cross-attention)
    sinks: bool = False  # a sink logit joins each softmax's denominator (gpt-oss, Inkling2)
    softcap: float | None = None  # scores soft-capped as c tanh(s / c) before the softmax (Gemma2)
    window: int | None = None  # a sliding window: keys with |p - j| <= window only (Mistral, Gemma2)
    documents: bool = False  # packed documents, given as ids (B, Nk): a query sees its own document only
    pair_share: float = 1.0  # the share of the full (or causal) call's pairs packed documents keep,
    # where it is known
    # the packed documents' lengths per batch row, where known (a sweep's workload; not from a call's
    # tensors): what the useful FLOP count keeps of a pattern (useful_pairs)
    document_lengths: tuple[tuple[int, ...], ...] | None = None

    @property
    def hkv(self) -> int:
        """Key/value heads (``heads`` unless grouped)."""
        return self.kv_heads or self.heads

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
        bias: torch.Tensor | None = None,
        cross: bool = False,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
        window: int | None = None,
        documents: torch.Tensor | None = None,
    ) -> Workload:
        """Describe the call ``variant(q, k, v, ...)``; checks the shapes agree."""
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(
                f"q, k, v must be (B, H, N, D); got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        b, h, nq, d = q.shape
        if 0 in (*q.shape, *k.shape, *v.shape):
            raise ValueError(
                f"q, k, v need non-empty B, H, N and D; got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
        if k.shape[0] != b or k.shape[3] != d:
            raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B or D")
        if h % k.shape[1]:
            raise ValueError(
                f"k has {k.shape[1]} heads, which must divide q's {h} (grouped-query attention); "
                f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(f"v {tuple(v.shape)} does not match k {tuple(k.shape)} in B, H or N")
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, k.shape[2]):
            raise ValueError(
                f"key_padding_mask must be (B, Nk) = {(b, k.shape[2])}, got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            raise ValueError("key_padding_mask must be boolean (True = real key)")
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            raise ValueError(
                "attn_mask must be boolean (True = may attend); pass a float additive mask as bias="
            )
        if sinks is not None:
            _check_sinks(sinks, b, h, nq)
        if documents is not None and (
            tuple(documents.shape) != (b, k.shape[2])
            or documents.is_floating_point()
            or documents.is_complex()
            or documents.dtype == torch.bool
        ):
            raise ValueError(
                f"documents must be integer ids (B, Nk) = {(b, k.shape[2])}, one per key position; got "
                f"{documents.dtype} {tuple(documents.shape)}"
            )
        if documents is not None and (cross or nq > k.shape[2]):
            raise ValueError(
                "documents cut the keys' own sequence into pieces, and its queries are its last Nq "
                f"positions: not with cross-attention (cross={bool(cross)}, Nq={nq}, Nk={k.shape[2]})"
            )
        if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
            raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
        if window is not None and not (
            isinstance(window, int) and not isinstance(window, bool) and window >= 0
        ):
            raise ValueError(f"window must be an integer >= 0 or None, got {window!r}")
        if window is not None and cross:
            raise ValueError(
                "window with cross=True: a window relates query and key positions of one sequence"
            )
        if cross and causal:
            raise ValueError(
                "cross=True with causal=True: the queries of cross-attention are another sequence than "
                "the keys', so no key comes after a query (pass causal=False)"
            )
        if scale is not None and not (isinstance(scale, (int, float)) and scale > 0):
            raise ValueError(f"scale must be a positive number or None, got {scale!r}")
        if bias is not None:
            if not bias.is_floating_point():
                raise ValueError(f"bias must be a floating-point tensor, got {bias.dtype}")
            try:
                torch.broadcast_shapes(tuple(bias.shape), (b, h, nq, k.shape[2]))
            except RuntimeError:
                raise ValueError(
                    f"bias {tuple(bias.shape)} does not broadcast to (B, H, Nq, Nk) = "
                    f"{(b, h, nq, k.shape[2])}"
                ) from None
        return cls(
            batch=b,
            heads=h,
            nq=nq,
            nk=k.shape[2],
            head_dim=d,
            v_head_dim=v.shape[3],
            device=q.device.type,
            dtype=q.dtype,
            causal=causal,
            key_padding=key_padding_mask is not None,
            attn_mask=attn_mask is not None,
            # a sink logit being trained needs a backward too (a frozen model's sinks)
            backward=torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (q, k, v, sinks)),
            kv_heads=k.shape[1] if k.shape[1] != h else None,
            scale=None if scale is None else float(scale),
            bias=bias is not None,
            bias_grad=bias is not None and torch.is_grad_enabled() and bias.requires_grad,
            cross=bool(cross),
            sinks=sinks is not None,
            softcap=None if softcap is None else float(softcap),
            window=window,
            documents=documents is not None,
        )


def _check_sinks(sinks: torch.Tensor, b: int, h: int, nq: int) -> None:
    """One ``ValueError`` line unless ``sinks`` is a float ``(H,)`` (one logit per head) or broadcasts
    as ``(B, H, Nq)`` (one per head and query, as Inkling2's)."""
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    shape = tuple(sinks.shape)
    ok = shape == (h,)
    if not ok and sinks.dim() == 3:
        try:
            ok = torch.broadcast_shapes(shape, (b, h, nq)) == (b, h, nq)
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(
            f"sinks must be (H,) = ({h},) or broadcast to (B, H, Nq) = {(b, h, nq)}; got {shape}"
        )


def sink_logits(sinks: torch.Tensor, h: int) -> torch.Tensor:
    """``sinks`` as ``(B|1, H, Nq|1)``: an ``(H,)`` tensor becomes ``(1, H, 1)``."""
    return sinks.view(1, h, 1) if sinks.dim() == 1 else sinks


#: the tensor arguments of :meth:`AttentionVariant.forward`, in its order: what ``_attend`` must leave as
#: it found them (the oracle check and the next timed call read them after it)
INPUT_NAMES = ("q", "k", "v", "key_padding_mask", "attn_mask", "bias", "sinks", "documents")


def input_versions(inputs: tuple[torch.Tensor | None, ...]) -> tuple[int, ...]:
    """Each tensor's version counter, which every in-place edit of it (or of a view sharing its
    storage) increments; -1 for None and for a tensor made under ``torch.inference_mode``, which has
    no counter (reading it raises), so an edit of it cannot be seen. ``O(len(inputs))`` integer reads."""
    return tuple(-1 if t is None or t.is_inference() else t._version for t in inputs)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x (B, Hkv, N, E)`` with each head repeated ``heads / Hkv`` times: ``(B, heads, N, E)``, head
    ``h`` a copy of head ``h // (heads / Hkv)`` (a copy: for variants that cannot read grouped heads)."""
    b, hkv, n, e = x.shape
    if hkv == heads:
        return x
    # (B, Hkv, N, E) -> (B, Hkv, G, N, E) -> (B, H, N, E)
    return x[:, :, None].expand(b, hkv, heads // hkv, n, e).reshape(b, heads, n, e)


def takes_rows(oracle_forward: object) -> bool:
    """Whether a variant's ``oracle_forward`` takes ``rows=`` (computes only the checked query rows);
    one written before it did (a third party's) gets its whole output cut to them, as does a callable
    whose signature cannot be read (a builtin). ``O(1)``."""
    try:
        return "rows" in inspect.signature(oracle_forward).parameters
    except (TypeError, ValueError):
        return False


def grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a (B, H, Nq, X) @ b (B, Hkv, X, Y)`` with query head ``h`` against key head ``h // (H / Hkv)``,
    the key heads broadcast, never repeated (:func:`repeat_kv` copies them: in float64 a copy of a
    128k-key cache per query head took 4 GiB at 32 heads). ``(B, H, Nq, Y)``."""
    n, h, nq, x = a.shape
    hkv = b.shape[1]
    # a group's query heads as rows: broadcasting b over a group dimension instead would make matmul
    # copy b once per query head, the very copy this avoids
    out = a.reshape(n, hkv, h // hkv * nq, x) @ b  # (B, H, Nq, X) -> (B, Hkv, g Nq, X); @ -> (.., Y)
    return out.view(n, h, nq, -1)  # (B, Hkv, g Nq, Y) -> (B, H, Nq, Y)


def causal_offset(nq: int, nk: int) -> int:
    """How far the causal diagonal is shifted right: query ``i`` sees keys ``j <= i + offset``
    (bottom-right alignment, ``Nq <= Nk``)."""
    return nk - nq


def full_pairs(nq: int, nk: int, causal: bool) -> int:
    """(query, key) pairs of full attention, or causal (bottom-right): query ``i`` sees ``i + Nk - Nq
    + 1`` keys (causal needs ``Nq <= Nk``, so that is at most ``Nk``). ``O(1)``."""
    return nq * causal_offset(nq, nk) + nq * (nq + 1) // 2 if causal else nq * nk


def _sink_as_first_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    scale: float | None,
    *,
    equal_dims: bool = False,
    query_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sinks as one more key in front of the others, through one more feature: the queries get
    ``sink / scale`` (``sinks (B|1, H, Nq|1)``), the sink key ``1`` there and 0 elsewhere, the real
    keys 0 there, so the sink key's score is exactly the sink's logit and every other score is
    unchanged; its value is 0. Returns ``q (B, H, Nq, D+1)``, ``k (B, Hkv, Nk+1, D+1)``, ``v (B, Hkv,
    Nk+1, Dv)`` (the sink key is the same for every head: no head is repeated); causal bottom-right
    alignment still shows every query all its keys and the sink. ``O((Nq + Nk) D)`` copies.

    For a fused kernel: ``equal_dims`` gives v the extra feature too (``Dv+1``, zeros: fused kernels
    want equal head sizes, so out[..., :Dv] is the output); ``query_row`` puts one more query in front
    (zeros: ``Nq+1``, its output row to drop), so that causal self-attention keeps ``Nq == Nk``, plain
    causal, where ``Nq < Nk`` would need an explicit ``(Nq, Nk)`` mask."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    s = d**-0.5 if scale is None else scale
    extra = (sinks.to(q.dtype) / s).expand(b, h, nq)[..., None]  # (B, H, Nq, 1)
    q = torch.cat([q, extra], -1)  # (B, H, Nq, D+1)
    if query_row:
        q = torch.cat([q.new_zeros(b, h, 1, d + 1), q], 2)  # (B, H, Nq+1, D+1)
    sink_key = k.new_zeros(b, hkv, 1, d + 1)
    sink_key[..., d] = 1.0
    k = torch.cat([sink_key, torch.cat([k, k.new_zeros(b, hkv, nk, 1)], -1)], 2)  # (B, Hkv, Nk+1, D+1)
    if equal_dims:
        v = torch.cat([v, v.new_zeros(b, hkv, nk, 1)], -1)  # (B, Hkv, Nk, Dv+1)
    v = torch.cat([v.new_zeros(b, hkv, 1, v.shape[-1]), v], 2)  # (B, Hkv, Nk+1, Dv(+1))
    return q, k, v


def _prepend(mask: torch.Tensor | None, value: bool | float, nk: int | None = None) -> torch.Tensor | None:
    """``mask`` with one key column of ``value`` in front (the sink key): a ``(B, Nk)`` key padding
    mask, or (``nk`` given) an attn_mask or bias broadcasting to ``(..., Nq, Nk)``."""
    if mask is None:
        return None
    if nk is not None:
        mask = mask.expand(*mask.shape[:-1], nk)  # (..., Nq|1, Nk): a broadcast key dim made real
    return torch.cat([torch.full_like(mask[..., :1], value), mask], -1)  # (..., Nk + 1)


def _prepend_row(mask: torch.Tensor | None, value: bool | float, nq: int) -> torch.Tensor | None:
    """``mask`` (broadcasting to ``(..., Nq, Nk)``) with one query row of ``value`` in front where its
    query dim is real (``query_row`` of :func:`_sink_as_first_key`); a broadcast one stays."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] != nq or nq == 1:
        return mask
    return torch.cat([torch.full_like(mask[..., :1, :], value), mask], -2)  # (..., Nq + 1, Nk)


def sinks_as_first_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    *,
    scale: float | None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    equal_dims: bool = False,
    query_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """A call with ``sinks (B|1, H, Nq|1)`` made into one without them: ``q``, ``k``, ``v`` grown by the
    sink key (:func:`_sink_as_first_key`, with its ``equal_dims`` and ``query_row``) and the call's
    other inputs grown with them, as keywords: the sink key visible to every query with bias 0 (and
    with ``query_row`` one visible row in front), and the original scale resolved (``D`` grew by one).
    The caller drops what ``equal_dims`` and ``query_row`` add to the output. ``O((Nq + Nk) D)``
    copies, plus one column (and row) of each mask and the bias."""
    nq, nk = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = _sink_as_first_key(q, k, v, sinks, scale, equal_dims=equal_dims, query_row=query_row)
    attn_mask, bias = _prepend(attn_mask, True, nk), _prepend(bias, 0.0, nk)  # (..., Nq|1, Nk + 1)
    if query_row:
        attn_mask, bias = _prepend_row(attn_mask, True, nq), _prepend_row(bias, 0.0, nq)
    call = {"key_padding_mask": _prepend(key_padding_mask, True), "attn_mask": attn_mask, "bias": bias}
    return q, k, v, {**call, "scale": scale}


class AttentionVariant(nn.Module):
    """Base class: ``forward(q, k, v, *, causal, key_padding_mask, attn_mask, scale, bias)`` returns
    ``(B, H, Nq, Dv)``.

    Subclasses set the class-level facts below, implement :meth:`_attend`, and override
    :meth:`pattern` / :meth:`num_pairs` when they do not compute every (query, key) pair.
    Structural knobs (window, block size, ...) are constructor arguments.

    What a subclass does not do itself, :meth:`forward` does for it: grouped K/V heads are repeated
    (a copy) unless ``native_gqa``; a ``scale`` other than ``1/sqrt(D)`` multiplies ``q`` (one pass
    over ``q``) unless ``native_scale``, in which case ``_attend`` gets ``scale=``; ``_attend`` gets
    ``bias=`` only when ``supports_bias``. So a variant written for ``_attend(q, k, v, *, causal,
    key_padding_mask, attn_mask)`` keeps working.
    """

    name: ClassVar[str] = ""
    #: True when the output equals full softmax attention (up to rounding).
    exact: ClassVar[bool] = True
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    dtypes: ClassVar[frozenset[torch.dtype]] = ALL_DTYPES
    supports_causal: ClassVar[bool] = True
    supports_key_padding: ClassVar[bool] = True
    supports_attn_mask: ClassVar[bool] = True
    #: cross-attention (``cross=True``, and ``Nq > Nk``): the queries are another sequence than the
    #: keys', so the output may not depend on how query and key positions line up (False for a
    #: variant whose pattern or recurrence is defined over the positions of one sequence)
    supports_cross: ClassVar[bool] = True
    #: ``Nq < Nk`` with the queries as the last ``Nq`` positions of the keys' sequence (decoding
    #: against a cache, prefill onto a cache); implied by ``supports_cross``
    supports_decode: ClassVar[bool] = True
    #: attention without ``causal`` (False for a variant whose formula is a causal recurrence, such as
    #: retention's decay over the past)
    supports_noncausal: ClassVar[bool] = True
    #: :meth:`prefill` and :meth:`step` carry a decoding state whose size does not grow with the
    #: context (a kernelized or recurrent variant); without it a variant decodes against the K/V cache
    #: (``forward`` with ``Nq < Nk``) and :meth:`state_bytes` counts that cache
    supports_state: ClassVar[bool] = False
    #: a ``scale`` other than ``1/sqrt(D)`` (False where the scores have no scale, as in additive)
    supports_scale: ClassVar[bool] = True
    #: an additive float ``bias`` on the scores (ALiBi, relative position bias)
    supports_bias: ClassVar[bool] = False
    #: ``sinks=``: a logit per head (or per head and query) that joins the softmax's denominator and
    #: weighs a zero value (gpt-oss, Inkling2). :meth:`forward` adds it as one more key for the
    #: variants that compute softmax over every allowed key (it would fall outside a window or a
    #: block pattern, and a kernel feature map has no denominator to add it to)
    supports_sinks: ClassVar[bool] = False
    #: ``softcap=c``: the scores (after the scale, before bias and masks) become ``c tanh(s / c)``
    #: (Gemma2's attention logit soft-capping); ``_attend`` then takes ``softcap=``
    supports_softcap: ClassVar[bool] = False
    #: ``window=w`` (a model's sliding window, in local_window's convention: key ``j`` is visible to
    #: the query at position ``p`` iff ``|p - j| <= w``) handled by ``_attend`` itself (local_window: the
    #: narrower of its own window and the call's, its ``sink_tokens`` kept visible); otherwise
    #: :meth:`forward` folds the band into the ``attn_mask`` of a variant that takes one (an ``(Nq,
    #: Nk)`` mask) and the others refuse it
    native_window: ClassVar[bool] = False
    #: a gradient for the bias
    bias_backward: ClassVar[bool] = False
    #: ``_attend`` reads grouped K/V heads itself (no copy); otherwise forward repeats them
    native_gqa: ClassVar[bool] = False
    #: ``_attend`` takes ``scale=``; otherwise forward rescales q
    native_scale: ClassVar[bool] = False
    #: devices on which backward runs
    backward_devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    has_params: ClassVar[bool] = False
    #: the constructor knob that sizes the learned parameters (additive's ``hidden``, linformer's
    #: ``proj_len``): a task model shrinks it to hold the variant to the exact model's parameter budget
    size_knob: ClassVar[str | None] = None
    #: True when the variant is compiled (its first call includes compile time).
    compiled: ClassVar[bool] = False
    #: Knob sets that give a non-trivial pattern at small sizes (N around 16-64), used by the
    #: registry-wide tests and the pattern plots so a new variant is tested without new test code.
    example_knobs: ClassVar[tuple[dict[str, object], ...]] = ({},)

    def __init__(self) -> None:  # subclasses list their knobs explicitly (the registry reads them)
        super().__init__()

    # ------------------------------------------------------------------ capability checks
    def check(self, w: Workload) -> None:
        """Raise :class:`Unsupported` with a reason if this variant cannot run ``w``."""
        who = self.name or type(self).__name__
        if w.device not in self.devices:
            raise Unsupported(f"{who} does not run on device '{w.device}'")
        if w.dtype not in self.dtypes:
            raise Unsupported(f"{who} does not support dtype {str(w.dtype).replace('torch.', '')}")
        if w.causal and w.nq > w.nk:
            raise Unsupported(
                f"causal attention needs Nq <= Nk (queries aligned to the last keys), got Nq={w.nq}, "
                f"Nk={w.nk}"
            )
        # before the causal refusal: a cross call is never causal, so "pass causal=True" would mislead
        if w.cross and not self.supports_cross:
            raise Unsupported(
                f"{who} relates each query to key positions of its own sequence (its pattern or its "
                "recurrence): it has no cross-attention form (cross=True)"
            )
        if not w.causal and not self.supports_noncausal:
            raise Unsupported(f"{who} is causal only (pass causal=True)")
        if w.causal and not self.supports_causal:
            raise Unsupported(f"{who} does not support causal masking")
        if w.key_padding and not self.supports_key_padding:
            raise Unsupported(f"{who} does not support a key padding mask")
        if w.attn_mask and not self.supports_attn_mask:
            raise Unsupported(f"{who} does not support an arbitrary attn_mask")
        if w.nq > w.nk and not self.supports_cross:
            raise Unsupported(f"{who} does not support cross-attention (Nq={w.nq} > Nk={w.nk})")
        if w.nq < w.nk and not (self.supports_cross or self.supports_decode):
            raise Unsupported(
                f"{who} does not support Nq < Nk (decoding against a cache; Nq={w.nq}, Nk={w.nk})"
            )
        # (the default scale spelled out asks for nothing: a decoding state carries it)
        if w.scale is not None and w.scale != w.head_dim**-0.5 and not self.supports_scale:
            raise Unsupported(f"{who} has no softmax scale to set (scale={w.scale:g})")
        if w.sinks and not self.supports_sinks:
            raise Unsupported(
                f"{who} takes no attention sinks: only a softmax over every allowed key has a denominator "
                "a sink's logit can join (exact variants: naive, sdpa, chunked, flex)"
            )
        if w.softcap is not None and not self.supports_softcap:
            raise Unsupported(
                f"{who} does not soft-cap its scores (softcap={w.softcap:g}): c tanh(s / c) is applied "
                "by naive, chunked and flex, which hold the scores before the softmax (sdpa's fused "
                "kernels do not)"
            )
        if w.window is not None and not (self.native_window or self.supports_attn_mask):
            raise Unsupported(
                f"{who} takes no sliding window (window={w.window}): it has no window of its own and no "
                "attn_mask to restrict"
            )
        if w.documents and not (self.native_documents(w) or self.supports_attn_mask):
            raise Unsupported(
                f"{who} takes no packed documents: it has no attn_mask to keep a query to its own "
                "document's keys, and no document path of its own"
            )
        if w.softcap is not None and w.sinks:
            raise Unsupported(
                f"{who} takes sinks as one more key, whose logit softcap would cap too: no model "
                "combines the two, and this interface does not define it"
            )
        if w.bias and not self.supports_bias:
            raise Unsupported(f"{who} does not take an additive float bias")
        if w.bias_grad and not self.bias_backward:
            raise Unsupported(
                f"{who} computes no gradient for the bias (pass a bias that does not require grad)"
            )
        if w.backward and w.device not in self.backward_devices:
            raise Unsupported(f"{who} has no backward pass on device '{w.device}'")

    # ------------------------------------------------------------------ the computation
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
        bias: torch.Tensor | None = None,
        cross: bool = False,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
        window: int | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend ``q (B,H,Nq,D)`` to ``k (B,Hkv,Nk,D)``, ``v (B,Hkv,Nk,Dv)``; returns ``(B,H,Nq,Dv)`` in
        ``q``'s dtype (``k``'s and ``v``'s too) on ``q``'s device. ``_attend`` returning anything else, or
        changing one of the tensors it is given in place, is a ``TypeError`` or ``RuntimeError`` naming it.

        ``scale`` multiplies the scores (default ``1/sqrt(D)``); ``bias`` (float, broadcastable to
        ``(B, H, Nq, Nk)``) is added to them before the softmax, in ``q``'s dtype. ``cross=True`` says
        the queries are another sequence than the keys' (cross-attention): a variant that could only
        read them as the last ``Nq`` positions of the keys' sequence refuses it (``supports_cross``);
        the others compute what they compute without it (their output never depended on that
        alignment). ``sinks``
        (``(H,)`` or ``(B, H, Nq)``, where ``supports_sinks``): each query's softmax gets one more
        term, ``e^sink``, in its denominator, for a zero value, so its weights sum to less than one.
        ``softcap=c`` (where ``supports_softcap``): each score ``s`` (scaled, before bias and masks)
        becomes ``c tanh(s / c)``. ``window=w``: only keys ``j`` with ``|p - j| <= w`` (``p`` the query's
        position) are visible, on top of every other mask (transformers' sliding window of ``W`` keys
        is ``w = W - 1``). ``documents`` (integer ids ``(B, Nk)``, one per key position, each document
        one contiguous run; the queries are the last ``Nq`` positions): packed sequences, a query sees
        only the keys of its own document (a variant without a path of its own, ``native_documents``,
        gets them as an ``attn_mask``, ``O(B Nq Nk)`` booleans).
        """
        w = Workload.of(
            q,
            k,
            v,
            causal=causal,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            scale=scale,
            bias=bias,
            cross=cross,
            sinks=sinks,
            softcap=softcap,
            window=window,
            documents=documents,
        )
        inputs = (q, k, v, key_padding_mask, attn_mask, bias, sinks, documents)  # in INPUT_NAMES' order
        before = input_versions(inputs)  # after Workload.of, whose checks name a bad input first
        if bias is not None and bias.dtype != q.dtype:
            # added in the queries' dtype, as the scores are: a float32 bias beside bfloat16 queries
            # raised deep in torch (naive), and beside float64 ones SDPA's CPU flash kernel misread it
            bias = bias.to(q.dtype)
        self.check(w)
        if window is not None and not self.native_window:  # the band as a mask (O(Nq Nk) booleans)
            self.check(replace(w, attn_mask=True, window=None))  # what the variant is then handed
            pos = torch.arange(w.nq, device=q.device)[:, None] + (w.nk - w.nq)  # (Nq, 1): positions
            keys = torch.arange(w.nk, device=q.device)[None, :]  # (1, Nk)
            band = (keys >= pos - window) & (keys <= pos + window)  # (Nq, Nk), no int (Nq, Nk) tensor
            attn_mask = band if attn_mask is None else attn_mask & band
            window = None
            w = replace(w, attn_mask=True, window=None)  # what later choices (native paths) must see
        # packed documents as a mask, unless the variant has its own path (which the sinks' extra key,
        # added below where they are not native, would not line up with)
        if documents is not None and (
            not self.native_documents(w) or (sinks is not None and not self.native_sinks(w))
        ):
            self.check(replace(w, attn_mask=True, documents=False))  # what the variant is then handed
            same = document_mask(documents, w.nq)  # (B, 1, Nq, Nk)
            attn_mask = same if attn_mask is None else attn_mask & same
            documents = None
            w = replace(w, attn_mask=True, documents=False)
        if sinks is not None and not self.native_sinks(w):
            q, k, v, call = sinks_as_first_key(
                q, k, v, sink_logits(sinks, w.heads), scale=w.scale,
                key_padding_mask=key_padding_mask, attn_mask=attn_mask, bias=bias,
            )  # fmt: skip
            out = self.forward(q, k, v, causal=causal, cross=cross, **call)  # checks its output itself
            self._check_untouched(inputs, before)  # the caller's tensors, not the grown copies
            return out
        kw: dict[str, object] = {
            "causal": causal,
            "key_padding_mask": key_padding_mask,
            "attn_mask": attn_mask,
        }
        if w.kv_heads is not None and not self.native_gqa:
            k, v = repeat_kv(k, w.heads), repeat_kv(v, w.heads)  # (B, H, Nk, D|Dv)
        if w.scale is not None:
            if self.native_scale:
                kw["scale"] = w.scale
            else:  # the variant divides by sqrt(D): scores come out as (q k^T) * scale
                q = q * (w.scale * q.shape[-1] ** 0.5)
        if bias is not None:
            kw["bias"] = bias
        if softcap is not None:
            kw["softcap"] = w.softcap
        if window is not None:
            kw["window"] = window
        if sinks is not None:
            kw["sinks"] = sink_logits(sinks, w.heads)  # (B|1, H, Nq|1)
        if documents is not None:
            kw["documents"] = documents
        out = self._attend(q, k, v, **kw)
        self._check_untouched(inputs, before)
        want = (w.batch, w.heads, w.nq, w.v_head_dim)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:  # a third party's bug, named
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(
                f"{type(self).__qualname__}._attend returned {got}; expected a tensor (B, H, Nq, Dv) = {want}"
            )
        # the oracle checks the output in float64, so a float64 answer to a float32 call would pass it
        # while the caller got twice the bytes (and other numbers than the dtype it asked for)
        if out.dtype != q.dtype or out.device != q.device:
            raise TypeError(
                f"{type(self).__qualname__}._attend returned {str(out.dtype).replace('torch.', '')} on "
                f"{out.device}; expected the inputs' {str(q.dtype).replace('torch.', '')} on {q.device}"
            )
        return out

    def _check_untouched(self, inputs: tuple[torch.Tensor | None, ...], before: tuple[int, ...]) -> None:
        """Raise ``RuntimeError`` (one line) naming each of ``inputs`` (in :data:`INPUT_NAMES`' order)
        whose version counter moved since ``before``: ``_attend`` changed it in place, so the oracle
        would check the output against the changed tensor and pass a wrong answer. Tensors sharing
        storage (q, k, v as views of one qkv projection) share a counter, so all of them are named."""
        after = input_versions(inputs)
        if after != before:
            changed = ", ".join(n for n, b, a in zip(INPUT_NAMES, before, after, strict=True) if a != b)
            raise RuntimeError(
                f"{type(self).__qualname__}._attend modified its input {changed} in place: a variant must "
                "leave the caller's tensors as it found them"
            )

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ decoding with a state
    def prefill(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        scale: float | None = None,
        heads: int | None = None,
    ) -> object:
        """The decoding state after the context ``k (B, Hkv, N, D)``, ``v (B, Hkv, N, Dv)``
        (``key_padding_mask (B, N)``, True = real key), for ``heads`` query heads (default ``Hkv``)
        and the score ``scale`` (default ``1/sqrt(D)``; :meth:`step` keeps it). Only where
        ``supports_state``: its size is then independent of ``N``."""
        raise Unsupported(self._no_state())

    def step(
        self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, state: object | None
    ) -> tuple[torch.Tensor, object]:
        """Decode the next positions: ``q (B, H, T, D)``, ``k_new (B, Hkv, T, D)``, ``v_new (B, Hkv, T,
        Dv)`` after the context ``state`` holds (None: no context). Returns the causal output of the
        ``T`` new positions ``(B, H, T, Dv)`` (the rows ``forward(..., causal=True)`` gives them over
        the whole sequence) and the state after them. Only where ``supports_state``."""
        raise Unsupported(self._no_state())

    def _no_state(self) -> str:
        who = self.name or type(self).__name__
        return (
            f"{who} keeps no fixed-size decoding state: it decodes against the K/V cache (forward with "
            "Nq < Nk), which grows with the context"
        )

    def oracle_bytes_per_pair(self) -> int:
        """float64 bytes the oracle's scores take per (query, key) pair: 8 for a plain score. A variant
        whose ``reference_scores`` build more per pair (additive: a hidden layer) says so here."""
        return 8

    def oracle_bytes(self, w: Workload, rows: int | None = None) -> int:
        """Float64 bytes the oracle holds to check ``w``'s output on ``rows`` query rows (all when
        None), without a graph: :meth:`oracle_bytes_per_pair` per query head and (checked query, key)
        pair, and float64 copies of ``q`` (per query head), ``k`` and ``v`` (per K/V head: the oracle
        reads grouped heads without repeating them). An ``oracle_forward`` computes all rows when it
        does not take ``rows=`` (over packed documents too, where each document is computed alone). A
        job checks an ``oracle_forward``'s output only below a budget of this; a reference that holds
        something else (performer's random features) counts it. ``O(1)``."""
        pairs = w.batch * w.heads * self.oracle_rows(w, rows) * w.nk * self.oracle_bytes_per_pair()
        return pairs + self._oracle_input_bytes(w)

    #: how many times what the oracle holds without a graph (less its inputs) its graph holds at the
    #: gradient check's peak: the softmax's scores, exponentials and probabilities and their gradients,
    #: 6.2-6.8x the scores by the profiler (``tests/test_oracle_budget.py``); an own formula says its own
    oracle_graph_copies: ClassVar[float] = 6

    def oracle_graph_bytes(self, w: Workload, rows: int | None = None) -> int:
        """Float64 bytes a job's gradient check holds at its peak: the oracle over ``rows`` of ``w``'s
        query rows (all when None) with the graph of their gradients (:attr:`oracle_graph_copies`
        times :meth:`oracle_bytes` less its inputs), and float64 ``q``, ``k``, ``v`` and their
        gradients. The job checks the gradients in one oracle call below a budget of this, else in
        blocks of the most rows that fit, all rows in turn (``experiments.measure.grad_budget.
        gradient_block``). ``O(1)``."""
        inputs = self._oracle_input_bytes(w)
        return int(self.oracle_graph_copies * (self.oracle_bytes(w, rows) - inputs)) + 2 * inputs

    def oracle_rows(self, w: Workload, rows: int | None = None) -> int:
        """Query rows the oracle computes to check ``rows`` of ``w``'s (all when None): an
        ``oracle_forward`` computes all of them when it does not take ``rows=``. ``O(1)``."""
        custom = getattr(self, "oracle_forward", None)
        every_row = custom is not None and not takes_rows(custom)
        return w.nq if rows is None or every_row else min(rows, w.nq)

    @staticmethod
    def _oracle_input_bytes(w: Workload) -> int:
        """Float64 copies of ``q`` (per query head), ``k`` and ``v`` (per K/V head)."""
        tokens = w.heads * w.nq * w.head_dim + w.hkv * w.nk * (w.head_dim + w.v_head_dim)
        return 8 * w.batch * tokens

    def cache_len(self, nk: int) -> int:
        """Cached keys a decoding step reads after a context of ``nk`` positions: all of them, unless
        the variant's reach is bounded (local_window: the last ``window`` and the first
        ``sink_tokens``)."""
        return nk

    def native_sinks(self, w: Workload) -> bool:
        """Whether ``_attend`` takes the call ``w``'s sink logits itself (``sinks=`` as ``(B|1, H,
        Nq|1)``, their gradient included) instead of :meth:`forward` adding them as one more key and
        feature, which copies q, k and v and grows the head size by one (a kernel tiled by powers of
        two then pads D=64 to 128). ``O(1)``."""
        return False

    def native_documents(self, w: Workload) -> bool:
        """Whether ``_attend`` takes the call ``w``'s packed documents itself (``documents=`` ids ``(B,
        Nk)``) instead of :meth:`forward` handing it their ``(B, 1, Nq, Nk)`` mask: a variant that can
        skip the pairs between documents (attend each one alone) says so here. ``O(1)``."""
        return False

    def sink_keys(self) -> int:
        """How many of the sequence's first keys every query reads by their absolute position
        (local_window's ``sink_tokens``; 0: none). A cache that dropped them (transformers' sliding
        one) would hand other keys in their place and change the output, so a caller that knows
        where its keys start refuses it."""
        return 0

    def left_padding_moves_pattern(self) -> str | None:
        """Why left padding (pads before a sequence's real tokens: a batch prepared for generation)
        gives the real tokens other keys than the sequence alone, or None where it does not: a pattern
        anchored at absolute positions moves with the pads, which are masked but still take positions.
        A caller that batches sequences of several lengths (a model's batch) refuses such a call. Right
        padding lays a pattern over the padded length, pads masked (the pretrained job's queries rely on
        it); sinks are :meth:`sink_keys`'. Default None: every pair, or pairs by their distance only.
        ``O(1)``."""
        return None

    def state_bytes(self, w: Workload) -> int:
        """Bytes one decoding sequence keeps per layer at context length ``w.nk`` (the batch multiplies
        it). Default: the K/V cache, ``Hkv * cache_len(Nk) * (D + Dv)`` elements of ``w.dtype``,
        linear in ``Nk`` unless the reach is bounded; a variant with ``supports_state`` returns its
        state's size, constant in ``Nk``."""
        elem = torch.empty((), dtype=w.dtype).element_size()
        return w.hkv * self.cache_len(w.nk) * (w.head_dim + w.v_head_dim) * elem

    # ------------------------------------------------------------------ structure and work
    def pattern(self, nq: int, nk: int, causal: bool = False) -> torch.Tensor:
        """Boolean ``(Nq, Nk)`` matrix of the (query, key) pairs this variant lets interact.

        Masks passed at call time come on top of it. Default: every pair (causal: key ``j`` visible
        to query ``i`` iff ``j <= i + Nk - Nq``, the bottom-right aligned lower triangle). With
        ``Nq < Nk`` a pattern variant's queries are the last ``Nq`` positions of its sequence.
        """
        allowed = torch.ones(nq, nk, dtype=torch.bool)
        return allowed.tril(causal_offset(nq, nk)) if causal else allowed

    def num_pairs(self, nq: int, nk: int, causal: bool = False) -> int:
        """Number of (query, key) pairs computed; analytic where the pattern is known."""
        if type(self).pattern is AttentionVariant.pattern:
            return full_pairs(nq, nk, causal)
        return int(self.pattern(nq, nk, causal).sum())

    def useful_pairs(self, w: Workload) -> float:
        """The (query, key) pairs the call ``w`` computes usefully, per batch row: :meth:`num_pairs`,
        less the pairs between packed documents. With the documents' lengths (``w.document_lengths``)
        each document counts alone: the pairs of its own pattern among its own keys, of its queries
        (the call's last ``Nq`` positions), averaged over the rows. That is what packed documents mean
        for a variant that takes them (a pattern the same at every position: local_window's band),
        and for every pair the share of them kept. With only that share (``w.pair_share``), a variant
        with every pair in its pattern subtracts it and a pattern keeps its pairs. Key padding is not
        subtracted. ``O(B * documents)`` calls of :meth:`num_pairs`, ``O(1)`` each where the pattern
        is analytic."""
        if w.document_lengths:
            first = w.nk - w.nq  # the first query's position
            total = 0
            for row in w.document_lengths:
                start = 0
                for n in row:
                    queries = start + n - max(start, first)  # this document's, its last positions
                    if queries > 0:
                        total += self.num_pairs(queries, n, w.causal)
                    start += n
            return total / len(w.document_lengths)
        pairs = self.num_pairs(w.nq, w.nk, w.causal)
        return pairs * w.pair_share if pairs == full_pairs(w.nq, w.nk, w.causal) else pairs

    def flops(self, w: Workload, mode: str = "fwd") -> int:
        """Useful FLOPs of ``mode`` ('fwd', 'bwd' or 'fwd_bwd') for workload ``w``.

        Forward is ``B * H * pairs * (2*D + 2*Dv)`` over :meth:`useful_pairs` (FlashAttention
        convention: useful pairs, not what a blocked kernel computes); backward counts 2.5x forward.
        """
        fwd = w.batch * w.heads * self.useful_pairs(w) * (2 * w.head_dim + 2 * w.v_head_dim)
        factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
        return int(fwd * factor)

    # ------------------------------------------------------------------ oracle hooks
    def reference_scores(self, q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Float64 ``(B, H, Nq, Nk)`` scores the oracle softmaxes; default ``q k^T * scale``, ``k (B, Hkv,
        Nk, D)`` read by grouped heads (:func:`grouped_matmul`). An override gets ``k`` with as many
        heads as ``q``: the oracle repeats them for it."""
        s = q.shape[-1] ** -0.5 if scale is None else scale
        return grouped_matmul(q.double(), k.double().transpose(-2, -1)) * s

    def describe(self) -> dict[str, object]:
        """The variant's name, knobs and facts, for records."""
        return {
            "name": self.name,
            "exact": self.exact,
            "knobs": self.knobs(),
        }

    def knobs(self) -> dict[str, object]:
        """The structural knobs this instance was built with (override to list them)."""
        return {}
