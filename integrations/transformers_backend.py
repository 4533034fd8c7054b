"""Every attnbench variant as a Hugging Face transformers attention backend.

transformers (>= 5.0, the optional extra ``attnbench[hf]``) is imported lazily, inside the functions
that need it: ``import variants`` never imports this module, and this module imports without
transformers installed.

Usage::

    from integrations import transformers_backend as hf

    hf.register(knobs={"flex": {"compile": False}, "local_window": {"window": 64}})  # every variant
    # from_config writes attn_implementation into the config it is given: pass a copy
    impl = hf.implementation("sdpa")  # attnbench_SDPA
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
    model.generate(ids, attention_mask=mask, max_new_tokens=8)  # prefill and decode through sdpa
    hf.attach(model, "additive", hidden=32)  # learned variant: one instance per layer, in the state dict

What transformers calls, and what this module does with it:

- **Attention function** (``AttentionInterface``), one per variant: called by every attention layer
  with ``query (B, H, Nq, D)``, ``key``/``value (B, Hkv, Nk, D)`` (after the cache update, grouped heads
  not repeated), ``attention_mask`` (whatever the mask function below returned), ``scaling`` and
  ``dropout``; it must return ``(output (B, Nq, H, Dv), weights or None)``. The variant gets the grouped
  K/V as they are (variants read them without a copy where they can), ``scaling`` as ``scale=`` (left
  out when it is the default ``1/sqrt(D)``, and for a variant whose scores have no scale, additive),
  and the mask as below. Weights are always None.
- **Mask function** (``AttentionMaskInterface``): transformers calls it once per forward pass (not
  per layer) from ``create_causal_mask`` / ``create_bidirectional_mask`` with ``mask_function`` (the
  pattern as a predicate ``(b, h, q_idx, kv_idx) -> bool``), the 2-D ``attention_mask (B, past + Nq)``
  (True = real token), ``q_length``, ``kv_length``, ``q_offset`` and ``kv_offset`` (the positions of
  the first query and the first key in the cache). It returns a :class:`MaskSpec`:

  * the pattern is transformers' plain causal predicate -> ``causal=True`` (bottom-right, the suite's
    convention: the queries are the last ``Nq`` keys) and ``key_padding_mask (B, Nk)`` cut from the
    2-D mask, or None when no key is padding. With a ``DynamicCache`` (prefill, prefill onto a
    cache, decoding) the queries are the last keys (``q_offset + Nq == kv_offset + Nk``); a static
    cache has empty slots after the last query, which causal attention never reads: the spec says
    how many keys are used and the layer passes only those (a view), as transformers' sdpa does;
  * the pattern is the plain bidirectional predicate -> ``causal=False`` and the key padding;
  * a sliding window (the mask equals causal or bidirectional attention with key padding and a band
    whose radius the config gives: ``sliding_window`` W -> W - 1, ModernBERT's ``local_attention``
    -> half), checked element by element against transformers' own mask -> the same with
    ``window=`` (local_window takes the narrower of its window and the model's; variants with an
    ``attn_mask`` get the band as one; the rest refuse);
  * packed sequences (``position_ids`` that restart inside a row and no 2-D mask: transformers then
    keeps each query to its own sequence) -> ``causal=True`` with ``documents (B, N)`` ids read off
    the mask's first sub-diagonal (a query that cannot see the key just before it begins a document),
    and a window where the config has one, kept only if the spec's own mask equals transformers'
    element by element; the variant gets ``documents=`` (sdpa and flex skip the pairs between
    documents, the recurrences drop their state at each start, the variants with an ``attn_mask``
    get the mask; the rest refuse);
  * anything else (chunked predicates, extra overlays) ->
    transformers' own boolean mask ``(B, 1, Nq, Nk)``, materialised once per forward pass, passed as
    ``attn_mask`` (pattern variants take no ``attn_mask``: they raise :class:`variants.Unsupported`
    with the reason).

  A layer's call that is not causal and reads another sequence's keys (an encoder-decoder's
  cross-attention: :func:`is_cross_attention` tells it from the module and the call) reaches the
  variant with ``cross=True``: variants whose pattern or recurrence relates query and key positions
  refuse it with the reason instead of reading the decoder's queries as the last encoder positions.
  The spec also keeps ``kv_offset``: a variant that reads the sequence's first keys (local_window's
  sink tokens) refuses a layer whose cache starts past them unless the suite's rolling cache kept
  them (transformers' sliding cache drops them, and the output would silently change).

  Left padding is key padding: a padded key is masked for every query, and the rows of padded
  queries (which see no key) come out as zeros (transformers' eager gives them a uniform average:
  compare non-pad positions only). A 4-D tensor mask the caller built itself is passed on as
  ``attn_mask`` (boolean) or ``bias`` (float, additive).
- **Other keywords**: ``position_bias`` (T5, Inkling2) becomes ``bias=``; a sink logit (gpt-oss's
  ``s_aux`` ``(H,)``, Inkling2's ``sinks`` ``(B, H, Nq, 1)``) becomes ``sinks=``; those in
  ``softcap`` (Gemma2) becomes ``softcap=`` (refused with the reason by variants that cannot
  apply it); an indexer's ``indices`` (DeepSeek-V3.2's top-k keys per query) joins the mask as an
  ``attn_mask``; those in :data:`HARMLESS_KEYWORDS` reached the variant another way (the mask) and
  pass; any other keyword with a value (``block_indices``) is refused in one line naming it, never
  dropped.
- Without the mask function transformers would pass no mask at all (padding silently ignored), so
  :func:`register` registers both under ``attnbench_<name>``.

Learned variants (``has_params``, e.g. additive) need one instance per layer: :func:`attach` adds it
to every attention module as the submodule ``attnbench_attention`` (so it is in ``state_dict()``, moves
with ``.to()`` and trains with the model) and switches the model to ``attnbench_<name>``. Stateless
variants share one instance per registered name, built by :func:`register` with that name's knobs;
``attach`` also works for them (per-model knobs). A registered name keeps its knobs for good (a model
already built on it must not change): other knobs get a name of their own, ``register_as("w64",
"local_window", window=64)`` -> ``attnbench_w64``, or ``implementation_for("local_window", {"window":
64})`` -> ``attnbench_local_window@window=64``. flex compiles per shape by default, so decoding (a new key
length every token) recompiles: pass ``{"flex": {"compile": False}}`` on the CPU.

Two variants in one model (stateless ones): :func:`register_layers` puts one on the layers the model
calls sliding (Gemma2/3, Qwen2, Mistral, Ministral: their ``sliding_window`` keyword or
``layer_types``; a model that says neither: those whose mask is a window) and another on the rest
(:func:`implementation_for_roles` names a pair by its settings);
:func:`register_by_layer` (or :func:`implementation_for_layers`) picks one per layer index, for a
model without sliding layers of its own (a local/global mix imposed on a BERT encoder).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from variants.base import AttentionVariant, Unsupported
from variants.masks import document_mask
from variants.registry import available, build, check_knobs, get

PREFIX = "attnbench_"
#: attribute name of the per-layer variant instance that :func:`attach` adds to an attention module
ATTACHED = "attnbench_attention"

# each registered name (a variant's, or an alias) -> its variant, its knobs and, for a stateless
# variant, the one instance every layer calls; fixed once registered (models built on it keep it)
_VARIANT: dict[str, str] = {}
_KNOBS: dict[str, dict[str, Any]] = {}
_SHARED: dict[str, AttentionVariant] = {}
# a registered name that mixes two variants: one for sliding-window layers, one for the others
_LAYERS: dict[str, dict[str, AttentionVariant]] = {}
# a registered name that runs one variant per layer index (the attention module's layer_idx)
_BY_INDEX: dict[str, list[AttentionVariant]] = {}


def implementation(name: str) -> str:
    """The ``attn_implementation`` string of registered name ``name``: ``attnbench_<name>``, with
    ``sdpa`` spelled ``SDPA`` and ``flash`` ``FLASH``: transformers reads any implementation whose
    name contains ``sdpa`` as its own SDPA path (and refuses it for models it has not cleared for SDPA:
    Gemma2, gpt-oss) and one containing ``flash`` as a FlashAttention request, neither of which is
    this backend (``attnbench_SDPA``, ``attnbench_SDPA@backend=FLASH``)."""
    return PREFIX + name.replace("sdpa", "SDPA").replace("flash", "FLASH")


def cache_keyword(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes its K/V cache by: ``cache`` from the transformers release
    that renamed it (5.2x, which warns on ``past_key_values`` and drops it in 5.40), else
    ``past_key_values``. ``O(1)``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def name_of(impl: str) -> str:
    """The registered name behind an ``attn_implementation`` string (:func:`implementation`'s
    inverse); one-line ``ValueError`` for a string that is not an attnbench one."""
    if not impl.startswith(PREFIX):
        raise ValueError(f"attn_implementation={impl!r} is not an attnbench one ({PREFIX}<name>)")
    fallback = impl[len(PREFIX) :].replace("SDPA", "sdpa").replace("FLASH", "flash")
    return next((n for n in _VARIANT if implementation(n) == impl), fallback)


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """What the mask function hands to every layer of one forward pass.

    Either ``causal`` (bottom-right: the queries are the last ``Nq`` of the first ``keys_used`` keys)
    and/or ``key_padding_mask (B, keys_used)`` (True = real key; None = no padding), or a general
    boolean ``attn_mask (B, 1, Nq, Nk)`` (True = may attend) with ``causal=False`` and no padding mask.
    ``keys_used < kv_length`` only for a static cache: the keys past the last query are empty slots
    that causal attention never reads, and the layer passes the first ``keys_used`` (a view).
    """

    causal: bool
    key_padding_mask: torch.Tensor | None
    attn_mask: torch.Tensor | None
    q_length: int
    kv_length: int
    keys_used: int
    window: int | None = None  # a sliding window found in the model's mask: |p - j| <= window
    device: torch.device | str | None = None  # where dense() builds the mask (the model's device)
    # the sequence position of the first key the layers are handed: > 0 once a cache dropped keys
    # (transformers' sliding one keeps the last W - 1; the suite's rolling one keeps sinks and a band)
    kv_offset: int = 0
    # packed sequences: (B, Nk) ids, one per key, each document one run; a query sees its own only
    documents: torch.Tensor | None = None
    # generate() with a static (compileable) cache builds the masks before the forward pass, calls
    # .contiguous() on them and hands them back to create_causal_mask, which reads .ndim: these two
    # let the spec pass through unchanged (the mask function returns a spec it is given as is)
    ndim: ClassVar[int] = 4

    def contiguous(self) -> MaskSpec:
        """Itself (transformers calls ``.contiguous()`` on pre-built masks)."""
        return self

    def dense(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The mask as transformers' sdpa path gets it: boolean ``(B|1, 1, Nq, Nk)``, True = may
        attend (a static cache's empty slots False); ``rows`` (query indices, ``(R,)``): only those
        rows, ``(B|1, 1, R, Nk)``. ``O(Nq Nk)`` (``O(R Nk)``): only for a model that reads the mask
        itself, and for checking a window against a model's mask."""
        if self.attn_mask is not None:
            return self.attn_mask if rows is None else self.attn_mask[:, :, rows.to(self.attn_mask.device)]
        device = self.device if self.key_padding_mask is None else self.key_padding_mask.device
        keys = torch.arange(self.kv_length, device=device)[None, :]  # (1, Nk)
        idx = torch.arange(self.q_length, device=device) if rows is None else rows.to(device)  # (R,)
        pos = idx[:, None] + (self.keys_used - self.q_length)  # (R, 1)
        seen = (keys < self.keys_used).expand(len(idx), -1)  # (R, Nk); query idx[i] is position pos[i]
        if self.causal:  # bottom-right over the keys used
            seen = seen & (keys <= pos)
        if self.window is not None:  # comparisons of (Nq, 1) with (1, Nk): booleans only, no int tensor
            seen = seen & (keys >= pos - self.window) & (keys <= pos + self.window)
        seen = seen[None, None]  # (1, 1, R, Nk)
        if self.documents is not None:  # the queries are the last Nq of the Nk keys
            seen = seen & document_mask(self.documents, self.q_length, idx)  # (B, 1, R, Nk)
        if self.key_padding_mask is not None:
            pad = torch.ones(self.key_padding_mask.shape[0], self.kv_length, dtype=torch.bool, device=device)
            pad[:, : self.keys_used] = self.key_padding_mask
            seen = seen & pad[:, None, None, :]  # (B, 1, R, Nk)
        return seen

    def __getitem__(self, index: Any) -> torch.Tensor:
        """``dense()[index]``: a model that slices the mask it is handed (DeepSeek-V3.2's indexer reads
        ``mask[:, 0]``) gets the boolean mask's slice."""
        return self.dense()[index]

    def __repr__(self) -> str:
        if self.attn_mask is not None:
            return f"MaskSpec(attn_mask {tuple(self.attn_mask.shape)})"
        pad = "none" if self.key_padding_mask is None else tuple(self.key_padding_mask.shape)
        docs = "" if self.documents is None else f", documents={tuple(self.documents.shape)}"
        return (
            f"MaskSpec(causal={self.causal}, key_padding={pad}, Nq={self.q_length}, Nk={self.kv_length}, "
            f"keys_used={self.keys_used}{docs})"
        )


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | MaskSpec | None = None,
    **kwargs: Any,
) -> MaskSpec:
    """The mask for one forward pass, in the form the attention function reads (see the module doc).

    ``attention_mask`` is transformers' 2-D ``(B, past + Nq)`` padding mask (boolean, True = real) or
    None; the result covers ``Nq = q_length`` queries at positions ``q_offset ...`` and ``Nk =
    kv_length`` keys at positions ``kv_offset ...``.
    """
    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )

    if isinstance(attention_mask, MaskSpec):  # pre-built by generate() (static cache): already done
        return attention_mask
    if mask_function is None:
        mask_function = causal_mask_function
    # one past the last query's position; a static cache passes q_offset as a 0-d tensor
    q_end = int(q_offset) + q_length
    causal = {causal_mask_function: True, bidirectional_mask_function: False}.get(mask_function)
    # causal: keys from the last query's position on are never seen (a static cache's empty slots)
    used = min(q_end - kv_offset, kv_length) if causal else kv_length
    if causal is not None and used > 0 and (not causal or q_end == kv_offset + used):
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)  # (B, >= kv_offset + Nk)
        if padding is not None:
            padding = padding[:, kv_offset : kv_offset + used]  # (B, keys_used): the keys this call reads
            if bool(padding.all()):
                padding = None
        device = kwargs.get("device") or (None if attention_mask is None else attention_mask.device)
        return MaskSpec(causal, padding, None, q_length, kv_length, used, None, device, kv_offset)
    config = kwargs.get("config")
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    full = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )  # (B, 1, Nq, Nk) bool, True = may attend
    banded = _as_window(full, config, attention_mask, q_length, kv_length, q_end, kv_offset)
    if banded is not None:
        return banded
    if attention_mask is None and q_length == kv_length and q_end == kv_length and kv_offset == 0:
        packed = _as_documents(full, config)
        if packed is not None:
            return packed
    return MaskSpec(False, None, full, q_length, kv_length, kv_length, None, None, kv_offset)


