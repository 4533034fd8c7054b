"""The oracle on a subset of query rows: a variant's own float64 formula (``oracle_forward``)
computes the checked rows alone, so a long sequence is checked in ``O(rows * Nk)`` instead of
skipped (linear attention at N=16384 on 2 heads needed a 4 GiB oracle, over the job's 2 GiB budget:
its records were called valid with no check).

The oracle for the subset is the same formula over all rows, cut to those rows."""

from __future__ import annotations

import pytest
import torch

import variants
from experiments.measure.kernel import FULL_ORACLE_BYTES, measure
from variants import Workload, oracle
from variants.base import Unsupported, takes_rows

from .test_runner import job_spec

OWN_FORMULA = [n for n in variants.available() if getattr(variants.build(n), "oracle_forward", None)]
SQUARE_ONLY = {"linformer", "nystrom", "axial"}  # self-attention forms: as many queries as keys
HEADS_8 = {"gla", "ssd", "deltanet", "gated_deltanet"}  # their gates are built for 8 heads of 64


def test_every_own_formula_but_axials_takes_rows():
    """A registered variant whose oracle computed every row would still be skipped at long N. axial's
    column stage reads its row stage at every position of a checked row's column: it computes all rows,
    and its count says so (a count of the checked rows alone let a 16 GiB oracle run at N=16384)."""
    assert len(OWN_FORMULA) >= 11
    assert all(takes_rows(variants.build(n).oracle_forward) for n in OWN_FORMULA if n != "axial")
    axial = variants.build("axial")
    assert not takes_rows(axial.oracle_forward)
    w = Workload(batch=1, heads=8, nq=16384, nk=16384, head_dim=64, v_head_dim=64)
    assert axial.oracle_bytes(w, rows=256) == axial.oracle_bytes(w) > FULL_ORACLE_BYTES


def test_takes_rows_of_forms_without_the_parameter():
    assert not takes_rows(lambda q, k, v, **kw: q)  # **kw: gets the whole output, cut
    assert takes_rows(lambda q, k, v, rows=None: q)
    assert not takes_rows(torch.add)  # no signature to read


@pytest.mark.parametrize("rows", [[-1], [3, 3], [0, 64], [0.5]])
def test_bad_rows_are_refused_in_one_line(rows):
    """A negative row was placed at ``r + Nk - Nq`` by the row forms: 0.12-0.84 off, silently; a
    repeated one crashed the recurrences' loop."""
    attn = variants.build("linear")
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float64) for _ in range(3))
    with pytest.raises(ValueError, match="rows must"):
        oracle(attn, q, k, v, causal=True, rows=torch.tensor(rows))


def test_a_rows_formula_returning_other_rows_is_refused():
    class AllRows(variants.registry.get("linear")):
        def oracle_forward(self, q, k, v, *, rows=None, **kw):  # says it takes rows, returns all
            return super().oracle_forward(q, k, v, **kw)

    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float64) for _ in range(3))
    with pytest.raises(ValueError, match="returned 64 rows for 3 asked"):
        oracle(AllRows(), q, k, v, causal=True, rows=torch.tensor([0, 5, 63]))
    # over packed documents each document's call is held to its own rows (it was torch's shape error)
    documents = torch.tensor([[0] * 40 + [1] * 24])  # (1, 64)
    with pytest.raises(ValueError, match="returned 40 rows for 2 asked"):
        oracle(AllRows(), q, k, v, causal=True, documents=documents, rows=torch.tensor([0, 5, 63]))


def _cases(name):
    h, hkv, d = (8, 4, 64) if name in HEADS_8 else (4, 2, 16)
    if name == "axial":
        hkv = h
    shapes = [(64, 64)] if name in SQUARE_ONLY else [(64, 64), (7, 96), (100, 100)]
    for causal in (True, False):
        for nq, nk in shapes:
            for rows in (torch.tensor([0, 5, nq - 1]), torch.arange(1, nq, 1)):
                yield causal, nq, nk, h, hkv, d, rows


