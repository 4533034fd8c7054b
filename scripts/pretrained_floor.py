"""The floor under experiment=pretrained's figures: the cosine to the unmodified model, the top-1/top-5
neighbour agreement and the retrieval top-1 that attention functions keeping nothing of the model's
attention scores get (attention removed, uniform weights, only the first key, each token only itself),
on the encoder, lengths and texts of a committed store's records, with the job's own functions.

A variant's figure means something only above these: a function that never looks at q.k already
scores there. Writes ``floor.json`` and ``floor.md`` into ``--out``; the report's pretrained section
shows the JSON's rows beside the records when it lies next to their folder (``<store>/floor.json``).

    python scripts/pretrained_floor.py [--records results/cpu/pretrained/records] [--lengths 128 512]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from arg_types import output_dir, positive_int, threads

from experiments.measure.inputs import DTYPES
from experiments.measure.pretrained import corpus
from experiments.measure.pretrained.encoder import Encoder, encode, load_encoder
from experiments.measure.pretrained.fidelity import cosine_stats, retrieval_agreement
from experiments.measure.pretrained.job import TOP_K

# ------------------------------------------------------------------------ the score-free attentions
# Each takes value (B, H, Nk, D) and the keys each query may see, allowed (B or 1, 1 or H, Nq, Nk)
# bool, and returns (B, H, Nq, D). None of them reads the query or the key: the model's scores.


def _zeros(value: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Attention removed: every layer's attention output is 0 (the output projection's bias, the
    residual and the layer norm still run)."""
    return value.new_zeros(value.shape[0], value.shape[1], allowed.shape[-2], value.shape[-1])


