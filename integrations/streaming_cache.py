"""StreamingLLM's rolling K/V cache for transformers: a cache layer that keeps only the keys a
bounded-reach variant reads (``local_window``: the first ``sink_tokens`` and the last ``window``).

transformers' ``DynamicCache`` keeps every key of a full-attention layer (and the last ``W - 1`` of a
sliding one), whatever the attention reads; a ``local_window`` layer decoding against it reads
``sink_tokens + window`` keys but the cache still grows by one key per token and is copied whole at
every step (``torch.cat`` in ``DynamicLayer.update``). :class:`SinkWindowLayer` keeps the first
``sink_tokens`` keys and the last ``window`` ones and drops the rest (Xiao et al., 2023, "Efficient
Streaming Language Models with Attention Sinks"), so memory and per-step copies stop growing.

Why the output does not change: keys are cached after the rotary embedding, so each keeps its own
position; the layer hands the attention the kept keys followed by the new ones, and reports to the
mask function a cache of ``kept`` keys starting at position ``seen - kept`` (``get_mask_sizes``),
so the queries are still the last positions. ``local_window`` renumbers the keys it is given (its
docstring: a cache of the sinks and the last ``window`` keys gives the same output as the whole one),
so every query sees the same sinks and the same band as with the whole cache.
``tests/test_model_mix.py`` checks greedy decoding on it against a no-cache forward of the same tokens.

Only for a layer whose attention is ``local_window`` with that ``window`` and ``sink_tokens`` (a wider
reach would read keys this cache has dropped: the caller checks). Imports transformers at import time:
import this module only where transformers is installed (extra ``attnbench[hf]``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# the key tensors a SinkWindowLayer handed to its layer's attention, by id: a weak reference (the
# entry goes with the tensor) and the number of sinks at their front. transformers' mask function
# reports only where a layer's cache starts (``kv_offset``), not whether the sequence's first keys
# survived in it, so the attention asks here.
_HANDED: dict[int, tuple[weakref.ref, int]] = {}


def _hand(keys: torch.Tensor, sinks: int) -> None:
    """Remember that ``keys`` holds the sequence's first ``sinks`` keys at its front."""
    i = id(keys)

    def forget(ref: weakref.ref, i: int = i) -> None:
        if _HANDED.get(i, (None, 0))[0] is ref:
            del _HANDED[i]

    _HANDED[i] = (weakref.ref(keys, forget), sinks)


def sinks_kept(keys: torch.Tensor) -> int:
    """How many of the sequence's first keys stand at the front of ``keys`` because a
    :class:`SinkWindowLayer` kept them: its ``sink_tokens`` if ``keys`` is the tensor it returned from
    :meth:`SinkWindowLayer.update`, else 0. ``O(1)``."""
    ref, sinks = _HANDED.get(id(keys), (None, 0))
    return sinks if ref is not None and ref() is keys else 0


class SinkWindowLayer(DynamicLayer):
    """One layer's rolling cache: the first ``sink_tokens`` keys and values of the sequence and the last
    ``window`` ones, ``(B, Hkv, <= sink_tokens + window, D)``. ``sliding``: whether it stands for a
    sliding-window layer (transformers builds the sliding layers' mask from the first cache layer that
    says so, the full layers' from the first that does not)."""

    is_croppable = False  # dropped keys cannot be restored: no assisted decoding that crops the cache

    def __init__(self, sink_tokens: int, window: int, sliding: bool = False) -> None:
        super().__init__()
        if sink_tokens < 0 or window < 1:
            raise ValueError(
                f"a rolling cache needs sink_tokens >= 0 and window >= 1; got {sink_tokens}, {window}"
            )
        self.sink_tokens = sink_tokens
        self.window = window
        self.is_sliding = sliding
        self.cumulative_length = 0  # tokens seen, kept or not: the position of the next one

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states (B, Hkv, n, D)``; return the kept keys and values followed
        by the new ones (what this call attends over), then keep only the sinks and the last ``window``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)  # (B, Hkv, kept + n, D)
        values = torch.cat([self.values, value_states], dim=-2)
        s, w = self.sink_tokens, self.window
        if keys.shape[-2] > s + w:
            # a fresh tensor (not a view): the dropped keys' memory is freed, not kept by a slice
            self.keys = torch.cat([keys[..., :s, :], keys[..., -w:, :]], dim=-2)  # (B, Hkv, s + w, D)
            self.values = torch.cat([values[..., :s, :], values[..., -w:, :]], dim=-2)
        else:
            self.keys, self.values = keys, values
        _hand(keys, s)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)``: the kept keys and the new ones, the first at position ``seen -
        kept`` (so that the queries are the last positions of the keys the layer is handed)."""
        kept = self.keys.shape[-2] if self.is_initialized else 0
        return kept + query_length, self.cumulative_length - kept

    def get_seq_length(self) -> int:
        """Tokens seen (the next position), not tokens kept."""
        return self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a rolling sink/window cache has dropped keys: it cannot be cropped")

    def __repr__(self) -> str:
        kept = f"sink_tokens={self.sink_tokens}, window={self.window}, sliding={self.is_sliding}"
        return f"SinkWindowLayer({kept})"


def streaming_cache(config: Any, layers: Sequence[tuple[int, int] | None]) -> DynamicCache:
    """``DynamicCache(config=config)`` with layer ``i`` replaced by a :class:`SinkWindowLayer` of
    ``(sink_tokens, window) = layers[i]`` where that is not None (kept the same kind, sliding or full,
    as the layer it replaces). One-line ``ValueError`` when ``layers`` has another length than the
    model's layers."""
    cache = DynamicCache(config=config)
    if len(layers) != len(cache.layers):
        raise ValueError(
            f"streaming_cache: {len(layers)} layer settings for a model of {len(cache.layers)} layers"
        )
    for i, keep in enumerate(layers):
        if keep is not None:
            sliding = bool(getattr(cache.layers[i], "is_sliding", False))
            cache.layers[i] = SinkWindowLayer(*keep, sliding=sliding)
    return cache