def _taken(attn, name):
    """``(kw, q, k, v, rows)`` for each of :func:`_cases` the variant takes: batch 2, the second
    sequence padded at its end (``kw``: causal and the key padding mask), float64."""
    g = torch.Generator().manual_seed(3)
    for causal, nq, nk, h, hkv, d, rows in _cases(name):
        q = torch.randn(2, h, nq, d, generator=g, dtype=torch.float64)
        k = torch.randn(2, hkv, nk, d, generator=g, dtype=torch.float64)
        v = torch.randn(2, hkv, nk, d, generator=g, dtype=torch.float64)
        kpm = torch.ones(2, nk, dtype=torch.bool)
        kpm[1, -9:] = False
        try:
            attn.check(Workload.of(q, k, v, causal=causal, key_padding_mask=kpm))
        except Unsupported:  # a causal-only recurrence, a form with no causal mask
            continue
        yield {"causal": causal, "key_padding_mask": kpm}, q, k, v, rows


@pytest.mark.parametrize("name", OWN_FORMULA)
def test_the_oracle_on_some_rows_is_those_rows_of_the_whole(name):
    attn = variants.build(name)
    checked = 0
    for kw, q, k, v, rows in _taken(attn, name):
        checked += 1
        with torch.no_grad():
            whole = oracle(attn, q, k, v, **kw)
            part = oracle(attn, q, k, v, rows=rows, **kw)
        assert part.shape == (*whole.shape[:2], len(rows), whole.shape[-1])
        err = float((part - whole[:, :, rows]).abs().max() / whole.abs().max())
        assert err < 1e-12, (kw["causal"], q.shape, k.shape, len(rows), err)
    assert checked >= 2


def test_the_count_of_a_row_check_holds_the_checked_rows_alone():
    w = Workload(batch=1, heads=2, nq=16384, nk=16384, head_dim=16, v_head_dim=16, causal=True)
    linear = variants.build("linear")
    assert linear.oracle_bytes(w) > FULL_ORACLE_BYTES  # the whole oracle: 4 GiB of weights
    rows = linear.oracle_bytes(w, rows=256)
    assert rows == 2 * 256 * 16384 * 8 + 8 * (2 * 16384 * 16 + 2 * 16384 * 32)
    assert rows < FULL_ORACLE_BYTES


LONG = dict(seq_len=16384, heads=2, head_dim=16, causal=True, min_run_time=0.02)


def test_a_long_linear_job_is_checked_not_skipped():
    f = measure(job_spec(variant="linear", **LONG))["figures"]
    assert "accuracy_skipped" not in f, f.get("accuracy_skipped")
    assert f["checked_rows"] == 256 and f["out_rel_err"] < 1e-4 and f["valid"] is True


def test_a_long_job_losing_its_late_rows_is_marked_invalid():
    res = measure(job_spec("tests.faulty.LateRowsLostLinear", variant="linear", **LONG))
    f = res["figures"]
    assert f["valid"] is False and f["out_row_rel_err"] > 0.5 and "invalid" in res["reason"]


def test_over_packed_documents_an_own_formula_is_counted_on_its_rows():
    """Each document computes its own checked rows alone (``attend_each_document(rows=)``); it
    computed every row of each document, so a long packed job's 4 GiB count skipped its check."""
    w = Workload(batch=1, heads=2, nq=16384, nk=16384, head_dim=16, v_head_dim=16, causal=True)
    packed = Workload(
        batch=1, heads=2, nq=16384, nk=16384, head_dim=16, v_head_dim=16, causal=True, documents=True
    )
    for name in ("linear", "sdpa", "performer", "gated_deltanet"):
        attn = variants.build(name, heads=2, head_dim=16) if name in HEADS_8 else variants.build(name)
        assert attn.oracle_bytes(packed, rows=256) == attn.oracle_bytes(w, rows=256) < FULL_ORACLE_BYTES
    axial = variants.build("axial")  # no rows=: every row, packed or not
    assert axial.oracle_bytes(packed, rows=256) == axial.oracle_bytes(w) > FULL_ORACLE_BYTES


