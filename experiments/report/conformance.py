"""The conformance matrix: for every registered variant and every feature a caller may ask of it,
whether the variant honours it, shown by running it, or refuses it with its reason.

A cell is ``yes`` only when the call with the feature gives the variant's float64 oracle (relative
error at most 1e-4 in fp32) and the feature did what it must: changed the output where it should
(causal, key padding, scale, bias, soft-capping, sinks, a sliding window, packed documents) or
left it as a plainer call gives it where it should (grouped K/V heads = repeated heads; the last
queries of a sequence = those rows of the whole call; a cross-attention query = the same query
alone). ``no`` is a refusal (``Unsupported``/``Unavailable``) and its reason. A feature that ran
and changed nothing it should have changed, or disagreed with the oracle (NaN or Inf in its output
included), is ``IGNORED`` or ``WRONG``; one that raised anything else is ``ERROR`` (the exception's
type and first line): ``tests/test_conformance.py`` fails on each. Tiny CPU inputs (B=2, H=4, N=24,
D=8, fp32): a few seconds for the registry.

    python -m experiments.report.conformance --builtin --out docs/conformance.md
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

import variants
from variants import AttentionVariant, Unavailable, Unsupported, oracle
from variants.base import repeat_kv

from ..measure.inputs import document_ids

B, H, HKV, N, D = 2, 4, 2, 24, 8
TOL = 1e-4  # fp32 against the float64 oracle
CHANGED = 1e-3  # a feature that changes the output moves it by more than this (relative)


@dataclass(frozen=True)
class Cell:
    """One variant x feature: ``yes``, ``no`` (refused), ``IGNORED``, ``WRONG`` or ``ERROR`` (it raised),
    and why."""

    status: str
    detail: str = ""


def _inputs(nq: int = N, nk: int = N, hkv: int = H, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, nq, D, generator=g)
    k = torch.randn(B, hkv, nk, D, generator=g)
    v = torch.randn(B, hkv, nk, D, generator=g)
    return q, k, v


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max ``|a - b|`` over ``b``'s scale (its max ``|b|``); ``inf`` when either holds NaN or Inf, which
    would otherwise make the error NaN, and NaN passes every ``err > TOL`` test."""
    a, b = a.detach().double(), b.detach().double()
    if not (a.isfinite().all() and b.isfinite().all()):
        return math.inf
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _build(name: str, **knobs: object) -> AttentionVariant:
    torch.manual_seed(1)  # learned variants: the same parameters in every cell
    example = dict(variants.get(name).example_knobs[0])
    return variants.build(name, heads=H, head_dim=D, **{**example, **knobs})


def _base(attn: AttentionVariant) -> dict[str, object]:
    """The plainest call the variant takes: causal for a causal-only one."""
    return {"causal": True} if not attn.supports_noncausal else {}


def _checked(
    attn: AttentionVariant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict[str, object]
) -> tuple[torch.Tensor, Cell | None]:
    """The output, and a ``WRONG`` cell when it is not the oracle's (or not finite)."""
    with torch.no_grad():
        out = attn(q, k, v, **kw)
        if not out.isfinite().all():
            return out, Cell("WRONG", "the output has NaN or Inf")
        err = _rel(out, oracle(attn, q.double(), k.double(), v.double(), **_as64(kw)))
    return out, (Cell("WRONG", f"relative error {err:.2g} against the float64 oracle") if err > TOL else None)


def _as64(kw: dict[str, object]) -> dict[str, object]:
    return {
        key: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        for key, x in kw.items()
    }


def _changes(
    extra: Callable[[AttentionVariant], dict[str, object]], causal: bool = False
) -> Callable[[str], Cell]:
    """A feature that must change the output: ``extra`` gives its keywords for a built variant
    (``causal``: checked in a causal call, else in the plainest call the variant takes)."""

    def cell(name: str) -> Cell:
        attn = _build(name)
        q, k, v = _inputs()
        base = {"causal": True} if causal else _base(attn)
        out, wrong = _checked(attn, q, k, v, {**base, **extra(attn)})
        if wrong:
            return wrong
        with torch.no_grad():
            plain = attn(q, k, v, **base)
        if _rel(out, plain) <= CHANGED:
            return Cell("IGNORED", "the output did not change")
        return Cell("yes")

    return cell


def _causal(name: str) -> Cell:
    attn = _build(name)
    q, k, v = _inputs()
    out, wrong = _checked(attn, q, k, v, {"causal": True})
    if wrong:
        return wrong
    if not attn.supports_noncausal:
        return Cell("yes", "causal only: it has no other form")
    with torch.no_grad():
        if _rel(out, attn(q, k, v)) <= CHANGED:
            return Cell("IGNORED", "the output did not change")
    return Cell("yes")


