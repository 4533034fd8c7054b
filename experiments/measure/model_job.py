"""A model job: the variant as the attention of a random-weight Llama-style transformers model, timed
end to end (prefill, time per decoded token, peak memory) through :func:`llama_e2e.measure_llama`.

Chosen by ``model=<name>`` (``conf/model/``); the variant comes from ``variant=`` as for kernel jobs.
The record's figures: ``prefill_ms``, ``decode_ms_per_token``, ``tokens_generated``, peak memory
(CUDA: the allocator's peak; CPU: the process high-water mark during the run, which includes the
weights, the cache and the C allocator's retained memory, so read it as an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from .common import check_device, job_threads, registered_variant
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


MODEL_FIELDS = tuple(f.name for f in fields(ModelSettings))


def measure_model(spec: JobSpec, result: dict[str, Any]) -> None:
    """Fill ``result`` (status, variant, figures) for a model job; raises like a kernel job does."""
    from .llama_e2e import measure_llama

    device = spec.device.value
    check_device(device)
    torch.set_num_threads(job_threads(spec))
    torch._dynamo.reset()  # as in kernel jobs: earlier shapes must not count against the recompile limit
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
            "decode_ms_per_token": out["decode_ms_per_token"],
            "decode_ms_steps": out["decode_ms_steps"],
            "tokens_generated": out["tokens_generated"],
            "kv_length_final": out["kv_length_final"],
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
    return (
        f"prefill {figures['prefill_ms']:.4g} ms, {figures['decode_ms_per_token']:.3g} ms per decoded token "
        f"({figures['tokens_generated']} tokens), peak {peak}"
    )
