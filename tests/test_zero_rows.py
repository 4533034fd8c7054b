"""A row the float64 oracle holds at zero by structure (a query that sees no key has no output, one
that sees a single key no gradient) is judged against the whole scale, not the row floor
(``experiments.measure.accuracy.ZERO_ROW``)."""

from __future__ import annotations

import pytest
import torch

import variants
from experiments.measure.accuracy import check_rows, error_stats
from variants import oracle


def test_a_row_the_oracle_holds_at_zero_is_judged_against_the_whole_scale():
    """A causal query that sees one key has no gradient (dS = P (dP - D) = 0 with P = 1): the float64
    dq of row 0 is zero, the float32 one rounding. Against the row floor (1% of the scale) that
    rounding grows as the scale falls with N (3e-4 for sdpa at N=16384, over the float32 gradient
    tolerance); here the upstream gradient on 64 rows makes dq's scale as small at N=4096. Against
    the whole scale it is rounding. A row merely small (a late causal row, ~1% of the scale) is still
    judged against its own scale: losing it counts in full."""
    n = 4096
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 64, generator=g, dtype=torch.float64) for _ in range(3))
    q.requires_grad_(True)
    rows = check_rows(n, 64)  # the upstream gradient on these rows only: a small dq scale
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