def _padding(attn: AttentionVariant) -> dict[str, object]:
    kpm = torch.ones(B, N, dtype=torch.bool)
    kpm[1, N - 6 :] = False  # the second sequence has 6 padded keys
    kpm[0, 3] = False  # and the first one a hole, which causal attention alone cannot hide
    return {"key_padding_mask": kpm}


def _gqa(name: str) -> Cell:
    attn = _build(name)
    q, k, v = _inputs(hkv=HKV)
    base = _base(attn)
    out, wrong = _checked(attn, q, k, v, base)
    if wrong:
        return wrong
    with torch.no_grad():
        same = attn(q, repeat_kv(k, H), repeat_kv(v, H), **base)  # (B, H, N, D): heads repeated
    if _rel(out, same) > TOL:
        return Cell("WRONG", "2 K/V heads for 4 query heads did not give the repeated heads' output")
    return Cell("yes")


def _decode(name: str) -> Cell:
    attn = _build(name)
    q, k, v = _inputs()
    out, wrong = _checked(attn, q[:, :, -8:], k, v, {"causal": True})
    if wrong:
        return wrong
    with torch.no_grad():
        whole = attn(q, k, v, causal=True)[:, :, -8:]
    if _rel(out, whole) > TOL:
        return Cell("WRONG", "the last 8 queries alone did not give those rows of the whole call")
    return Cell("yes")


def _cross(name: str) -> Cell:
    attn = _build(name)
    q, k, v = _inputs(nq=16, nk=N)
    out, wrong = _checked(attn, q, k, v, {"cross": True})
    if wrong:
        return wrong
    with torch.no_grad():
        alone = attn(q[:, :, :5], k, v, cross=True)
    if _rel(alone, out[:, :, :5]) > TOL:
        return Cell("WRONG", "a query's output depended on the other queries of the call")
    return Cell("yes")


def _document_ids() -> torch.Tensor:
    """``(B, N)`` ids: three packed documents per sequence, cut differently in each row."""
    lengths = ((7, 10, 7), (12, 3, 9))
    return document_ids([list(row) for row in lengths])


def _bias(name: str) -> Cell:
    """A bias per head ``(H, Nq, Nk)``, and the batched ones models hand too: per batch row ``(B, 1, Nq,
    Nk)`` (transformers' 4-D additive masks) and per key of each row ``(B, 1, 1, Nk)``. A variant that
    read only the first row of a batched bias passed every per-head check."""
    g = torch.Generator().manual_seed(5)
    for shape in ((H, N, N), (B, 1, N, N), (B, 1, 1, N)):
        bias = 2 * torch.randn(shape, generator=g)
        got = _changes(lambda attn, bias=bias: {"bias": bias})(name)
        if got.status != "yes":
            return Cell(got.status, f"bias {shape}: {got.detail}")
    return Cell("yes")


def _dropout(name: str) -> Cell:
    return Cell("no", "the interface has no attention dropout (the transformers backend refuses dropout > 0)")


def _documents(name: str) -> Cell:
    """Packed documents, as :func:`_changes` checks them; a variant that takes them only in a causal
    call (its recurrence restarts at each document: linear, performer) is ``causal only``, its
    non-causal refusal the detail: a plain ``no`` hid that a causal model can pack its documents."""
    try:
        return _changes(lambda attn: {"documents": _document_ids()})(name)
    except Unsupported as exc:
        if _base(_build(name)).get("causal"):  # a causal-only variant was refused in its causal call
            raise
        got = _changes(lambda attn: {"documents": _document_ids()}, causal=True)(name)
        return Cell(CAUSAL_ONLY, f"refused without causal: {exc}") if got.status == "yes" else got


#: a feature a variant takes in a causal call only (the table's third answer besides yes and no)
CAUSAL_ONLY = "causal only"

#: the columns, in order: what a model asks of its attention
FEATURES: dict[str, Callable[[str], Cell]] = {
    "causal": _causal,
    "key padding": _changes(_padding),
    "GQA": _gqa,
    "Nq < Nk": _decode,
    "cross-attention": _cross,
    "scale": _changes(lambda attn: {"scale": 0.3}),
    "bias": _bias,
    "softcap": _changes(lambda attn: {"softcap": 0.8}),
    "sinks": _changes(
        lambda attn: {"sinks": 1.5 * torch.randn(H, generator=torch.Generator().manual_seed(6))}
    ),
    "window": _changes(lambda attn: {"window": 2}),  # narrower than local_window's example (3)
    "packed documents": _documents,
    "dropout": _dropout,
}


