"""End to end through a real client: a random-weight Llama-style model (transformers) whose attention
is one attnbench variant, or a local/global mix of two, timed on prefill and greedy decoding with a
K/V cache (issues 16 and 33).

The model is ``LlamaForCausalLM`` built offline from a config (random weights, no download):
``layers`` decoder layers of width ``hidden``, ``heads`` query heads and ``kv_heads`` key/value heads
(grouped-query attention, ``head_dim = hidden / heads``), MLP width ``4 * hidden``, vocabulary
``vocab``. Its attention runs through ``attn_implementation="attnbench_<variant>"``
(:mod:`integrations.transformers_backend`); a learned variant (``has_params``) gets one instance per layer
(``attach``). Inputs are ``input_ids (batch, prefill_len)``, random, no padding.

A local/global layer mix (``sliding_window`` W): the model is ``MinistralForCausalLM``, which is the
same Llama architecture (the same weights from the same seed) with a ``layer_types`` list: layer ``i``
(from 0) is full attention when ``full_every`` divides ``i + 1`` (Gemma 2: every 2nd, Gemma 3: every
6th; None: no full layer) and a sliding-window layer of W keys (itself and the W - 1 before it,
local_window's radius W - 1) otherwise. The variant sees the sliding layers' band as ``window=``;
with ``full_variant`` the variant runs only on the sliding layers and ``full_variant`` (its default
knobs) on the full ones (``register_layers``); without, the variant runs on every layer.

The K/V cache is transformers' ``DynamicCache`` built from the config: a full layer keeps every key,
a sliding layer its last W - 1 (``DynamicSlidingWindowLayer``). ``rolling_cache``: every layer whose
variant is ``local_window`` keeps only what it reads, the first ``sink_tokens`` and the last ``window``
keys (StreamingLLM's rolling cache, :mod:`integrations.streaming_cache`); the others keep
transformers' layer.

What is timed (``time.perf_counter``, with ``torch.cuda.synchronize()`` before each clock read on
CUDA), all under ``torch.no_grad`` as ``generate`` runs (not ``inference_mode``: under it sdpa's
kernel spy sees no fused kernel and reports ``math``, and flex cannot cache block masks):

- **prefill**: one forward of the whole prompt into an empty ``DynamicCache`` (embedding, every layer,
  cache writes, the LM head over all ``prefill_len`` positions): one untimed warm-up, then
  ``prefill_runs`` timed runs, each into a fresh cache; the figure is their median.
- **decode**: after the last timed prefill, greedy decoding as ``generate(max_new_tokens=new_tokens,
  do_sample=False)`` does it: the prefill's last logits give the first new token, then each of the
  ``new_tokens - 1`` decode steps is one forward of the last token ``(batch, 1)`` against the cache
  (``Nk`` grows from ``prefill_len + 1`` to ``prefill_len + new_tokens - 1``) and an argmax. Each step
  is timed on its own (forward and argmax); the figure is the median step. No logits processors or
  stopping criteria run (``generate``'s own overhead is left out).
- **peak memory** (CUDA): ``torch.cuda.max_memory_allocated`` over the last timed prefill and the
  decoding, after ``reset_peak_memory_stats`` (weights and cache included). On the CPU the figure is
  None: torch has no CPU allocator statistics, and ``tracemalloc`` / ``ru_maxrss`` miss tensors or
  whole-process noise (DESIGN.md); the caller wires the suite's CPU peak tracker around this call.

- **K/V bytes per sequence**, after the last step, per layer and summed: ``kv_bytes_kept``, the bytes
  the cache's tensors hold (their storage: a slice that keeps a larger tensor alive counts whole), and
  ``kv_bytes_read_per_step``, the bytes the layer's variant reads of them in the next step
  (the K/V bytes of a one-query workload against the keys the layer holds: all of them for exact
  attention and for a fixed-state variant, which transformers hands the cache, not a state;
  ``sink_tokens + window`` for local_window); ``kv_bytes_full``, what a cache of every
  key would hold, for scale. Kept and read differ where the cache keeps keys the variant never
  reads (local_window on a growing ``DynamicCache``).

A variant that cannot run the model's shapes raises :class:`variants.Unsupported` with a one-line
reason (for the caller's record), as does a setting that cannot be run as asked (a rolling cache
with no local_window layer, sinks on sliding layers whose cache drops them). Imports only torch,
transformers (lazily), variants, the integrations and the standard library.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

import variants
from integrations import transformers_backend as hf
from variants.base import AttentionVariant, Unsupported, Workload
from variants.registry import knob_defaults, knob_label

CPU_PEAK_NOTE = (
    "None on the CPU: torch keeps no CPU allocator statistics (tracemalloc and ru_maxrss miss tensors); "
    "wrap the call in the suite's CPU peak tracker"
)
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types entries


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_types(layers: int, full_every: int | None) -> list[str]:
    """transformers' ``layer_types`` of a local/global mix: layer ``i`` (from 0) is full attention when
    ``full_every`` divides ``i + 1`` (Gemma 2: 2, Gemma 3: 6), a sliding-window layer otherwise; every
    layer sliding when ``full_every`` is None (Mistral)."""
    return [FULL if full_every and (i + 1) % full_every == 0 else SLIDING for i in range(layers)]


def check_mix(
    layers: int, sliding_window: int | None, full_every: int | None, full_variant: str | None
) -> None:
    """One-line ``ValueError`` for a layer mix that cannot run as asked, before any work: full layers
    or their variant without a window; a window under 2 keys (transformers' sliding cache keeps every
    key for a window of 1: ``keys[-0:]``, so its masks and cache disagree at the first decode); a
    ``full_variant`` on a model with no sliding layer (``full_every=1``: the job's own variant would
    run nowhere, and the job failed after the whole run). A model with fewer layers than
    ``full_every`` has no full layer: allowed, its record's ``layer_variants`` says so."""
    if sliding_window is None and (full_every is not None or full_variant is not None):
        raise ValueError(
            "model.full_every and model.full_variant need model.sliding_window (without it every layer "
            "is full)"
        )
    if sliding_window is not None and sliding_window < 2:
        raise ValueError(
            f"model.sliding_window must be at least 2 keys per query, got {sliding_window} (transformers' "
            "sliding-window cache keeps every key for a window of 1)"
        )
    if full_variant is not None:
        if SLIDING not in layer_types(layers, full_every):
            raise ValueError(
                f"every layer is full with model.full_every={full_every}: the job's variant would run on no "
                "layer, only model.full_variant; drop model.full_variant, or set model.full_every above 1"
            )


