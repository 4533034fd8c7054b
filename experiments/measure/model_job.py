"""A model job: the variant as the attention of a random-weight Llama-style transformers model, timed
end to end (prefill, time per decoded token, peak memory, K/V bytes) through
:func:`llama_e2e.measure_llama`.

Chosen by ``model=<name>`` (``conf/model/``); the variant comes from ``variant=`` as for kernel jobs.
A model with ``sliding_window`` is a local/global layer mix (``full_every``, ``full_variant``);
``rolling_cache`` keeps only what local_window layers read (StreamingLLM). The record's figures:
``prefill_ms`` and ``prefill_ms_per_token``, ``decode_ms_per_token``, ``tokens_generated``, peak
memory (CUDA: the allocator's peak; CPU: the process high-water mark during the run, which includes
the weights, the cache and the C allocator's retained memory, so read it as an upper bound), and the
K/V cache per sequence after decoding: ``kv_bytes_kept`` (what the cache holds), ``kv_bytes_read_per_step``
(what the layers' variants read of it in a step), ``kv_bytes_full`` (every key), each per layer too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from .common import check_device, forget_compiled_code, job_threads, registered_variant
from .memory import hwm_peak_bytes
from .spec import JobSpec


@dataclass(frozen=True)
class ModelSettings:
    """A model job's transformers model (a Llama-style decoder, random weights, no download) and what it
    runs, with their defaults (``conf/model/<name>.yaml`` sets what differs)."""

    layers: int = 4  # decoder layers
    hidden: int = 512  # model width
    heads: int = 8  # query heads (head size = hidden / heads)
    kv_heads: int = 2  # key/value heads shared by the query heads (grouped-query attention)
    vocab: int = 1024  # vocabulary
    prefill_len: int = 1024  # prompt tokens, prefilled in one call
    new_tokens: int = 32  # tokens then decoded greedily with the K/V cache
    batch: int = 1  # prompts per call
    # a local/global layer mix: sliding-window layers of this many keys (each query sees itself and
    # the sliding_window - 1 before it; Ministral's layer_types); None: every layer full (a Llama)
    sliding_window: int | None = None
    full_every: int | None = None  # with sliding_window: layer i is full when full_every divides i + 1
    full_variant: str | None = None  # with sliding_window: this variant (default knobs) on the full layers
    rolling_cache: bool = False  # local_window layers keep only their sinks and window (StreamingLLM)


MODEL_FIELDS = tuple(f.name for f in fields(ModelSettings))
#: the K/V figures a model record copies from the measurement (llama_e2e.kv_figures)
KV_FIGURES = (
    "kv_bytes_kept",
    "kv_bytes_kept_layers",
    "kv_bytes_read_per_step",
    "kv_bytes_read_layers",
    "kv_bytes_full",
    "kv_cached_keys_layers",
    "cache_layers",
)


def measure_model(spec: JobSpec, result: dict[str, Any]) -> None:
    """Fill ``result`` (status, variant, figures) for a model job; raises like a kernel job does."""
    from .llama_e2e import measure_llama

    device = spec.device.value
    check_device(device)
    torch.set_num_threads(job_threads(spec))
    forget_compiled_code()  # as in kernel jobs
    _, name, knobs = registered_variant(spec, "model")
    model = {k: v for k, v in dict(spec.model).items() if k in MODEL_FIELDS}
    out: dict[str, Any] = {}

    def run() -> None:
        out.update(measure_llama(name, knobs, device=device, dtype=spec.dtype.value, seed=spec.seed, **model))

    hwm = hwm_peak_bytes(run) if device == "cpu" else (run() or None)
    peak = out["peak_memory_bytes"] if device == "cuda" else hwm
    result["variant"] = out["variant_describe"]
    result["figures"].update(
        {
            "prefill_ms": out["prefill_ms"],
            "prefill_ms_runs": out["prefill_ms_runs"],
            "prefill_ms_per_token": out["prefill_ms_per_token"],
            "decode_ms_per_token": out["decode_ms_per_token"],
            "decode_ms_steps": out["decode_ms_steps"],
            "tokens_generated": out["tokens_generated"],
            "kv_length_final": out["kv_length_final"],
            **{k: out[k] for k in KV_FIGURES},
            "architecture": out["architecture"],
            "layer_types": out["layer_types"],
            "layer_variants": out["layer_variants"],
            "peak_bytes": peak,
            "peak_mib": None if peak is None else peak / 2**20,
            "peak_kind": "cuda allocator" if device == "cuda" else "process high-water mark (VmHWM)",
            "threads": torch.get_num_threads(),
            "transformers": out["transformers"],
        }
    )


def model_summary(figures: dict[str, Any], config: dict[str, Any]) -> str:
    """A model job's terminal text: prefill time, time per decoded token, peak memory."""
    peak = "n/a" if figures.get("peak_mib") is None else f"{figures['peak_mib']:.4g} MiB"
    kv = ""
    if figures.get("kv_bytes_kept") is not None:  # records from before issue 33 have no K/V figures
        kept, read = figures["kv_bytes_kept"] / 2**20, figures["kv_bytes_read_per_step"] / 2**20
        kv = f", K/V {kept:.3g} MiB kept, {read:.3g} MiB read per step"
    return (
        f"prefill {figures['prefill_ms']:.4g} ms, {figures['decode_ms_per_token']:.3g} ms per decoded token "
        f"({figures['tokens_generated']} tokens), peak {peak}{kv}"
    )
