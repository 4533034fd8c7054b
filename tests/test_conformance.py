"""The conformance matrix (experiments/report/conformance.py): every feature a variant claims takes
effect against the float64 oracle, and docs/conformance.md shows the matrix as the code has it."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.report import conformance

DOC = Path(__file__).resolve().parents[1] / "docs" / "conformance.md"


@pytest.fixture(scope="module")
def cells():
    return conformance.matrix()


def test_no_claimed_feature_is_ignored_or_wrong(cells):
    bad = [
        f"{name} / {feature}: {c.status} ({c.detail})"
        for name, row in cells.items()
        for feature, c in row.items()
        if c.status not in ("yes", "no")
    ]
    assert not bad, "\n".join(bad)


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