def model_config(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    sliding_window: int | None,
    full_every: int | None,
) -> Any:
    """The transformers config: ``LlamaConfig`` without a sliding window, else ``MinistralConfig`` (the
    Llama architecture with a ``layer_types`` list, :func:`layer_types`) with ``sliding_window`` keys
    per sliding layer. Positions up to 2**20 (no length limit here)."""
    from transformers import LlamaConfig, MinistralConfig

    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"need hidden % heads == 0 and heads % kv_heads == 0; got {hidden}, {heads}, {kv_heads}"
        )
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=1 << 20,
    )
    if sliding_window is None:
        return LlamaConfig(**common)
    return MinistralConfig(
        **common, sliding_window=sliding_window, layer_types=layer_types(layers, full_every)
    )


def _implementation(variant: str, knobs: dict[str, Any], full_variant: str | None) -> str:
    """The ``attn_implementation`` that runs ``variant`` with ``knobs`` (on the sliding layers only when
    ``full_variant`` names the full layers' variant), registered under a name of its own."""
    if full_variant is None:
        return hf.implementation_for(variant, dict(knobs))
    return hf.implementation_for_roles((variant, dict(knobs)), full_variant)


def _build_model(
    variant: str,
    knobs: dict[str, Any],
    cfg: Any,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    full_variant: str | None = None,
) -> torch.nn.Module:
    """The causal LM of config ``cfg`` (random weights from ``seed``) on ``device``/``dtype`` in eval
    mode, attending through ``variant`` with ``knobs`` (and ``full_variant`` on the full layers of a
    mix)."""
    from transformers import AutoModelForCausalLM

    learned = variants.get(variant).has_params
    if learned and full_variant is not None:
        raise Unsupported(
            f"{variant} has learned parameters (one set per layer): a local/global mix takes stateless "
            "variants only"
        )
    # stateless: one shared instance with these knobs, under its own name if another job in this
    # process registered other knobs
    impl = "eager" if learned else _implementation(variant, knobs, full_variant)
    torch.manual_seed(seed)
    # from_config writes attn_implementation into the config it is given: copy it
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
    model = model.to(device=device, dtype=dtype).eval()
    if learned:  # one instance per layer, built on the layer's device and dtype
        hf.attach(model, variant, **knobs)
    return model


def layer_variants(model: torch.nn.Module, full_variant: str | None) -> list[AttentionVariant]:
    """The variant instance each decoder layer runs, in layer order: the one variant everywhere, or
    for a mix the sliding one on ``sliding_attention`` layers and the full one on the others (a
    sliding layer's mask is always a window, which is how the backend picks)."""
    if full_variant is None:
        return list(hf.layer_variants(model).values())
    roles = hf.layer_roles(model.config._attn_implementation)
    return [roles["sliding" if t == SLIDING else "full"] for t in model.config.layer_types]


def _label(v: AttentionVariant) -> str:
    """``name(k=v, ...)`` with the knobs that differ from the constructor's defaults."""
    defaults = knob_defaults(type(v))
    return knob_label(v.name, {k: x for k, x in v.knobs().items() if defaults.get(k) != x})


