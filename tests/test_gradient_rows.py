"""A gradient check over some rows: where the float64 oracle over every row with its graph exceeds the
budget, a job takes the gradients of the checked rows' outputs alone (``experiments.measure.kernel.
gradient_rows``) and compares dq, dk and dv with the oracle over those rows. It used to skip the check
(sdpa's gradients went unchecked from N=2048 at B=1, H=8, D=64)."""

from __future__ import annotations

import pytest
import torch

import variants
from experiments.measure import kernel
from experiments.measure.accuracy import check_rows
from experiments.measure.kernel import measure
from experiments.measure.memory import cpu_peak_bytes
from variants import Unavailable, Unsupported, Workload, oracle

from .test_oracle_budget import _inputs
from .test_runner import job_spec

SHAPE = dict(seq_len=128, heads=2, head_dim=16, min_run_time=0.02, mode="fwd_bwd")


def _job(name: str, target: str | None = None) -> tuple[object, Workload] | None:
    """A fwd+bwd job spec of ``name`` at :data:`SHAPE` (causal where the variant is causal only) and
    its workload, or None when the variant runs neither way here."""
    for causal in (False, True):
        spec = job_spec(target, variant=name, causal=causal, **SHAPE)
        w = spec.workload()
        try:
            attn = variants.build(name, heads=w.heads, head_dim=w.head_dim)
            attn.check(w)
        except (Unsupported, Unavailable, ValueError):
            continue
        return spec, w
    return None


@pytest.mark.parametrize("name", variants.available())
def test_every_variant_over_the_budget_is_checked_on_fewer_rows(name, monkeypatch):
    """The budget set just under the oracle's with every row: a variant whose count falls with the rows
    is checked on 32 of its 128 (halving 128 -> 64 -> 32), its gradients valid; one whose count does
    not (the recurrences hold a state per key, nystrom's landmarks every query) is skipped, and says
    so, where it was skipped before."""
    job = _job(name)
    if job is None:
        pytest.skip(f"{name} runs no fwd+bwd job at this shape here")
    spec, w = job
    attn = variants.build(name, heads=w.heads, head_dim=w.head_dim)
    every, some = attn.oracle_graph_bytes(w), attn.oracle_graph_bytes(w, rows=32)
    monkeypatch.setattr(kernel, "GRAD_ORACLE_BYTES", some if some < every else every - 1)
    res = measure(spec)
    if res["status"] != "ok":
        pytest.skip(f"{name}: {res['status']} ({res['reason']})")
    f = res["figures"]
    if some < every:
        assert f["grad_checked_rows"] == 32 and f["valid"] is True, (f.get("grad_rel_err"), f.get("reason"))
        assert f["grad_rel_err"] <= 1e-3 and "grad_check_skipped" not in f
    else:
        assert "grad_rel_err" not in f and f["grad_check_skipped"].startswith("float64 oracle ")


@pytest.mark.parametrize("name", variants.available())
def test_the_rows_gradient_is_the_whole_oracle_gradient_of_those_rows(name):
    """The oracle over the checked rows, differentiated, equals the whole oracle's gradient under an
    upstream gradient that is zero off those rows (dq, dk and dv; float64): what a rows check
    compares the variant with is what a full check would have, for the same upstream gradient."""
    job = _job(name)
    if job is None:
        pytest.skip(f"{name} runs no fwd+bwd job at this shape here")
    _, w = job
    attn = variants.build(name, heads=w.heads, head_dim=w.head_dim).double()
    rows = check_rows(w.nq, 32)
    grads = []
    for restricted in (False, True):
        q, k, v = (t.requires_grad_(True) for t in _inputs(w, seed=3))
        g = torch.randn(w.batch, w.heads, w.nq, w.v_head_dim, generator=torch.Generator().manual_seed(4))
        g = g.double()
        if restricted:
            out, up = oracle(attn, q, k, v, causal=w.causal, rows=rows), g[:, :, rows]
        else:
            keep = torch.zeros(w.nq, dtype=torch.bool)
            keep[rows] = True
            out, up = oracle(attn, q, k, v, causal=w.causal), g * keep[:, None]
        grads.append(torch.autograd.grad(out, (q, k, v), up))
    for name_, full, part in zip("qkv", *grads, strict=True):
        assert torch.allclose(part, full, rtol=1e-10, atol=1e-12), name_