def _uniform(value: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Every allowed key the same weight: the mean of v over the keys each query may see."""
    w = allowed.to(value.dtype)  # (B, 1, Nq, Nk)
    return (w @ value) / w.sum(-1, keepdim=True).clamp_min(1.0)


def _first_key(value: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Every query takes key 0's value ([CLS]: the key this model sends 30-41% of its mass to)."""
    return value[:, :, :1].expand(-1, -1, allowed.shape[-2], -1)


def _itself(value: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Each token attends only to itself: its own value (self-attention, queries = keys)."""
    return value


#: name -> (function, what the tables call it)
FLOORS: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str]] = {
    "zeros": (_zeros, "attention removed (output 0)"),
    "uniform": (_uniform, "uniform weights (mean of v)"),
    "first_key": (_first_key, "only key 0 ([CLS])"),
    "itself": (_itself, "each token only itself"),
}
#: the two a variant's figures are read against (docs, report): removing attention and flattening it
MAIN = ("zeros", "uniform")


def allowed_keys(mask: torch.Tensor | None, batch: int, nq: int, nk: int) -> torch.Tensor:
    """The keys each query may see, ``(B or 1, 1 or H, Nq, Nk)`` bool, from the mask transformers hands
    an attention function: None (every key), bool (True = may attend) or additive float (0 = may
    attend, a large negative = not). Anything else is refused: a floor over the wrong keys would be
    silently wrong."""
    if mask is None:
        return torch.ones(1, 1, nq, nk, dtype=torch.bool)
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask > torch.finfo(mask.dtype).min / 2
    else:
        raise TypeError(f"attention mask of dtype {mask.dtype}: expected None, bool or an additive float")
    if allowed.dim() != 4 or allowed.shape[-2:] != (nq, nk) or allowed.shape[0] not in (1, batch):
        raise ValueError(f"attention mask of shape {tuple(allowed.shape)} for B={batch}, Nq={nq}, Nk={nk}")
    return allowed


def _as_attention(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., tuple]:
    """``fn`` as a transformers attention function: ``(module, q, k, v, mask, ...)`` with q, k, v
    ``(B, H, N, D)`` -> ``(out (B, Nq, H, D), None)``."""

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        allowed = allowed_keys(attention_mask, query.shape[0], query.shape[-2], key.shape[-2])
        return fn(value, allowed.to(value.device)).transpose(1, 2).contiguous(), None

    return attention


def implementation(name: str) -> str:
    """Register floor ``name`` (:data:`FLOORS`) with transformers, its mask built as sdpa's (boolean,
    True = may attend); returns the ``attn_implementation`` to set."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    impl = f"floor_{name}"
    AttentionInterface.register(impl, _as_attention(FLOORS[name][0]))
    AttentionMaskInterface.register(impl, sdpa_mask)
    return impl


# ------------------------------------------------------------------------ the store's settings
@dataclass(frozen=True)
class StoreSettings:
    """What the committed records were measured with: one encoder, dtype and text count for all, and
    per length the hashes of the corpus and of the texts the jobs fed the model."""

    package: str
    trained_len: int | None
    dtype: str
    texts: int
    batch: int
    texts_sha256: dict[int, str]
    corpus_sha256: str


def store_settings(records: Path) -> StoreSettings:
    """The settings of the ok pretrained records (no ``full_layers`` mix) in ``records``; a one-line
    ``ValueError`` when there are none or they differ in encoder, dtype, texts or corpus."""
    found = []
    for path in sorted(records.glob("*.json")):
        r = json.loads(path.read_text())
        cfg = r.get("config") or {}
        enc = cfg.get("pretrained") or {}
        if r.get("kind") == "pretrained" and r.get("status") == "ok" and not enc.get("full_layers"):
            found.append((cfg, enc, r["figures"]))
    if not found:
        raise ValueError(f"{records}: no ok pretrained records (without full_layers) to take settings from")
    one = {
        "package": {e["package"] for _, e, _ in found},
        "trained_len": {e.get("trained_len") for _, e, _ in found},
        "dtype": {c["dtype"] for c, _, _ in found},
        "texts": {e["texts"] for _, e, _ in found},
        "batch": {e["batch"] for _, e, _ in found},
        "corpus_sha256": {f["corpus_sha256"] for _, _, f in found},
    }
    several = [f"{k} ({', '.join(map(str, sorted(v, key=str)))})" for k, v in one.items() if len(v) > 1]
    if several:
        raise ValueError(
            f"{records}: the records differ in {'; '.join(several)}: run on one setting's folder"
        )
    per_n: dict[int, set[str]] = {}
    for c, _, f in found:
        per_n.setdefault(int(c["seq_len"]), set()).add(f["texts_sha256"])
    if bad := [n for n, h in per_n.items() if len(h) > 1]:
        raise ValueError(f"{records}: records at N={bad} were fed different texts")
    hashes = {n: next(iter(h)) for n, h in per_n.items()}
    return StoreSettings(**{k: next(iter(v)) for k, v in one.items()}, texts_sha256=hashes)


# ------------------------------------------------------------------------ the figures
def _bag_retrieval(queries: Sequence[Sequence[int]], texts: Sequence[Sequence[int]]) -> float:
    """Retrieval top-1 with no model: a query's nearest text by the cosine of word-piece counts
    ([CLS] and [SEP], the first and last ids, left out). Ties go to the lower index, as in the job."""
    vocab = {t: i for i, t in enumerate(sorted({t for s in [*queries, *texts] for t in s[1:-1]}))}

    def counts(seqs: Sequence[Sequence[int]]) -> torch.Tensor:
        out = torch.zeros(len(seqs), len(vocab), dtype=torch.float64)
        for row, s in enumerate(seqs):
            for t, c in Counter(s[1:-1]).items():
                out[row, vocab[t]] = c
        return torch.nn.functional.normalize(out, dim=-1)

    order = torch.argsort(-(counts(queries) @ counts(texts).T), dim=1, stable=True)
    return float((order[:, 0] == torch.arange(len(queries))).double().mean())


def floor_figures(
    enc: Encoder, texts: corpus.Texts, batch: int, names: Sequence[str] = tuple(FLOORS)
) -> dict[str, Any]:
    """The job's figures (``cosine_stats``, ``retrieval_agreement`` with ``k = TOP_K``) for each floor
    ``names`` against the unmodified model (eager), on ``texts`` encoded as the job does (batches of
    ``batch``, queries padded to one width, a multiple of 8); and two references: the mean cosine
    between two different texts under the unmodified model, and retrieval top-1 by word-piece counts
    alone. ``O((1 + len(names)) * forward of every text and query)``."""
    q_width = -(-max(len(q) for q in texts.queries) // 8) * 8  # as the job pads them
    enc.model.set_attn_implementation("eager")
    ref_t, _ = encode(enc, texts.texts, batch)
    ref_q, _ = encode(enc, texts.queries, batch, width=q_width)
    other = ~torch.eye(len(ref_t), dtype=torch.bool)
    rows: dict[str, dict[str, float]] = {}
    for name in names:
        enc.model.set_attn_implementation(implementation(name))
        got_t, _ = encode(enc, texts.texts, batch)
        got_q, _ = encode(enc, texts.queries, batch, width=q_width)
        rows[name] = {
            **cosine_stats(ref_t, got_t),
            **retrieval_agreement(ref_q, ref_t, got_q, got_t, k=TOP_K),
        }
    enc.model.set_attn_implementation("eager")
    return {
        "floors": rows,
        "retrieval_top1_ref": retrieval_agreement(ref_q, ref_t, ref_q, ref_t, k=TOP_K)["retrieval_top1"],
        "cosine_between_texts": float((ref_t.double() @ ref_t.double().T)[other].mean()),
        "retrieval_top1_word_pieces": _bag_retrieval(texts.queries, texts.texts),
        "texts": len(texts.texts),
        "texts_sha256": texts.digest(),
    }


def measure(settings: StoreSettings, lengths: Sequence[int], names: Sequence[str]) -> dict[str, Any]:
    """:func:`floor_figures` per length on the store's encoder and texts; a one-line ``ValueError``
    when a length has no records or the texts rebuilt here are not the ones its records saw."""
    if missing := [n for n in lengths if n not in settings.texts_sha256]:  # before the model loads
        raise ValueError(f"N={missing}: the records have no such length ({sorted(settings.texts_sha256)})")
    enc = load_encoder(settings.package, dtype=DTYPES[settings.dtype], trained_len=settings.trained_len)
    tok = enc.tokenizer
    pieces = corpus.tokenized_sentences(lambda s: tok(s, add_special_tokens=False)["input_ids"])
    if corpus.corpus_hash() != settings.corpus_sha256:
        raise ValueError(
            f"this Python ({platform.python_version()}) builds corpus {corpus.corpus_hash()[:12]}, the "
            f"records saw {settings.corpus_sha256[:12]}: run with the Python they were taken with"
        )
    per_n = {}
    for n in lengths:
        texts = corpus.pack_texts(pieces, n, tok.cls_token_id, tok.sep_token_id, count=settings.texts)
        if texts.digest() != settings.texts_sha256[n]:
            raise ValueError(f"N={n}: the texts rebuilt here are not the ones the records saw")
        per_n[n] = floor_figures(enc, texts, settings.batch, names)
        print(_lines(n, per_n[n]), flush=True)
    return {
        "what": "experiment=pretrained's figures for attention functions that never read q or k",
        "settings": asdict(settings),
        "encoder": enc.describe(),
        "names": {k: FLOORS[k][1] for k in names},
        "main": [k for k in MAIN if k in names],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "lengths": {str(n): v for n, v in per_n.items()},
    }


# ------------------------------------------------------------------------ output
def _pct(x: float) -> str:
    return f"{100 * x:.0f}"


def _lines(n: int, f: dict[str, Any]) -> str:
    """One length's floors as terminal lines."""
    out = [
        f"N={n}: unmodified model retrieval top-1 {_pct(f['retrieval_top1_ref'])}%, word-piece counts alone "
        f"{_pct(f['retrieval_top1_word_pieces'])}%, cosine between two different texts "
        f"{f['cosine_between_texts']:.3f}"
    ]
    for name, r in f["floors"].items():
        out.append(
            f"  {FLOORS[name][1]:30s} cosine {r['cosine_mean']:.3f} (p5 {r['cosine_p5']:.3f}), top-1 agree "
            f"{_pct(r['top1_agreement'])}%, top-{TOP_K} {_pct(r[f'top{TOP_K}_agreement'])}%, retrieval "
            f"top-1 {_pct(r['retrieval_top1'])}%"
        )
    return "\n".join(out)


def markdown(result: dict[str, Any]) -> str:
    """``floor.md``: one row per floor and length, then the references."""
    lengths = result["lengths"]
    head = (
        f"| attention | N | cosine mean | cosine p5 | top-1 agree % | top-{TOP_K} agree % "
        "| retrieval top-1 % |"
    )
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for name, label in result["names"].items():
        for n, f in lengths.items():
            r = f["floors"][name]
            rows.append(
                f"| {label} | {n} | {r['cosine_mean']:.3f} | {r['cosine_p5']:.3f} "
                f"| {_pct(r['top1_agreement'])} | {_pct(r[f'top{TOP_K}_agreement'])} "
                f"| {_pct(r['retrieval_top1'])} |"
            )
    refs = ["| reference | " + " | ".join(f"N={n}" for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    refs.append(
        "| unmodified model: retrieval top-1 % | "
        + " | ".join(_pct(f["retrieval_top1_ref"]) for f in lengths.values())
        + " |"
    )
    refs.append(
        "| word-piece counts, no model: retrieval top-1 % | "
        + " | ".join(_pct(f["retrieval_top1_word_pieces"]) for f in lengths.values())
        + " |"
    )
    refs.append(
        "| unmodified model: cosine between two different texts | "
        + " | ".join(f"{f['cosine_between_texts']:.3f}" for f in lengths.values())
        + " |"
    )
    s = result["settings"]
    return "\n".join(
        [
            "# The floor under the pretrained-fidelity figures",
            "",
            f"`python scripts/pretrained_floor.py` (Python {result['python']}, torch {result['torch']}, "
            f"{result['threads']} thread(s)): {s['package']}, {s['dtype']}, {s['texts']} texts per length "
            "(the committed records' texts: their SHA-256 checked), batches of "
            f"{s['batch']}, the job's own `encode`, `cosine_stats` and `retrieval_agreement`. Each row "
            "replaces every layer's attention with a function that never reads q or k.",
            "",
            *rows,
            "",
            *refs,
            "",
        ]
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--records",
        type=Path,
        default=Path("results/cpu/pretrained/records"),
        help="the pretrained records whose encoder, texts and lengths to use",
    )
    ap.add_argument(
        "--lengths", type=positive_int, nargs="+", default=None, help="text lengths N (default: the records')"
    )
    ap.add_argument("--floors", choices=list(FLOORS), nargs="+", default=list(FLOORS), help="which floors")
    ap.add_argument("--threads", type=threads, default=1, help="torch threads")
    ap.add_argument(
        "--out", type=output_dir, default=None, help="write floor.json and floor.md here (default: none)"
    )
    return ap


def main() -> None:
    args = parser().parse_args()
    torch.set_num_threads(args.threads)
    try:
        settings = store_settings(args.records)
        lengths = args.lengths or sorted(settings.texts_sha256)
        result = measure(settings, lengths, args.floors)
    except (ValueError, ImportError, OSError) as exc:
        sys.exit(f"pretrained_floor.py: {exc}")
    if args.out is not None:
        (args.out / "floor.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "floor.md").write_text(markdown(result))
        print(f"wrote {args.out / 'floor.json'} and {args.out / 'floor.md'}")


if __name__ == "__main__":
    main()