def _equal_to(spec: MaskSpec, full: torch.Tensor) -> bool:
    """Whether ``spec``'s own mask is transformers' ``full (B|1, 1, Nq, Nk)``, element by element: a few
    rows first (the first, last and some between), where a wrong candidate is dropped at ``O(rows
    Nk)``; only one that matches them is compared whole (``O(Nq Nk)``: about 1 GiB of booleans at 32k,
    where checking every candidate whole took 13 s of a prefill)."""
    n = spec.q_length
    rows = torch.unique(torch.linspace(0, n - 1, min(n, 9)).round().long()).to(full.device)
    some = full.expand(-1, -1, n, -1)[:, :, rows]  # (B|1, 1, R, Nk)
    if not torch.equal(spec.dense(rows).expand_as(some), some):
        return False
    return torch.equal(spec.dense().expand_as(full), full)


def _as_documents(full: torch.Tensor, config: Any) -> MaskSpec | None:
    """``full (B|1, 1, N, N)`` as causal attention over packed documents (a row's sequences one after
    another, as transformers masks ``position_ids`` that restart), with a window where the config
    gives one: the ids are read off the first sub-diagonal (query ``i`` that cannot see key ``i - 1``
    begins a document), and kept only if the spec's mask equals ``full``. None otherwise, or where
    every row is one document (then it is not packing). ``O(N^2)`` booleans, once per forward pass."""
    n = full.shape[-1]
    if n < 2:
        return None
    starts = ~full[:, 0].diagonal(-1, -2, -1)  # (B|1, N - 1): query i + 1 cannot see key i
    if not bool(starts.any()):
        return None
    ids = torch.nn.functional.pad(starts, (1, 0)).long().cumsum(-1)  # (B|1, N)
    sizes = [getattr(config, a, None) for a in ("sliding_window",)]
    radii = [None] + sorted({size - 1 for size in sizes if isinstance(size, int) and size > 0})
    for radius in radii:
        spec = MaskSpec(True, None, None, n, n, n, radius, full.device, 0, ids)
        if _equal_to(spec, full):
            return spec
    return None


