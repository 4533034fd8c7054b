"""The conformance matrix (experiments/report/conformance.py): every feature a variant claims takes
effect against the float64 oracle, and docs/conformance.md shows the matrix as the code has it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from experiments.report import conformance
from variants import Unsupported
from variants.registry import unregister

DOC = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"


@pytest.fixture(scope="module")
def cells():
    return conformance.matrix()


def test_no_claimed_feature_is_ignored_or_wrong(cells):
    bad = [
        f"{name} / {feature}: {c.status} ({c.detail})"
        for name, row in cells.items()
        for feature, c in row.items()
        if c.status not in ("yes", "no", conformance.CAUSAL_ONLY)
    ]
    assert not bad, "\n".join(bad)


def test_documents_a_variant_takes_only_causally_are_causal_only_not_no():
    """linear and performer restart their recurrence at each document in a causal call: the table
    said `no`, from their non-causal refusal alone."""
    for name in ("linear", "performer"):
        c = conformance.cell(name, "packed documents")
        assert c.status == conformance.CAUSAL_ONLY and "refused without causal" in c.detail, (name, c)
    assert conformance.cell("sdpa", "packed documents").status == "yes"
    assert conformance.cell("axial", "packed documents").status == "no"


def test_every_refusal_says_why(cells):
    silent = [
        f"{n} / {f}" for n, row in cells.items() for f, c in row.items() if c.status == "no" and not c.detail
    ]
    assert not silent, silent


def test_the_committed_table_is_the_code_s(cells):
    import variants

    committed = [line for line in DOC.read_text().splitlines() if line.startswith("|")]
    shipped = {name: row for name, row in cells.items() if name in variants.builtin()}
    assert committed == conformance.grid(shipped), (
        "docs/conformance.md is out of date: "
        "python -m experiments.report.conformance --builtin --out docs/conformance.md"
    )


def test_the_checks_can_fail(monkeypatch):
    """A variant that drops a keyword it claims to take shows as IGNORED, one that computes it wrong as
    WRONG: the matrix is not a copy of the capability facts."""
    import variants

    naive = variants.get("naive")
    real = naive._attend
    monkeypatch.setattr(naive, "_attend", lambda self, *a, softcap=None, **kw: real(self, *a, **kw))
    assert conformance.cell("naive", "softcap").status == "WRONG"  # the oracle caps, the variant did not
    monkeypatch.setattr(
        conformance, "oracle", lambda attn, q, k, v, **kw: attn(q.float(), k.float(), v.float(), **kw)
    )
    assert conformance.cell("naive", "softcap").status == "IGNORED"  # and against itself it changed nothing


@contextmanager
def _registered(name: str, cls: type) -> Iterator[None]:
    """``cls`` registered as ``name`` (as an entry point would) for the block, then gone again."""
    import variants

    variants.register(name)(cls)
    try:
        yield
    finally:
        unregister(name)


def _naive() -> type:
    import variants

    return variants.get("naive")


def test_non_finite_output_is_wrong_never_yes():
    """NaN in one output row: its relative error was NaN, and NaN > tolerance is False, so every
    column the variant ran said yes."""

    class NanRow(_naive()):
        def _attend(self, q, k, v, **kw):
            out = super()._attend(q, k, v, **kw).clone()
            out[-1, :, -1] = float("nan")  # the last query of the last sequence
            return out

    with _registered("test_nan_row", NanRow):
        row = {f: conformance.cell("test_nan_row", f) for f in conformance.FEATURES}
    assert not [f for f, c in row.items() if c.status == "yes"], row
    assert row["causal"] == conformance.Cell("WRONG", "the output has NaN or Inf")


def test_a_batched_bias_read_as_one_row_is_wrong():
    """A variant that applies the first batch row's bias to every row is right for a per-head (H, Nq,
    Nk) bias, the only shape the column passed: the (B, 1, Nq, Nk) one catches it."""

    class FirstRowBias(_naive()):
        def _attend(self, q, k, v, *, bias=None, **kw):
            if bias is not None and bias.dim() == 4:  # (B|1, H|1, Nq|1, Nk): the first row for all
                bias = bias[:1]
            return super()._attend(q, k, v, bias=bias, **kw)

    with _registered("test_first_row_bias", FirstRowBias):
        got = conformance.cell("test_first_row_bias", "bias")
    assert got.status == "WRONG" and got.detail.startswith("bias (2, 1, 24, 24): relative error"), got


def test_a_variant_that_raises_is_an_error_cell_not_the_end_of_the_matrix():
    """An ordinary exception from deep in torch (a bias reshaped to (B, H, Nq, Nk), which a per-head
    one is not) took the whole matrix down, built-in rows included."""

    class ReshapesBias(_naive()):
        def _attend(self, q, k, v, *, bias=None, **kw):
            if bias is not None:
                bias = bias.view(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return super()._attend(q, k, v, bias=bias, **kw)

    with _registered("test_reshapes_bias", ReshapesBias):
        cells = conformance.matrix(["naive", "test_reshapes_bias"])
    bias = cells["test_reshapes_bias"]["bias"]
    assert bias.status == "ERROR" and "\n" not in bias.detail
    assert bias.detail.startswith("RuntimeError: shape '[2, 4, 24, 24]' is invalid"), bias.detail
    assert cells["test_reshapes_bias"]["causal"].status == "yes"  # the other columns still ran
    assert {c.status for c in cells["naive"].values()} == {"yes", "no"}
    assert "| ERROR |" in conformance.grid(cells)[-1]


def _refuses_everything(order: tuple[str, ...]) -> type:
    """``naive`` refusing every call with a message that prints a set, its items in ``order`` (as a
    library's ``str`` of a Python set prints them in an order that changes between processes)."""

    class RefusesEverything(_naive()):
        def check(self, w):
            raise Unsupported(
                f"no CPU operator (device=cpu (supported: {{'cuda'}}); supported: {{{', '.join(order)}}})"
            )

    return RefusesEverything


def test_a_set_in_a_refusal_gives_the_same_page_in_any_order():
    """xFormers' refusal prints a Python set (``{torch.bfloat16, torch.float16}``), whose order changed
    between runs: docs/conformance.md changed on every regeneration."""
    pages = []
    for order in (("torch.float16", "torch.bfloat16"), ("torch.bfloat16", "torch.float16")):
        with _registered("test_refuses_all", _refuses_everything(order)):
            pages.append(conformance.markdown(conformance.matrix(["test_refuses_all"])))
    assert pages[0] == pages[1]
    assert "{torch.bfloat16, torch.float16}" in pages[0] and "{'cuda'}" in pages[0]


def _reasons_line(row: dict) -> str:
    """The page's line of reasons for ``row`` (as variant ``v``), less its ``- `v`: `` prefix."""
    (line,) = [x for x in conformance.markdown({"v": row}).splitlines() if x.startswith("- `v`: ")]
    return line.removeprefix("- `v`: ")


def test_a_row_refused_for_one_reason_says_it_once():
    """xformers on a CPU refuses 11 features with one 400-character reason (and dropout with the
    interface's): the page said it 11 times."""
    with _registered("test_refuses_all", _refuses_everything(("torch.float16",))):
        row = conformance.matrix(["test_refuses_all"])["test_refuses_all"]
    reason, dropout = row["causal"].detail, row["dropout"].detail
    assert {c.status for c in row.values()} == {"no"} and reason.startswith("no CPU operator")
    line = _reasons_line(row)
    assert line.count(reason) == 1 and line.count(dropout) == 1
    assert line == f"every feature but **dropout** (no): {reason}; **dropout** (no): {dropout}"
    same = {f: conformance.Cell("no", "r") for f in conformance.FEATURES}
    assert _reasons_line(same) == "every feature (no): r"
    # a row that runs some features keeps its reasons feature by feature
    mixed = {**same, "causal": conformance.Cell("yes")}
    assert _reasons_line(mixed).startswith("**key padding** (no): r; **GQA** (no): r")