ROWS_FORMULA = [n for n in OWN_FORMULA if takes_rows(variants.build(n).oracle_forward)]


@pytest.mark.parametrize("name", ROWS_FORMULA)
def test_over_packed_documents_the_oracle_on_some_rows_is_those_rows_of_the_whole(name):
    attn = variants.build(name)
    h, hkv, d = (8, 4, 64) if name in HEADS_8 else (4, 2, 16)
    g = torch.Generator().manual_seed(5)
    checked = 0
    for nq, nk in ((96, 96), (40, 96)):
        q = torch.randn(2, h, nq, d, generator=g, dtype=torch.float64)
        k = torch.randn(2, hkv, nk, d, generator=g, dtype=torch.float64)
        v = torch.randn(2, hkv, nk, d, generator=g, dtype=torch.float64)
        documents = torch.tensor([[0] * 30 + [1] * 50 + [2] * 16, [0] * 70 + [1] * 26])  # (2, 96)
        kpm = torch.ones(2, nk, dtype=torch.bool)
        kpm[1, -9:] = False
        kw = {"causal": True, "key_padding_mask": kpm, "documents": documents}
        try:
            attn.check(Workload.of(q, k, v, causal=True, key_padding_mask=kpm, documents=documents))
        except Unsupported:  # square-only forms with fewer queries than keys
            continue
        for rows in (torch.tensor([nq - 1, 0, 5, 31]), torch.arange(nq)):
            with torch.no_grad():
                whole = oracle(attn, q, k, v, **kw)
                part = oracle(attn, q, k, v, rows=rows, **kw)
            err = float((part - whole[:, :, rows]).abs().max() / whole.abs().max())
            assert part.dtype == torch.float64 and err < 1e-12, (q.shape, len(rows), err)
            checked += 1
    if not checked:
        pytest.skip(f"{name} takes no packed documents")


def test_a_long_packed_job_is_checked_and_one_losing_its_late_rows_is_invalid():
    ok = measure(job_spec(variant="linear", documents=4, **LONG))["figures"]
    assert "accuracy_skipped" not in ok, ok.get("accuracy_skipped")
    assert ok["checked_rows"] == 256 and ok["out_rel_err"] < 1e-4 and ok["valid"] is True
    res = measure(job_spec("tests.faulty.LateRowsLostLinear", variant="linear", documents=4, **LONG))
    assert res["figures"]["valid"] is False and "invalid" in res["reason"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", OWN_FORMULA)
def test_the_oracle_on_some_rows_on_cuda_is_the_cpus(name):
    """The rows' index tensor lives on the host; the positions and masks built from it must follow the
    inputs to the device (every case: padding, decode shapes, gla's and ssd's loop past 64 rows)."""
    attn = variants.build(name)
    for kw, q, k, v, rows in _taken(attn, name):
        on_gpu = {"causal": kw["causal"], "key_padding_mask": kw["key_padding_mask"].cuda()}
        with torch.no_grad():
            cpu = oracle(attn, q, k, v, rows=rows, **kw)
            gpu = oracle(attn.cuda(), q.cuda(), k.cuda(), v.cuda(), rows=rows, **on_gpu)
        attn.cpu()
        assert float((gpu.cpu() - cpu).abs().max() / cpu.abs().max()) < 1e-12


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_decode_job_checks_its_step():
    shape = dict(batch=1, heads=4, kv_heads=2, head_dim=64, causal=True, min_run_time=0.05, kv_len=512)
    f = measure(job_spec(variant="linear", seq_len=1, device="cuda", dtype="bfloat16", **shape))["figures"]
    assert f["valid"] is True and f["step_row_rel_err"] < 5e-2 and f["step_median_s"] > 0, f