def test_a_backward_wrong_on_late_keys_is_caught_by_the_rows_check(monkeypatch):
    """dV 20% off on the last half of the keys only: the rows check (32 of 128 rows, each reaching
    every key) finds it, as the full check does."""
    spec = job_spec("tests.faulty.LateKeysWrongGradAttention", variant="naive", **SHAPE)
    attn = variants.build("naive")
    w = spec.workload()
    monkeypatch.setattr(kernel, "GRAD_ORACLE_BYTES", attn.oracle_graph_bytes(w, rows=32))
    f = measure(spec)["figures"]
    assert f["grad_checked_rows"] == 32 and f["valid"] is False
    assert f["out_rel_err"] <= 1e-5 and 0.05 < f["grad_v_rel_err"] < 0.3


def test_the_rows_count_holds_the_rows_check_peak():
    """The count of the oracle over 64 of 1024 rows with its graph is within 0.5-1.2x the profiler's
    peak (sdpa, B=1, H=8, D=64: ~70 MiB against ~400 MiB for every row)."""
    w = Workload(batch=1, heads=8, kv_heads=8, nq=1024, nk=1024, head_dim=64, v_head_dim=64, causal=True)
    attn = variants.build("sdpa")
    rows = check_rows(w.nq, 64)
    q, k, v = (t.requires_grad_(True) for t in _inputs(w))

    def run() -> None:
        out = oracle(attn, q, k, v, causal=True, rows=rows)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    peak, count = cpu_peak_bytes(run), attn.oracle_graph_bytes(w, rows=len(rows))
    assert 0.5 * count <= peak <= 1.2 * count, (peak / 2**20, count / 2**20)
    assert count < attn.oracle_graph_bytes(w) / 4


def test_a_row_the_oracle_holds_at_zero_is_judged_against_the_whole_scale():
    """A causal query that sees one key has no gradient (dS = P (dP - D) = 0 with P = 1): the float64
    dq of row 0 is zero, the float32 one rounding. Against the row floor (1% of the scale) that
    rounding read 3e-4 for sdpa at N=16384, over the float32 gradient tolerance; against the whole
    scale it is rounding. A row merely small (a late causal row, ~1% of the scale) is still judged
    against its own scale: losing it counts in full."""
    from experiments.measure.accuracy import error_stats

    n = 4096
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 64, generator=g, dtype=torch.float64) for _ in range(3))
    q.requires_grad_(True)
    rows = check_rows(n, 64)  # a rows check's: the upstream gradient zero off them
    up = torch.randn(1, 1, n, 64, generator=g, dtype=torch.float64)
    up[:, :, ~torch.isin(torch.arange(n), rows)] = 0
    ref64 = oracle(variants.build("sdpa"), q, k, v, causal=True, rows=rows)
    (ref,) = torch.autograd.grad(ref64, q, up[:, :, rows])
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
    (got,) = torch.autograd.grad(out, q32, up.float())
    assert float(ref[..., 0, :].abs().max()) < 1e-12  # zero by structure; float32's is its rounding
    stats = error_stats(got, ref, "dq")
    assert stats["dq_row_rel_err"] < 5e-5, stats  # against the floor: 1.1e-4 (here, torch 2.13 on AVX2)
    # the last rows lost: each is judged against its own scale, as before
    lost = got.clone()
    lost[..., rows[-8:], :] = 0
    assert error_stats(lost, ref, "dq")["dq_row_rel_err"] == pytest.approx(1.0)


def test_the_accuracy_table_says_how_many_rows_the_gradients_were_of():
    from experiments.records import store
    from experiments.report.kernel_tables import accuracy_table

    from .test_compare import record

    recs = [record(n, 10.0, 0.1) for n in (1024, 16384)]
    for rec, rows in zip(recs, (1024, 64), strict=True):
        rec["config"]["mode"] = "fwd_bwd"
        rec["figures"].update(grad_rel_err=1e-6, grad_row_rel_err=1e-5, grad_checked_rows=rows)
    sec = accuracy_table(store.to_frame(recs))
    assert sec.data.set_index("seq_len")["grad_checked_rows"].to_dict() == {1024: 1024, 16384: 64}
    assert "else of fewer rows' (accuracy.csv's `grad_checked_rows`)" in sec.note
    older = [record(1024, 10.0, 0.1)]  # a record from before: neither the column nor the sentence
    sec = accuracy_table(store.to_frame(older))
    assert "grad_checked_rows" not in sec.data and "grad_checked_rows" not in sec.note