def _as_window(
    full: torch.Tensor,
    config: Any,
    attention_mask: torch.Tensor | None,
    q_length: int,
    kv_length: int,
    q_end: int,
    kv_offset: int,
) -> MaskSpec | None:
    """``full`` as a sliding window over causal or bidirectional attention with key padding, when it
    is exactly one (Mistral, Qwen2's and Gemma2/3's sliding layers, ModernBERT's local layers): the
    spec then carries the window and no ``(Nq, Nk)`` mask, so window variants take the layer as a
    window. The radius is tried from the config (``sliding_window`` W: W - 1 causal, W // 2 both ways;
    ``local_attention``: half of it) and kept only if the spec's own mask equals ``full`` element by
    element; None otherwise (the general mask stays)."""
    from transformers.masking_utils import prepare_padding_mask

    sizes = [getattr(config, a, None) for a in ("sliding_window", "local_attention")]
    radii = sorted({r for size in sizes if isinstance(size, int) and size > 0 for r in (size - 1, size // 2)})
    if not radii or full is None:
        return None
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    for causal in (True, False):
        used = min(q_end - kv_offset, kv_length) if causal else kv_length
        if used <= 0 or (causal and q_end != kv_offset + used):
            continue
        pad = None if padding is None else padding[:, kv_offset : kv_offset + used]  # (B, keys_used)
        pad = None if pad is None or bool(pad.all()) else pad
        for radius in radii:
            spec = MaskSpec(causal, pad, None, q_length, kv_length, used, radius, full.device, kv_offset)
            if _equal_to(spec, full):
                return spec
    return None


def _check_padding_kept(name: str, module: nn.Module, variant: AttentionVariant, mask: object) -> None:
    """One-line :class:`Unsupported` when a row of the batch begins with padding and ``variant``'s
    pattern moves with it (:meth:`~variants.base.AttentionVariant.left_padding_moves_pattern`:
    sparse's blocks, axial's grid): its real tokens would attend to other keys than the sequence alone
    does, and the output would be silently other than the unpadded model's. ``O(B)``."""
    pad = mask.key_padding_mask if isinstance(mask, MaskSpec) else None  # (B, keys_used), True = real
    if pad is None:
        return
    rows = [int(b) for b in (pad.any(-1) & ~pad[:, 0]).nonzero().flatten()]  # real tokens after pads
    why = variant.left_padding_moves_pattern() if rows else None
    if why:
        raise Unsupported(
            f"{_where(name, module)}: rows {rows} are left-padded, but {why}: run one sequence per batch, "
            "or pad on the right (the pattern then lies over the padded length, pads masked)"
        )


def _check_sinks_kept(
    name: str, module: nn.Module, variant: AttentionVariant, mask: object, key: torch.Tensor
) -> None:
    """One-line :class:`Unsupported` when ``variant`` reads the sequence's first keys (its
    :meth:`~variants.base.AttentionVariant.sink_keys`) but a row begins with padding (left padding:
    the sinks would be pads, which the mask hides), or the layer's cache starts past position 0 and
    did not keep them (transformers' sliding cache): the first keys it hands over are others, and
    the output would be silently wrong. The suite's rolling cache keeps them
    (:func:`integrations.streaming_cache.sinks_kept`)."""
    need = variant.sink_keys()
    if not need or not isinstance(mask, MaskSpec):
        return
    pad = mask.key_padding_mask
    if pad is not None and not bool(pad[:, :need].all()):  # left padding: the first keys are pads
        rows = [int(b) for b in (~pad[:, :need]).any(-1).nonzero().flatten()]
        raise Unsupported(
            f"{_where(name, module)}: {variant.name} reads the sequence's first {need} keys (its sink "
            f"tokens), but rows {rows} begin with padding (left padding), which the mask hides: their "
            "sinks would be no keys at all; pad on the right, or run without sink tokens"
        )
    if mask.kv_offset <= 0:
        return
    from integrations.streaming_cache import sinks_kept  # imports transformers: installed here

    if sinks_kept(key) < need:
        raise Unsupported(
            f"{_where(name, module)}: {variant.name} reads the sequence's first {need} keys (its sink "
            f"tokens), but this layer's cache starts at position {mask.kv_offset} and dropped them (a "
            "sliding-window cache?): decode with integrations.streaming_cache.streaming_cache, which keeps "
            "them, or without sink tokens"
        )


def _variant_for(module: nn.Module, name: str) -> AttentionVariant:
    """The instance that attends for ``module``: its attached one, else the shared one of ``name``
    (a registered name: a variant's or an alias)."""
    variant = _VARIANT.get(name, name)
    attached = module._modules.get(ATTACHED)  # not getattr: nn.Module's raises (slow) when absent
    if isinstance(attached, AttentionVariant) and attached.name == variant:
        return attached
    shared = _SHARED.get(name)
    if shared is not None:
        return shared
    if get(variant).has_params:
        raise Unsupported(
            f"{implementation(name)}: {variant} has learned parameters, one set per layer: call "
            f"integrations.transformers_backend.attach(model, '{variant}') before running the model"
        )
    raise Unsupported(
        f"{implementation(name)} is not registered: call integrations.transformers_backend.register()"
    )


def _mask_args(
    module: nn.Module, attention_mask: object, nq: int, nk: int, is_causal: bool | None
) -> dict[str, Any]:
    """The variant's mask keywords (``causal``, ``key_padding_mask``, ``attn_mask``, ``bias``) for the
    ``attention_mask`` transformers passed to a layer with ``nq`` queries and ``nk`` keys."""
    if isinstance(attention_mask, MaskSpec):
        if (attention_mask.q_length, attention_mask.kv_length) != (nq, nk):
            raise ValueError(
                f"the mask was built for Nq={attention_mask.q_length}, Nk={attention_mask.kv_length} but "
                f"the layer has Nq={nq}, Nk={nk} (a cache whose layers hold different lengths?)"
            )
        args = {
            "causal": attention_mask.causal,
            "key_padding_mask": attention_mask.key_padding_mask,
            "attn_mask": attention_mask.attn_mask,
        }
        if attention_mask.window is not None:
            args["window"] = attention_mask.window
        if attention_mask.documents is not None:
            args["documents"] = attention_mask.documents
        return args
    if attention_mask is None:  # no mask built (a model that never calls the mask function)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        return {"causal": bool(causal)}
    if isinstance(attention_mask, torch.Tensor):  # a 4-D mask the caller built
        if attention_mask.dtype == torch.bool:
            return {"attn_mask": attention_mask}
        return {"bias": attention_mask}
    raise TypeError(
        f"attnbench backends read a MaskSpec, a tensor or None as attention_mask; got "
        f"{type(attention_mask).__name__} (was the mask built for another attn_implementation?)"
    )


def is_cross_attention(module: nn.Module, causal: bool, nq: int, nk: int, masked: bool = False) -> bool:
    """Whether a layer's call attends to another sequence (an encoder-decoder's cross-attention)
    rather than to its own: the module's ``is_cross_attention`` where it has one (BERT-style
    decoders); else a class named ``*Cross*``; else a call that is not causal and either has a
    different number of queries and keys without a general mask (``masked``: a model's sliding-window
    or indexed mask, which decodes against a cache; transformers' encoders keep no cache) or comes
    from a decoder's non-causal module (BART, T5, Whisper: ``is_decoder`` and not ``is_causal``). A
    causal call is never cross-attention."""
    if causal:
        return False
    flag = getattr(module, "is_cross_attention", None)
    if isinstance(flag, bool):
        return flag
    if "Cross" in type(module).__name__:
        return True
    if nq != nk and not masked:
        return True
    return bool(getattr(module, "is_decoder", False)) and not getattr(module, "is_causal", True)


def _describe_call(query: torch.Tensor, key: torch.Tensor, kw: dict[str, Any]) -> str:
    """One line with the shapes and masks of a call, for error messages."""
    parts = [f"q {tuple(query.shape)}", f"k/v {tuple(key.shape)}"]
    if kw.get("causal"):
        parts.append("causal")
    if kw.get("window") is not None:
        parts.append(f"window {kw['window']}")
    if kw.get("cross"):
        parts.append("cross-attention")
    for k in ("key_padding_mask", "attn_mask", "bias", "documents"):
        if kw.get(k) is not None:
            parts.append(f"{k} {tuple(kw[k].shape)}")
    if kw.get("scale") is not None:
        parts.append(f"scale {kw['scale']:g}")
    if kw.get("sinks") is not None:
        parts.append(f"sinks {tuple(kw['sinks'].shape)}")
    if kw.get("softcap") is not None:
        parts.append(f"softcap {kw['softcap']:g}")
    return ", ".join(parts)


def _where(name: str, module: nn.Module) -> str:
    """``attnbench_<name> in <LayerClass> (layer <i>)``, for error messages."""
    return f"{implementation(name)} in {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


#: keywords transformers may pass an attention function that need nothing from the variant: what
#: they say reached it another way (the mask function turns packed sequences, given by position_ids
#: and the cu_seq_lens / max_length pair, and sliding windows into the mask it builds; the cache is
#: already in key and value), or ask for what the model collects elsewhere (its hidden states);
#: ``output_attentions=True`` is refused: these variants return no weights
HARMLESS_KEYWORDS = frozenset(
    {
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
        "sliding_window",
        "output_hidden_states",
        "output_router_logits",
        "num_items_in_batch",
        "use_cache",
        "cache_position",
        "past_key_values",
        "cache",  # past_key_values' new name (transformers 5.2x on)
        "position_embeddings",
    }
)
#: keywords the attention function turns into the variant's arguments
HONOURED_KEYWORDS = frozenset({"is_causal", "position_bias", "sinks", "s_aux", "softcap", "indices"})


def _refuse_unknown_keywords(where: str, kwargs: dict[str, Any]) -> None:
    """One ``Unsupported`` line naming each keyword with a value that the backend neither honours nor
    knows to be harmless: a score-changing argument (``softcap``, an indexer's ``indices``) must
    never be dropped without a word."""
    dropped = sorted(
        key
        for key, value in kwargs.items()
        if value is not None and value is not False and key not in HARMLESS_KEYWORDS | HONOURED_KEYWORDS
    )
    if dropped:
        raise Unsupported(
            f"{where}: attnbench variants do not take {', '.join(dropped)} (the model passes "
            f"{'it' if len(dropped) == 1 else 'them'} to its attention function; ignoring "
            f"{'it' if len(dropped) == 1 else 'them'} would change the output without a word)"
        )


def _only_indexed(attention_mask: object, indices: torch.Tensor, nk: int) -> torch.Tensor:
    """The layer's mask restricted to the keys an indexer chose, ``indices (B, Nq, topk)`` (entries
    of -1 or past ``Nk``: none), as a boolean ``(B, 1, Nq, Nk)`` ``attn_mask``: what transformers'
    eager and sdpa paths compute for DeepSeek-V3.2. Variants that take an ``attn_mask`` then attend
    exactly over those keys; the others refuse it with their reason."""
    b, nq = indices.shape[:2]
    idx = indices.long()
    valid = (idx >= 0) & (idx < nk)
    chosen = torch.zeros(b, nq, nk + 1, dtype=torch.bool, device=indices.device)  # column nk: discarded
    chosen.scatter_(-1, torch.where(valid, idx, nk), True)
    chosen = chosen[:, None, :, :nk]  # (B, Nq, Nk + 1) -> (B, 1, Nq, Nk)
    if isinstance(attention_mask, MaskSpec):
        return attention_mask.dense() & chosen
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype != torch.bool:
        raise Unsupported(
            "an indexer's indices with a float attention mask the caller built: pass a boolean one"
        )
    return chosen if attention_mask is None else attention_mask & chosen


def _longest_run(ids: torch.Tensor) -> int:
    """The longest document of packed ``ids (B, N)`` (each document one run of one id). ``O(B N)``."""
    return max(int(torch.unique_consecutive(row, return_counts=True)[1].max()) for row in ids)


def _sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The sink logits a model passes: gpt-oss's ``s_aux`` ``(H,)``, Inkling2's ``sinks`` ``(B, H,
    Nq, 1)`` -> ``(B, H, Nq)``; None without."""
    sinks = kwargs.get("sinks")
    if sinks is None:
        sinks = kwargs.get("s_aux")
    if sinks is not None and sinks.dim() == 4 and sinks.shape[-1] == 1:
        sinks = sinks[..., 0]  # (B, H, Nq, 1) -> (B, H, Nq)
    return sinks


def _make_attention(name: str) -> Callable[..., tuple[torch.Tensor, None]]:
    """The attention function transformers calls for ``attn_implementation="attnbench_<name>"``."""

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: object,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """``query (B, H, Nq, D)``, ``key (B, Hkv, Nk, D)``, ``value (B, Hkv, Nk, Dv)`` -> ``(output
        (B, Nq, H, Dv), None)``, attended by variant ``name``."""
        if dropout:
            raise Unsupported(
                f"{_where(name, module)}: attnbench variants have no attention dropout ({dropout=})"
            )
        # the keyword, else the model's config (transformers then gathers weights from the layers'
        # outputs without telling the attention function: the caller got an empty tuple)
        wants = kwargs.get(
            "output_attentions", getattr(getattr(module, "config", None), "output_attentions", False)
        )
        if wants:  # the caller would read an empty tuple as the weights
            raise Unsupported(
                f"{_where(name, module)}: output_attentions=True, but attnbench variants return no "
                "attention weights (attn_implementation='eager' does)"
            )
        _refuse_unknown_keywords(_where(name, module), kwargs)  # output_attentions=False passes
        window = kwargs.get("sliding_window")
        spec = attention_mask if isinstance(attention_mask, MaskSpec) else None
        if window and spec is not None and spec.attn_mask is None and spec.window is None:
            # a sliding layer whose mask shows no window: fine where the window cuts nothing (every
            # key, or every packed document, within it); then it runs as a window, so a layer mix
            # sends it to its sliding variant (packed documents shorter than W went to the full one)
            cuts_nothing = key.shape[2] <= window or (
                spec.documents is not None and spec.causal and _longest_run(spec.documents) <= window
            )
            if not cuts_nothing:  # the window must have reached the mask function as its predicate
                raise Unsupported(
                    f"{_where(name, module)}: the layer has sliding_window={window} but its mask is plain "
                    f"{'causal' if spec.causal else 'bidirectional'} over {key.shape[2]} keys"
                )
            if spec.causal:
                attention_mask = replace(spec, window=window - 1)  # key j seen from p iff p - j < W
        if kwargs.get("indices") is not None:  # an indexer's top-k keys per query (DeepSeek-V3.2)
            attention_mask = _only_indexed(attention_mask, kwargs["indices"], key.shape[2])
        kw = _mask_args(module, attention_mask, query.shape[2], key.shape[2], kwargs.get("is_causal"))
        mix = _LAYERS.get(name)
        if mix is not None:
            role = _layer_role(module, kwargs) or ("sliding" if "window" in kw else "full")
            variant = mix[role]
        elif name in _BY_INDEX:
            variant = _by_index(name, module)
        else:
            variant = _variant_for(module, name)
        _check_sinks_kept(name, module, variant, attention_mask, key)
        masked = kw.get("attn_mask") is not None
        if is_cross_attention(module, bool(kw.get("causal")), query.shape[2], key.shape[2], masked):
            kw["cross"] = True  # the keys are the encoder's: no decoder position stands among them
        sinks = _sinks(kwargs)
        if sinks is not None:
            kw["sinks"] = sinks
        if kwargs.get("softcap") is not None:  # Gemma2's attention logit soft-capping
            kw["softcap"] = float(kwargs["softcap"])
        position_bias = kwargs.get("position_bias")
        if position_bias is not None:
            kw["bias"] = position_bias if kw.get("bias") is None else kw["bias"] + position_bias
        if scaling is not None and scaling != query.shape[-1] ** -0.5 and variant.supports_scale:
            kw["scale"] = float(scaling)
        used = attention_mask.keys_used if isinstance(attention_mask, MaskSpec) else key.shape[2]
        if used < key.shape[2]:  # a static cache: the empty slots past the last query are left out
            key, value = key[:, :, :used], value[:, :, :used]  # (B, Hkv, keys_used, D|Dv), views
            if kw.get("bias") is not None and kw["bias"].shape[-1] > 1:
                kw["bias"] = kw["bias"][..., :used]  # (..., keys_used)
        try:
            out = variant(query, key, value, **kw)  # (B, H, Nq, Dv)
        except Unsupported as exc:
            where = _where(name, module)
            raise Unsupported(f"{where} cannot run {_describe_call(query, key, kw)}: {exc}") from None
        # after the call, so that what the variant refuses of the model (a window) is said before what
        # it refuses of this batch; the output is not returned
        _check_padding_kept(name, module, variant, attention_mask)
        # (B, H, Nq, Dv) -> (B, Nq, H, Dv); contiguous so that the layer's reshape is a view
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = attention.__qualname__ = implementation(name)
    return attention


def register(names: Iterable[str] | None = None, knobs: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """Register variants (default: every one in :func:`variants.available`) with transformers.

    Each ``name`` becomes ``attn_implementation="attnbench_<name>"`` in ``AttentionInterface`` and
    ``AttentionMaskInterface``; ``knobs[name]`` are its constructor knobs (checked here: an unknown
    knob or a wrong type is a one-line ``ValueError``). Stateless variants get one shared instance
    built now; learned ones are built per layer by :func:`attach`. A registered name keeps its knobs:
    registering it again with the same ones does nothing, with others is a ``ValueError`` (models
    already built on it would change), and registering every variant again (``names`` None) leaves
    those given no knobs as they were; :func:`register_as` or :func:`implementation_for` give other
    knobs a name of their own. Returns the implementation names registered.
    """
    knobs = dict(knobs or {})
    every = names is None
    names = list(available()) if every else list(names)
    unknown = set(knobs) - set(names)
    if unknown:
        raise ValueError(f"knobs given for variants not being registered: {', '.join(sorted(unknown))}")
    for name, given in knobs.items():  # a misspelt knob is said before any clash of another variant
        check_knobs(get(name), dict(given), name)
    # every variant, again: one registered before and not given knobs now keeps its own (a second
    # register(knobs=...) blamed flex, registered with compile=False, for a local_window window)
    return [
        implementation(name)
        if every and name not in knobs and name in _VARIANT and _VARIANT[name] == name
        else register_as(name, name, **knobs.get(name, {}))
        for name in names
    ]


def register_as(alias: str, name: str, **knobs: Any) -> str:
    """Register variant ``name`` with ``knobs`` as ``attn_implementation="attnbench_<alias>"``: two
    configurations of one variant side by side (``register_as("window_4", "local_window", window=4)``).
    Fixed once registered, as in :func:`register`. Returns the implementation name."""
    cls = get(name)  # UnknownVariant (one line) lists the known names
    given = dict(knobs)
    check_knobs(cls, given, name)
    hint = f"register_as({_alias_for(name, given)!r}, {name!r}, ...) or implementation_for(name, knobs)"
    if _registered_as(alias, name, given, hint):
        return implementation(alias)  # the same instance, the same functions
    if not cls.has_params:
        _SHARED[alias] = build(name, **given)
    return _install(alias)


def register_layers(
    alias: str, sliding: str | tuple[str, dict[str, Any]], full: str | tuple[str, dict[str, Any]]
) -> str:
    """Register ``attnbench_<alias>``: variant ``sliding`` on a model's sliding-window layers (as the
    model calls them: Gemma2/3, Qwen2, Mistral; else those whose mask is a window) and ``full`` on
    every other layer, each a name
    or ``(name, knobs)``; stateless variants only. Gemma's local/global mix with any pair, e.g.
    ``register_layers("mix", ("local_window", {"window": 4096}), "sdpa")``. Fixed once registered,
    as in :func:`register`. Returns the implementation name."""
    roles = (("sliding", sliding), ("full", full))
    parts = {role: _stateless_part(spec, "register_layers") for role, spec in roles}
    if _registered_as(alias, "layers", parts, "another alias"):
        return implementation(alias)
    _LAYERS[alias] = {role: build(n, **k) for role, (n, k) in parts.items()}
    return _install(alias)


def register_by_layer(alias: str, layers: Sequence[str | tuple[str, dict[str, Any]]]) -> str:
    """Register ``attnbench_<alias>``: the attention layer with index ``i`` (its module's
    ``layer_idx``, which transformers' decoders and BERT-style encoders set) runs ``layers[i]``, a name
    or ``(name, knobs)``; stateless variants only. A local/global mix on a model that has no sliding
    layers of its own, e.g. ``register_by_layer("ends", ["sdpa", *["local_window"] * 4, "sdpa"])``
    for a 6-layer encoder. A layer without an index, or with one past the list, is refused in one line
    when it runs. Fixed once registered, as in :func:`register`. Returns the implementation name."""
    parts = [_stateless_part(spec, "register_by_layer") for spec in layers]
    if not parts:
        raise ValueError("register_by_layer: give one variant per layer (an empty list was given)")
    if _registered_as(alias, "by_layer", {"layers": parts}, "another alias"):
        return implementation(alias)
    instances: dict[tuple[str, str], AttentionVariant] = {}  # layers with the same setting share one
    for n, k in parts:
        instances.setdefault((n, repr(sorted(k.items()))), build(n, **k))
    _BY_INDEX[alias] = [instances[(n, repr(sorted(k.items())))] for n, k in parts]
    return _install(alias)


def implementation_for_roles(
    sliding: str | tuple[str, dict[str, Any]], full: str | tuple[str, dict[str, Any]]
) -> str:
    """The ``attn_implementation`` that runs ``sliding`` on a model's sliding-window layers and
    ``full`` on the others (:func:`register_layers`), registered if need be under a name spelled from
    the settings (``sliding:<name>[@k=v,...]+full:<name>[@...]``)."""
    parts = [_stateless_part(spec, "implementation_for_roles") for spec in (sliding, full)]
    (s, sk), (f, fk) = parts
    alias = f"sliding:{_alias_for(s, sk) if sk else s}+full:{_alias_for(f, fk) if fk else f}"
    return register_layers(alias, (s, sk), (f, fk))


def implementation_for_layers(layers: Sequence[str | tuple[str, dict[str, Any]]]) -> str:
    """The ``attn_implementation`` that runs ``layers[i]`` on layer ``i`` (:func:`register_by_layer`),
    registered if need be under a name spelled from the settings (``layers:`` and ``<name>[@k=v,...]``
    per layer, joined by ``+``), so that no two layer lists share a name."""
    parts = [_stateless_part(spec, "implementation_for_layers") for spec in layers]
    alias = "layers:" + "+".join(_alias_for(n, k) if k else n for n, k in parts)
    return register_by_layer(alias, parts)


def _stateless_part(spec: str | tuple[str, dict[str, Any]], who: str) -> tuple[str, dict[str, Any]]:
    """``(name, knobs)`` of a layer map's entry (a name or ``(name, knobs)``), its knobs checked; a
    one-line ``ValueError`` for a learned variant (one set of parameters per layer: ``attach``)."""
    name, knobs = (spec, {}) if isinstance(spec, str) else spec
    cls = get(name)  # UnknownVariant (one line) lists the known names
    check_knobs(cls, dict(knobs), name)
    if cls.has_params:
        raise ValueError(f"{who}: {name} has learned parameters (one set per layer): use attach()")
    return name, dict(knobs)


def layer_roles(name: str) -> dict[str, AttentionVariant]:
    """The instances a :func:`register_layers` name calls: ``{"sliding": ..., "full": ...}``, for
    records (``describe()``) and what each kind of layer reads. ``name`` is the registered name or its
    implementation string; one-line ``ValueError`` for any other name."""
    name = name_of(name) if name.startswith(PREFIX) else name
    if name not in _LAYERS:
        raise ValueError(f"{implementation(name)} is not a register_layers name (sliding and full layers)")
    return dict(_LAYERS[name])


def layer_list(name: str) -> list[AttentionVariant]:
    """The instances a :func:`register_by_layer` name calls, by layer index (layers with the same
    setting share one), for each layer's ``pattern()`` and ``describe()``. ``name`` is the registered
    name or its implementation string; one-line ``ValueError`` for any other name."""
    name = name_of(name) if name.startswith(PREFIX) else name
    if name not in _BY_INDEX:
        raise ValueError(f"{implementation(name)} is not a register_by_layer name (one variant per layer)")
    return list(_BY_INDEX[name])


def _layer_role(module: nn.Module, kwargs: dict[str, Any]) -> str | None:
    """``"sliding"`` or ``"full"`` as the model itself calls the layer: its ``sliding_window`` keyword
    (Gemma2/3, Mistral, Qwen2, Ministral pass it, None on full layers), else its config's
    ``layer_types`` at its ``layer_idx``; None when the model says neither (then the mask decides).
    Not the mask alone: a full layer's mask over fewer keys than the window equals the band (a
    bidirectional Gemma3 of 5 tokens sent its full layers to the sliding variant)."""
    if "sliding_window" in kwargs:
        return "sliding" if kwargs["sliding_window"] else "full"
    types = getattr(getattr(module, "config", None), "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if isinstance(types, (list, tuple)) and isinstance(idx, int) and 0 <= idx < len(types):
        kind = str(types[idx])
        if kind in ("sliding_attention", "full_attention"):
            return "sliding" if kind == "sliding_attention" else "full"
    return None


def _by_index(name: str, module: nn.Module) -> AttentionVariant:
    """The variant a :func:`register_by_layer` name runs on ``module`` (by its ``layer_idx``)."""
    layers = _BY_INDEX[name]
    idx = getattr(module, "layer_idx", None)
    if not isinstance(idx, int) or not 0 <= idx < len(layers):
        raise Unsupported(
            f"{_where(name, module)} maps {len(layers)} layers by index; this layer's layer_idx is {idx!r}"
        )
    return layers[idx]


def _registered_as(alias: str, variant: str, knobs: dict[str, Any], hint: str) -> bool:
    """Claim ``alias`` for ``variant`` with ``knobs``: True if it already holds exactly them, else
    record them and return False; one-line ``ValueError`` if it holds others (models built on it
    would change: ``hint`` says what to do instead) or another name spells the same implementation."""
    if alias in _VARIANT and (_VARIANT[alias], _KNOBS[alias]) == (variant, knobs):
        return True
    clash = next((a for a in _VARIANT if a != alias and implementation(a) == implementation(alias)), None)
    if clash is not None:
        raise ValueError(
            f"{alias!r} and the registered {clash!r} both spell {implementation(alias)}: pick another name"
        )
    if alias in _VARIANT:
        raise ValueError(
            f"{implementation(alias)} is registered as {_spelled(_VARIANT[alias], _KNOBS[alias])}: "
            f"registering it as {_spelled(variant, knobs)} would change every model already built on it; "
            f"give these knobs a name of their own: {hint}"
        )
    _VARIANT[alias], _KNOBS[alias] = variant, knobs
    return False


def _install(alias: str) -> str:
    """Register ``attnbench_<alias>``'s attention and mask functions with transformers."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(implementation(alias), _make_attention(alias))
    AttentionMaskInterface.register(implementation(alias), mask_function)
    return implementation(alias)


def implementation_for(name: str, knobs: dict[str, Any] | None = None) -> str:
    """The ``attn_implementation`` that runs variant ``name`` with ``knobs``, registered if need be:
    ``attnbench_<name>@<k=v,...>``, or ``attnbench_<name>`` without knobs while that name is free or
    has none (for harness code that builds models of one variant with different knobs in one
    process: no two knob sets share a name)."""
    given = dict(knobs or {})
    if not given and (name not in _VARIANT or (_VARIANT[name], _KNOBS[name]) == (name, given)):
        return register_as(name, name)
    return register_as(_alias_for(name, given), name, **given)


def _alias_for(name: str, knobs: dict[str, Any]) -> str:
    """``<name>@k=v,...``: a registered name for these knobs (``<name>@default`` for none)."""
    return name + "@" + (",".join(f"{k}={v}" for k, v in sorted(knobs.items())) or "default")


def _spelled(name: str, knobs: dict[str, Any]) -> str:
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in sorted(knobs.items()))})"


