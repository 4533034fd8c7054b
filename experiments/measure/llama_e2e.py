"""End to end through a real client: a random-weight Llama-style model (transformers) whose attention
is one attnbench variant, timed on prefill and greedy decoding with a K/V cache (issue 16).

The model is ``LlamaForCausalLM`` built offline from a config (random weights, no download):
``layers`` decoder layers of width ``hidden``, ``heads`` query heads and ``kv_heads`` key/value heads
(grouped-query attention, ``head_dim = hidden / heads``), MLP width ``4 * hidden``, vocabulary
``vocab``. Its attention runs through ``attn_implementation="attnbench_<variant>"``
(:mod:`integrations.transformers_backend`); a learned variant (``has_params``) gets one instance per layer
(``attach``). Inputs are ``input_ids (batch, prefill_len)``, random, no padding.

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

A variant that cannot run the model's shapes raises :class:`variants.Unsupported` with a one-line
reason (for the caller's record). Imports only torch, transformers (lazily), variants and the
standard library.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

import variants
from integrations import transformers_backend as hf

CPU_PEAK_NOTE = (
    "None on the CPU: torch keeps no CPU allocator statistics (tracemalloc and ru_maxrss miss tensors); "
    "wrap the call in the suite's CPU peak tracker"
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build_model(
    variant: str, knobs: dict[str, Any], cfg: Any, device: torch.device, dtype: torch.dtype, seed: int
) -> torch.nn.Module:
    """``LlamaForCausalLM`` of config ``cfg`` (random weights from ``seed``) on ``device``/``dtype`` in
    eval mode, attending through ``attnbench_<variant>`` with ``knobs``."""
    from transformers import AutoModelForCausalLM

    learned = variants.get(variant).has_params
    # stateless: one shared instance with these knobs, under its own name if another job in this
    # process registered other knobs
    impl = "eager" if learned else hf.implementation_for(variant, dict(knobs))
    torch.manual_seed(seed)
    # from_config writes attn_implementation into the config it is given: copy it
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
    model = model.to(device=device, dtype=dtype).eval()
    if learned:  # one instance per layer, built on the layer's device and dtype
        hf.attach(model, variant, **knobs)
    return model


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
) -> dict[str, Any]:
    """Prefill time, time per decoded token and peak memory of a Llama-style model on ``variant``.

    Shapes and what is timed: see the module docstring. Returns a dict of plain values: the
    configuration, ``prefill_ms`` (median of ``prefill_runs``) and ``prefill_ms_runs``,
    ``decode_ms_per_token`` (median step) and ``decode_ms_steps``, ``tokens_generated``
    (``new_tokens`` per sequence) and ``generated_ids`` (``batch`` lists), ``kv_length_final``,
    ``peak_memory_bytes`` (None on the CPU, see ``peak_memory_note``), and ``variant_describe`` (the
    first layer's instance's ``describe()``, after the run).
    """
    from transformers import DynamicCache, LlamaConfig
    from transformers import __version__ as transformers_version

    if new_tokens < 1 or prefill_len < 1 or prefill_runs < 1:
        raise ValueError(
            "need new_tokens, prefill_len and prefill_runs >= 1; got "
            f"{new_tokens}, {prefill_len}, {prefill_runs}"
        )
    if hidden % heads or heads % kv_heads:
        raise ValueError(
            f"need hidden % heads == 0 and heads % kv_heads == 0; got {hidden}, {heads}, {kv_heads}"
        )
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=1 << 20,
    )
    dev = torch.device(device)
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = _build_model(variant, knobs, cfg, dev, dt, seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prefill_len), generator=gen).to(dev)  # (B, prefill_len)

    def prefill() -> tuple[torch.Tensor, DynamicCache]:
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits  # (B, N, vocab)
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
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits  # (B, 1, vocab)
            token = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            _sync(dev)
            decode_ms.append((time.perf_counter() - t0) * 1e3)
            out.append(token)
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev)
    generated = torch.cat(out, dim=1)  # (B, new_tokens)
    first = next(iter(hf.layer_variants(model).values()))
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
        "prefill_ms": statistics.median(prefill_ms),
        "prefill_ms_runs": prefill_ms,
        "decode_ms_per_token": statistics.median(decode_ms) if decode_ms else None,
        "decode_ms_steps": decode_ms,
        "tokens_generated": int(generated.shape[1]),
        "generated_ids": generated.tolist(),
        "kv_length_final": cache.get_seq_length(),
        "peak_memory_bytes": peak,
        "peak_memory_note": None if dev.type == "cuda" else CPU_PEAK_NOTE,
        "variant_describe": first.describe(),
    }