def _rolling_layers(cfg: Any, per_layer: list[AttentionVariant]) -> list[tuple[int, int] | None]:
    """``(sink_tokens, window)`` each layer's rolling cache keeps (None: transformers' layer): the
    local_window layers keep their sinks and window, narrowed to ``W - 1`` on a sliding layer of W
    keys (the band the layer runs). One-line :class:`Unsupported` when no layer runs local_window."""
    types = getattr(cfg, "layer_types", None) or [FULL] * len(per_layer)
    out: list[tuple[int, int] | None] = []
    for v, t in zip(per_layer, types, strict=True):
        if v.name != "local_window":
            out.append(None)
            continue
        window = v.window if t == FULL else min(v.window, cfg.sliding_window - 1)
        out.append((v.sink_tokens, max(window, 1)))
    if all(x is None for x in out):
        raise Unsupported(
            "rolling_cache keeps what a local_window layer reads; no layer of this model runs local_window "
            f"({', '.join(sorted({v.name for v in per_layer}))} read every cached key)"
        )
    return out


def _check_sinks_survive(cfg: Any, per_layer: list[AttentionVariant], rolling: bool) -> None:
    """One-line :class:`Unsupported` for sink tokens on a sliding layer whose cache drops them:
    transformers' sliding cache keeps the last W - 1 keys, so decoding would lose the sinks that the
    prefill saw (a rolling cache keeps them)."""
    types = getattr(cfg, "layer_types", None) or [FULL] * len(per_layer)
    sunk = [
        i for i, (v, t) in enumerate(zip(per_layer, types, strict=True)) if t == SLIDING and v.sink_keys()
    ]
    if sunk and not rolling:
        raise Unsupported(
            f"sink tokens on sliding layers {sunk}: transformers' sliding-window cache keeps only the last "
            f"{cfg.sliding_window - 1} keys, so decoding would drop the sinks the prefill attended to "
            "(model.rolling_cache=true keeps them)"
        )