def shared(name: str) -> AttentionVariant:
    """The instance every layer of an ``attnbench_<name>`` model calls (stateless variants, built by
    :func:`register` with its knobs): for its ``pattern()`` and ``describe()`` after a run. ``name``
    is a registered name or its implementation string."""
    name = name_of(name) if name.startswith(PREFIX) else name
    if name not in _SHARED:
        raise ValueError(
            f"{implementation(name)} has no shared instance: register() it (learned variants: attach())"
        )
    return _SHARED[name]


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every attention layer: a module whose class name ends in
    ``Attention`` with an integer ``head_dim`` (Llama, Mistral, Qwen, GPT-2, ... in transformers 5),
    not an attached variant itself."""
    return [
        (qn, m)
        for qn, m in model.named_modules()
        if type(m).__name__.endswith("Attention")
        and isinstance(getattr(m, "head_dim", None), int)
        and not isinstance(m, AttentionVariant)
    ]


def attach(model: nn.Module, name: str, **knobs: Any) -> list[str]:
    """Give every attention layer of ``model`` its own instance of variant ``name`` and switch the
    model to ``attnbench_<name>``.

    Each instance is built with ``heads`` and ``head_dim`` of its layer and the knobs (``knobs`` over
    those given to :func:`register`), placed on the layer's device and dtype, and added as the
    submodule ``<layer>.attnbench_attention``: learned parameters are per layer and appear in
    ``model.state_dict()``. Registers ``name`` if it is not yet, without these knobs: they are this
    model's, and a later attach to another model does not inherit them. Returns the layers'
    qualified names.
    """
    cls = get(name)
    check_knobs(cls, knobs, name)
    if not _registered(implementation(name)):
        register([name])
    layers = _attention_modules(model)
    if not layers:
        raise ValueError(
            f"attach: no attention layer found in {type(model).__name__} (looked for modules named "
            "*Attention with an integer head_dim)"
        )
    for _, module in layers:
        heads = getattr(module, "num_heads", None) or module.config.num_attention_heads
        inst = build(name, **{**_KNOBS.get(name, {}), **knobs, "heads": heads, "head_dim": module.head_dim})
        ref = next(module.parameters(), None)
        if ref is not None:
            inst = inst.to(device=ref.device, dtype=ref.dtype)
        module.add_module(ATTACHED, inst)
    model.set_attn_implementation(implementation(name))
    if model.config._attn_implementation != implementation(name):  # transformers only warns
        raise ValueError(
            f"attach: {type(model).__name__} kept attn_implementation="
            f"{model.config._attn_implementation!r}: it cannot switch to {implementation(name)!r}"
        )
    return [qn for qn, _ in layers]


def _registered(impl: str) -> bool:
    """Whether ``impl`` has both an attention function and a mask function in transformers."""
    from transformers import AttentionInterface, AttentionMaskInterface

    return impl in AttentionInterface() and impl in AttentionMaskInterface()


def layer_variants(model: nn.Module) -> dict[str, AttentionVariant]:
    """The variant instance each attention layer of ``model`` calls, by qualified module name, for
    the model's current ``attnbench_<name>`` implementation (for records: ``describe()``)."""
    impl = getattr(model.config, "_attn_implementation", None) or ""
    if not impl.startswith(PREFIX):
        raise ValueError(f"model uses attn_implementation={impl!r}, not an attnbench one")
    name = name_of(impl)
    if name in _LAYERS:
        raise ValueError(
            f"{impl} picks its variant per call (sliding or full layer): see register_layers, layer_roles"
        )
    if name in _BY_INDEX:
        return {qn: _by_index(name, m) for qn, m in _attention_modules(model)}
    return {qn: _variant_for(m, name) for qn, m in _attention_modules(model)}
