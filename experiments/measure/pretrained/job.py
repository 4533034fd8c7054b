"""A pretrained job: variant ``variant`` as the attention of a pretrained encoder at text length
``seq_len``, against the unmodified model (``pretrained=<name>``, ``conf/pretrained/``).

Steps, each recorded:

1. The encoder is loaded offline from its package; the corpus (:mod:`.corpus`) is packed into texts
   of exactly ``N`` tokens, ``texts`` of them kept evenly over the corpus (subsampled: the record
   says how many there were), each with one of its sentences as a query.
2. The unmodified model (transformers' eager attention) encodes texts and queries, and its
   attention weights give, per layer, the mass on the first token ([CLS]), on the band
   ``|i - j| <= band`` and inside the variant's pattern (``variant.pattern(N, N)``).
3. The model with the variant (``attn_implementation='attnbench_<name>'``, see
   :mod:`integrations.transformers_backend`; with ``full_layers`` a local/global mix: those layers
   run sdpa, the others the variant, ``register_by_layer``, and the pattern of step 2 is each
   layer's own) encodes the same: one untimed warm-up batch (compilation
   included: ``first_call_s``), then every batch timed (``batch_ms_*``: whole-model forward of
   ``batch`` texts; queries are padded to a multiple of 8), then the peak memory of one batch (CPU:
   allocator events; CUDA: the allocator's peak), above the weights and inputs.
4. Figures: cosine of each text's embedding to the unmodified one (mean, 5th percentile, min), top-1
   and top-5 neighbour agreement of the retrieval task, the share of pairs the pattern keeps (mean
   over layers, and per layer).

Variants with learned parameters (additive) are ``unsupported``: the checkpoint has no weights for
them. ``N`` above the model's position embeddings is ``unsupported``; ``N`` above the length it was
fine-tuned on is measured and flagged (``beyond_trained``). Time ``O(texts * forward(N))``.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from variants import Unsupported

from ..common import check_device, forget_compiled_code, job_threads, registered_variant
from ..inputs import DTYPES
from ..memory import peak_bytes
from ..spec import JobSpec
from ..timing import summarize
from . import corpus
from .encoder import DEFAULT_PACKAGE, encode, load_encoder, padded
from .fidelity import MassTally, cosine_stats, kept_share, retrieval_agreement, reweights


#: what ``conf/pretrained/<name>.yaml`` holds, with the defaults a partial config gets
@dataclass(frozen=True)
class PretrainedSettings:
    """The pretrained job's settings, with their defaults (``conf/pretrained/<name>.yaml`` sets what
    differs)."""

    name: str = "minilm"
    package: str = DEFAULT_PACKAGE  # the Python package whose model/ folder holds the model
    trained_len: int | None = None  # longest text the model was trained on; longer ones are flagged.
    # None: the package's sentence_bert_config.json max_seq_length
    texts: int = 64  # texts per length, spread evenly over the corpus (fewer if it has fewer)
    batch: int = 8  # texts per forward pass; each pass is one timing sample
    band: int = 8  # radius of the diagonal band whose attention mass the report plots
    # layers (from 0) that keep full attention (sdpa, the model's own softmax) while the variant runs
    # on the others: a local/global layer mix; empty: the variant on every layer
    full_layers: tuple[int, ...] = ()


DEFAULTS: dict[str, Any] = asdict(PretrainedSettings())
TOP_K = 5  # neighbours compared in the retrieval task


def measure_pretrained(spec: JobSpec, result: dict[str, Any]) -> None:
    """Fill ``result`` (status, variant, figures) for a pretrained job; raises like a kernel job does
    (the caller turns exceptions into statuses)."""
    from integrations import transformers_backend as hf

    cfg = {**DEFAULTS, **dict(spec.pretrained)}
    device = spec.device.value
    check_device(device)
    torch.set_num_threads(job_threads(spec))
    forget_compiled_code()  # as in kernel jobs
    cls, name, knobs = registered_variant(spec, "pretrained")
    if cls.has_params:
        raise Unsupported(
            f"{name} has learned parameters that the pretrained checkpoint does not have: dropped in, it "
            "would attend with random weights"
        )
    n = spec.seq_len
    enc = load_encoder(cfg["package"], device, DTYPES[spec.dtype.value], trained_len=cfg["trained_len"])
    if n > enc.max_positions:
        raise Unsupported(f"N={n} is longer than the model's {enc.max_positions} learned positions")
    tok = enc.tokenizer
    pieces = corpus.tokenized_sentences(lambda s: tok(s, add_special_tokens=False)["input_ids"])
    available = len(corpus.pack_texts(pieces, n, tok.cls_token_id, tok.sep_token_id).texts)
    texts = corpus.pack_texts(pieces, n, tok.cls_token_id, tok.sep_token_id, count=cfg["texts"])
    batch = cfg["batch"]
    # every query batch has one width: the longest query rounded up to a multiple of 8, so a query's
    # embedding does not depend on which batch it falls in (axial's grid and sparse's random blocks
    # follow the padded length), and axial has a grid (a prime length has none)
    q_width = -(-max(len(q) for q in texts.queries) // 8) * 8

    full = sorted(set(cfg["full_layers"]))
    if any(i >= enc.layers for i in full):
        raise ValueError(f"pretrained.full_layers={full} names a layer past the encoder's {enc.layers}")
    if full:  # a local/global mix: sdpa on the full layers, the variant on the others
        impl = hf.implementation_for_layers(
            ["sdpa" if i in full else (name, knobs) for i in range(enc.layers)]
        )
        per_layer = hf.layer_list(impl)
        variant = next((v for i, v in enumerate(per_layer) if i not in full), per_layer[0])
    else:
        impl = hf.implementation_for(name, knobs)  # its own name if another job registered other knobs
        variant = hf.shared(impl)
        per_layer = [variant] * enc.layers
    keeps = [v.pattern(n, n).to(device) for v in per_layer]  # (N, N) per layer: the pairs it lets interact

    # the unmodified model: embeddings, and where its attention mass goes
    enc.model.set_attn_implementation("eager")
    tally = MassTally(enc.layers, keeps, cfg["band"])
    ref_t, _ = encode(enc, texts.texts, batch, attentions=tally.add)
    ref_q, _ = encode(enc, texts.queries, batch, width=q_width)

    # the same model with the variant as its attention
    enc.model.set_attn_implementation(impl)
    t0 = time.perf_counter()
    encode(enc, texts.texts[:batch], batch)  # warm-up: compilation, caches, first-touch pages
    first_call_s = time.perf_counter() - t0
    got_t, times = encode(enc, texts.texts, batch)
    got_q, _ = encode(enc, texts.queries, batch, width=q_width)
    ids, mask = padded(texts.texts[:batch], tok.pad_token_id, device)
    with torch.no_grad():
        peak = peak_bytes(lambda: enc.model(input_ids=ids, attention_mask=mask), device)

    timing = summarize(times)
    mass = tally.figures()
    result["variant"] = variant.describe()
    result["figures"].update(
        {
            **cosine_stats(ref_t, got_t),
            **retrieval_agreement(ref_q, ref_t, got_q, got_t, k=TOP_K),
            "kept_pairs": sum(kept_share(k) for k in keeps) / enc.layers,  # mean over layers
            "kept_pairs_layers": [kept_share(k) for k in keeps],
            "full_layers": full,
            **mass,
            "mass_inside_mean": float(sum(mass["mass_inside"]) / enc.layers),
            "reweights": reweights(cls),  # the mass inside its pattern does not apply
            "band": cfg["band"],
            "batch_ms_median": timing.median_s * 1e3,
            "batch_ms_iqr": timing.iqr_s * 1e3,
            "batch_ms_unstable": not timing.stable,
            "batch_ms_runs": [t * 1e3 for t in times],
            "batch_texts": batch,
            "tokens_per_s": len(texts.texts) * n / sum(times),
            "first_call_s": first_call_s,
            "peak_bytes": peak,
            "peak_mib": peak / 2**20,
            "texts": len(texts.texts),
            "texts_available": available,
            "subsampled": len(texts.texts) < available,
            "queries": len(texts.queries),
            "query_width": q_width,
            "corpus_sentences": len(corpus.sentences()),
            "corpus_sha256": corpus.corpus_hash(),
            "texts_sha256": texts.digest(),
            "corpus_recipe": corpus.RECIPE,
            "python": platform.python_version(),
            "beyond_trained": n > enc.trained_len,
            "trained_len": enc.trained_len,
            "encoder": enc.describe(),
            "threads": torch.get_num_threads(),
        }
    )


def pretrained_summary(figures: dict[str, Any], config: dict[str, Any]) -> str:
    """A pretrained job's terminal text: output cosine to the exact model, top-1 agreement, the share
    of pairs it keeps (and the layers left on full attention) and of attention mass (or that it weighs
    every pair its own way), time per batch, and whether N is beyond training."""
    f = figures
    flag = f" (beyond the {f['trained_len']} tokens it was trained on)" if f.get("beyond_trained") else ""
    mass = (
        "weighs them its own way"
        if f.get("reweights")
        else f"{100 * f['mass_inside_mean']:.0f}% of the attention mass"
    )
    full = f" (full attention on layers {f['full_layers']})" if f.get("full_layers") else ""
    return (
        f"cosine mean {f['cosine_mean']:.5f} (p5 {f['cosine_p5']:.4f}), top-1 agreement "
        f"{f['top1_agreement']:.2f}, keeps {100 * f['kept_pairs']:.0f}% of pairs{full} and {mass}, "
        f"{f['batch_ms_median']:.4g} ms per {f['batch_texts']} texts{flag}"
    )