#: ``{a, b, c}`` in a message: a Python set (or dict) printed by ``str``, no brackets nested in it
_BRACES = re.compile(r"\{([^{}()\[\]]*)\}")


def stable_text(text: str) -> str:
    """``text`` with the items inside each ``{...}`` sorted. A library's message that prints a Python
    set (xFormers': ``supported: {torch.bfloat16, torch.float16}``) lists its items in an order that
    changes between processes (hashes of dtypes and strings are not stable), so the page quoting it
    changed on every regeneration; sorted, the same refusal reads the same in every run."""
    return _BRACES.sub(lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", text)


def cell(name: str, feature: str) -> Cell:
    """One cell: the feature's check, the refusal it met, or ``ERROR`` with what else it raised (a
    plugin's bug deep in torch is that plugin's cell, not the end of the whole matrix); its detail
    made run-independent by :func:`stable_text`."""
    try:
        got = FEATURES[feature](name)
    except (Unsupported, Unavailable) as exc:
        got = Cell("no", str(exc))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        got = Cell("ERROR", f"{type(exc).__name__}: {first}" if first else type(exc).__name__)
    return Cell(got.status, stable_text(got.detail))


def matrix(names: list[str] | None = None) -> dict[str, dict[str, Cell]]:
    """Each of ``names`` (default: every registered variant, entry points included) x every feature."""
    return {name: {f: cell(name, f) for f in FEATURES} for name in names or variants.available()}


def grid(cells: dict[str, dict[str, Cell]]) -> list[str]:
    """The table's lines: a row per variant, ``yes`` or ``no`` (or a failure) per feature."""
    lines = ["| variant | " + " | ".join(FEATURES) + " |", "|---|" + "---|" * len(FEATURES)]
    for name, row in cells.items():
        lines.append(f"| `{name}` | " + " | ".join(row[f].status for f in FEATURES) + " |")
    return lines


def markdown(cells: dict[str, dict[str, Cell]]) -> str:
    """The page: the table, then each refusal's reason (and each failure's finding)."""
    lines = [
        "# Conformance: what each variant honours",
        "",
        "Generated by `python -m experiments.report.conformance --builtin --out docs/conformance.md`",
        f"(CPU, fp32, B={B}, H={H}, N={N}, D={D}; each variant this repository ships, with its first example",
        "knobs; without `--builtin`, variants installed by entry point too). `yes`: the call with the",
        "feature gave the variant's float64 oracle and the feature took effect (it changed the output, or",
        "for grouped heads, the last queries of a sequence and cross-attention, gave what the plainer",
        "call gives); `no`: refused in one line, the reason below; `causal only`: `yes` in a causal call,",
        "refused without it. `tests/test_conformance.py` fails when a",
        "claimed feature leaves the output unchanged or wrong (NaN included) or raises (any installed",
        "variant), and when this table is out of date.",
        "",
        *grid(cells),
        "",
        "## Reasons",
        "",
    ]
    for name, row in cells.items():
        if text := reasons(row):
            lines.append(f"- `{name}`: {text}")
    return "\n".join(lines) + "\n"


def reasons(row: dict[str, Cell]) -> str:
    """A row's reasons (and findings), feature by feature; a row that refuses every feature, most of
    them for one reason (xformers on a CPU: 11 features, one 400-character reason), says that reason
    once: ``every feature (no): <reason>``, or ``every feature but **dropout** (no): <reason>``
    followed by the features refused for another reason."""
    notes = [f"**{f}** ({c.status}): {c.detail}" for f, c in row.items() if c.detail]
    if row and all(c.status == "no" for c in row.values()):
        details = [c.detail for c in row.values()]
        common = max(details, key=details.count)
        if common and details.count(common) > len(row) / 2:
            others = {f: c for f, c in row.items() if c.detail != common and c.detail}
            but = " but " + ", ".join(f"**{f}**" for f in others) if others else ""
            notes = [f"every feature{but} (no): {common}"]
            notes += [f"**{f}** ({c.status}): {c.detail}" for f, c in others.items()]
    return "; ".join(notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the Markdown page here (default: print it)")
    ap.add_argument(
        "--builtin",
        action="store_true",
        help="only the variants this repository ships, not those of entry points (docs/conformance.md)",
    )
    args = ap.parse_args()
    text = markdown(matrix(variants.builtin() if args.builtin else None))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