def kv_figures(
    cache: Any, per_layer: list[AttentionVariant], cfg: Any, batch: int, dtype: torch.dtype
) -> dict[str, Any]:
    """K/V bytes per sequence of ``cache`` as it stands (see the module docstring): ``kv_bytes_kept``
    (storage the cache's tensors hold), ``kv_bytes_read_per_step`` (what each layer's variant reads of
    the keys its layer holds: the K/V of its ``cache_len``, a fixed-state variant's included, whose forward
    through transformers reads the cache), ``kv_bytes_full`` (a cache of every key seen), each
    summed and per layer (``*_layers``), and ``kv_cached_keys_layers`` and ``cache_layers`` (the class
    of each layer's cache)."""
    d = cfg.head_dim
    hkv = cfg.num_key_value_heads
    seen = cache.get_seq_length()
    elem = torch.empty((), dtype=dtype).element_size()
    kept, read, keys = [], [], []
    for layer, v in zip(cache.layers, per_layer, strict=True):
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (layer.keys, layer.values)
        }
        kept.append(sum(storages.values()) // batch)
        n = int(layer.keys.shape[-2])
        keys.append(n)
        w = Workload(batch=1, heads=cfg.num_attention_heads, nq=1, nk=max(n, 1), head_dim=d, v_head_dim=d,
                     dtype=dtype, kv_heads=hkv, causal=True)  # fmt: skip
        # the keys it is handed: through transformers a layer hands its variant the cache, never a
        # state, so a fixed-state variant (linear, the recurrences) reads every cached key, not its
        # state's size; the K/V formula counts a bounded reach (local_window's cache_len) all the same
        read.append(AttentionVariant.state_bytes(v, w) if n else 0)
    full = len(per_layer) * hkv * seen * 2 * d * elem
    return {
        "kv_bytes_kept": sum(kept),
        "kv_bytes_kept_layers": kept,
        "kv_bytes_read_per_step": sum(read),
        "kv_bytes_read_layers": read,
        "kv_bytes_full": full,
        "kv_cached_keys_layers": keys,
        "cache_layers": [type(layer).__name__ for layer in cache.layers],
    }


def measure_llama(
    variant: str,
    knobs: dict[str, Any],
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    prefill_len: int,
    new_tokens: int,
    batch: int,
    device: str | torch.device,
    dtype: torch.dtype | str,
    seed: int,
    vocab: int = 1024,
    prefill_runs: int = 3,
    sliding_window: int | None = None,
    full_every: int | None = None,
    full_variant: str | None = None,
    rolling_cache: bool = False,
) -> dict[str, Any]:
    """Prefill time, time per decoded token, peak memory and K/V bytes of a Llama-style model on
    ``variant`` (a local/global mix with ``sliding_window``, ``full_every``, ``full_variant``; a
    rolling cache with ``rolling_cache``: the module docstring).

    Returns a dict of plain values: the configuration, ``prefill_ms`` (median of ``prefill_runs``),
    ``prefill_ms_runs`` and ``prefill_ms_per_token`` (the median over ``prefill_len``),
    ``decode_ms_per_token`` (median step) and ``decode_ms_steps``, ``tokens_generated`` (``new_tokens``
    per sequence) and ``generated_ids`` (``batch`` lists), ``kv_length_final`` (tokens seen), the K/V
    figures of :func:`kv_figures`, ``layer_types`` and ``layer_variants`` (what each layer ran),
    ``peak_memory_bytes`` (None on the CPU, see ``peak_memory_note``), and ``variant_describe`` (the
    instance ``variant`` ran as, on its first layer, after the run).
    """
    from transformers import DynamicCache
    from transformers import __version__ as transformers_version

    if new_tokens < 1 or prefill_len < 1 or prefill_runs < 1:
        raise ValueError(
            "need new_tokens, prefill_len and prefill_runs >= 1; got "
            f"{new_tokens}, {prefill_len}, {prefill_runs}"
        )
    check_mix(layers, sliding_window, full_every, full_variant)
    cfg = model_config(
        layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
        sliding_window=sliding_window, full_every=full_every,
    )  # fmt: skip
    dev = torch.device(device)
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = _build_model(variant, knobs, cfg, dev, dt, seed, full_variant)
    per_layer = layer_variants(model, full_variant)
    _check_sinks_survive(cfg, per_layer, rolling_cache)
    rolling = _rolling_layers(cfg, per_layer) if rolling_cache else None
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prefill_len), generator=gen).to(dev)  # (B, prefill_len)

    def new_cache() -> DynamicCache:
        if rolling is None:
            return DynamicCache(config=model.config)
        from integrations.streaming_cache import streaming_cache

        return streaming_cache(model.config, rolling)

    def prefill() -> tuple[torch.Tensor, DynamicCache]:
        cache = new_cache()
        logits = model(
            input_ids=ids, **{hf.cache_keyword(model): cache}, use_cache=True
        ).logits  # (B, N, vocab)
        return logits[:, -1], cache  # (B, vocab)

    prefill_ms: list[float] = []
    decode_ms: list[float] = []
    peak = None
    with torch.no_grad():
        prefill()  # warm-up: first-call costs (allocations, sdpa's kernel check) stay out of the figures
        for run in range(prefill_runs):
            last = cache = None  # the previous run's cache is freed before the next is built
            if run == prefill_runs - 1 and dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            _sync(dev)
            t0 = time.perf_counter()
            last, cache = prefill()
            _sync(dev)
            prefill_ms.append((time.perf_counter() - t0) * 1e3)
        token = last.argmax(-1, keepdim=True)  # (B, 1): the first new token
        out = [token]
        for _ in range(new_tokens - 1):
            _sync(dev)
            t0 = time.perf_counter()
            logits = model(
                input_ids=token, **{hf.cache_keyword(model): cache}, use_cache=True
            ).logits  # (B, 1, vocab)
            token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            _sync(dev)
            decode_ms.append((time.perf_counter() - t0) * 1e3)
            out.append(token)
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev)
    generated = torch.cat(out, dim=1)  # (B, new_tokens)
    types = list(getattr(cfg, "layer_types", None) or [FULL] * layers)
    first = per_layer[types.index(SLIDING)] if full_variant is not None else per_layer[0]
    return {
        "variant": variant,
        "knobs": dict(knobs),
        "layers": layers,
        "hidden": hidden,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": hidden // heads,
        "vocab": vocab,
        "prefill_len": prefill_len,
        "new_tokens": new_tokens,
        "batch": batch,
        "device": dev.type,
        "dtype": str(dt).replace("torch.", ""),
        "seed": seed,
        "transformers": transformers_version,
        "architecture": type(model).__name__,
        "sliding_window": sliding_window,
        "layer_types": types,
        "layer_variants": [_label(v) for v in per_layer],
        "rolling_cache": rolling_cache,
        "prefill_ms": statistics.median(prefill_ms),
        "prefill_ms_runs": prefill_ms,
        "prefill_ms_per_token": statistics.median(prefill_ms) / prefill_len,
        "decode_ms_per_token": statistics.median(decode_ms) if decode_ms else None,
        "decode_ms_steps": decode_ms,
        "tokens_generated": int(generated.shape[1]),
        "generated_ids": generated.tolist(),
        "kv_length_final": cache.get_seq_length(),
        **kv_figures(cache, per_layer, cfg, batch, dt),
        "peak_memory_bytes": peak,
        "peak_memory_note": None if dev.type == "cuda" else CPU_PEAK_NOTE,
        "variant_describe": first.describe(),
    }
