"""The gradient check in blocks of rows: where the float64 oracle over every row with its graph exceeds
the budget, a job computes it over every row a block at a time, summing each block's dq, dk and dv
(``experiments.measure.accuracy.oracle_gradients``), while its work is within ``grad_check_scores``.
It used to skip the check (sdpa's gradients went unchecked from N=2048 at B=1, H=8, D=64)."""

from __future__ import annotations

import pytest
import torch

import variants
from experiments.measure import grad_budget
from experiments.measure.accuracy import oracle_calls, oracle_gradients
from experiments.measure.grad_budget import blocked_check_bytes, gradient_block, oracle_scores
from experiments.measure.inputs import make_inputs
from experiments.measure.kernel import measure
from experiments.measure.memory import cpu_peak_bytes
from variants import Unavailable, Unsupported, Workload, oracle

from .test_runner import job_spec

SHAPE = dict(seq_len=128, heads=2, head_dim=16, min_run_time=0.02, mode="fwd_bwd")


def _job(name: str, target: str | None = None, **over) -> tuple[object, Workload] | None:
    """A fwd+bwd job spec of ``name`` at :data:`SHAPE` (causal where the variant is causal only) and
    its workload, or None when the variant runs neither way here."""
    for causal in (False, True):
        spec = job_spec(target, variant=name, causal=causal, **{**SHAPE, **over})
        w = spec.workload()
        try:
            attn = variants.build(name, heads=w.heads, head_dim=w.head_dim)
            attn.check(w)
        except (Unsupported, Unavailable, ValueError):
            continue
        return spec, w
    return None


def _blocked_and_whole(name: str, spec, w: Workload, block: int) -> tuple[tuple, tuple]:
    """The oracle's gradients of ``spec``'s inputs in blocks of ``block`` rows and in one call."""
    attn = variants.build(name, heads=w.heads, head_dim=w.head_dim).double()
    inp = make_inputs(
        w.batch, w.heads, w.nq, w.nk, w.head_dim, w.v_head_dim, dtype=torch.float64, device="cpu",
        padding=spec.padding, seed=3, kv_heads=w.kv_heads, bias=spec.bias, causal=spec.causal,
        documents=spec.documents,
    )  # fmt: skip
    q, k, v = inp.tensors()
    kw = inp.kwargs(spec.causal, spec.cross)
    up = torch.randn(w.batch, w.heads, w.nq, w.v_head_dim, generator=torch.Generator().manual_seed(4))
    return (
        oracle_gradients(attn, q, k, v, up.double(), kw, block=block)[0],
        oracle_gradients(attn, q, k, v, up.double(), kw)[0],
    )


@pytest.mark.parametrize("name", variants.available())
def test_the_blocked_oracle_gradient_is_the_whole_oracle_gradient(name):
    """Every row in blocks of 16, and of 48 (the last block short: 128 = 2 * 48 + 32), each block's
    gradients summed: dq, dk and dv equal the whole oracle's (float64), where the oracle leaves out the
    keys a block does not reach too."""
    job = _job(name)
    if job is None:
        pytest.skip(f"{name} runs no fwd+bwd job at this shape here")
    spec, w = job
    for block in (16, 48):
        blocked, whole = _blocked_and_whole(name, spec, w, block)
        for which, got, want in zip("qkv", blocked, whole, strict=True):
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (which, block)


@pytest.mark.parametrize("name", ["sdpa", "local_window", "sparse"])
@pytest.mark.parametrize(
    "over", [dict(padding=0.25), dict(documents=3), dict(bias="alibi"), dict(kv_heads=1)], ids=str
)
def test_the_blocked_gradient_holds_with_masks_a_bias_and_grouped_heads(name, over):
    """Padding, packed documents and ALiBi's bias cut to the keys a block reaches, and grouped K/V
    heads: the blocked gradients are still the whole oracle's."""
    job = _job(name, **over)
    if job is None:
        pytest.skip(f"{name} takes none of {over} here")
    spec, w = job
    blocked, whole = _blocked_and_whole(name, spec, w, 16)
    for which, got, want in zip("qkv", blocked, whole, strict=True):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), which


@pytest.mark.parametrize("name", variants.available())
def test_every_variant_over_the_budget_is_checked_in_blocks(name, monkeypatch):
    """The memory budget set to a block of 32 rows: a variant whose count falls with
    the rows is checked over every row in blocks of 32, its gradients valid and the same errors as the
    check in one call; one whose count does not (the recurrences hold a state per key, nystrom's
    landmarks every query) is skipped, and says so, where it was skipped before."""
    job = _job(name)
    if job is None:
        pytest.skip(f"{name} runs no fwd+bwd job at this shape here")
    spec, w = job
    attn = variants.build(name, heads=w.heads, head_dim=w.head_dim)
    every, some = attn.oracle_graph_bytes(w), attn.oracle_graph_bytes(w, rows=32)
    whole = measure(spec)
    if whole["status"] != "ok":
        pytest.skip(f"{name}: {whole['status']} ({whole['reason']})")
    budget = blocked_check_bytes(attn, w, 32) if some < every else every - 1
    monkeypatch.setattr(grad_budget, "GRAD_ORACLE_BYTES", budget)
    f = measure(spec)["figures"]
    if some < every:
        assert f["grad_check_calls"] == 4 and f["valid"] is True, (f.get("grad_rel_err"), f.get("reason"))
        assert f["grad_row_rel_err"] == pytest.approx(whole["figures"]["grad_row_rel_err"], rel=1e-6)
        assert whole["figures"]["grad_check_calls"] == 1
    else:
        assert "grad_rel_err" not in f and f["grad_check_skipped"].startswith("float64 oracle ")


def test_a_backward_wrong_on_the_last_rows_is_caught_by_the_blocked_check(monkeypatch):
    """dQ 20% off on the last eighth of the queries only: the check in blocks of 32 reaches them and
    reads the 20%, not the 100% of a block left out."""
    spec = job_spec("tests.faulty.LateRowsWrongGradAttention", variant="naive", **SHAPE)
    attn = variants.build("naive")
    w = spec.workload()
    monkeypatch.setattr(grad_budget, "GRAD_ORACLE_BYTES", blocked_check_bytes(attn, w, 32))
    f = measure(spec)["figures"]
    assert f["grad_check_calls"] == 4 and f["valid"] is False
    assert f["out_rel_err"] <= 1e-5 and 0.1 < f["grad_q_row_rel_err"] < 0.3
    assert f["grad_v_rel_err"] < 1e-5 and f["grad_k_rel_err"] < 1e-5  # dK and dV right


def test_a_check_over_the_score_budget_is_skipped_and_said():
    """The work budget: sdpa at B=1, H=8, N=16384 computes 8 * 16384 * 16385 / 2 = 1.07e9 causal
    scores, over the default 2^27; with the budget raised it runs in blocks. local_window's band at
    the same length is 8 * ~16384 * 128 scores, within it."""
    w = Workload(batch=1, heads=8, kv_heads=8, nq=16384, nk=16384, head_dim=64, v_head_dim=64, causal=True)
    sdpa = variants.build("sdpa")
    assert oracle_scores(sdpa, w) == 8 * 16384 * 16385 // 2
    said = gradient_block(sdpa, w, 2**27)
    assert said == (
        f"float64 oracle {sdpa.oracle_graph_bytes(w) / 2**20:.0f} MiB > 2048 MiB at once, and "
        "1.07e+09 scores in blocks > grad_check_scores=1.34e+08"
    )
    raised = gradient_block(sdpa, w, 2**31)
    assert isinstance(raised, int)
    count = blocked_check_bytes(sdpa, w, raised)
    assert count <= grad_budget.GRAD_ORACLE_BYTES < blocked_check_bytes(sdpa, w, 2 * raised)
    window = variants.build("local_window")
    assert oracle_scores(window, w) < 2**27 and isinstance(gradient_block(window, w, 2**27), int)


def test_a_recurrence_is_checked_whole_to_long_n_and_said_where_rows_would_not_help():
    """deltanet's checkpointed graph keeps a state per segment of sqrt(N) keys: its whole check fits
    at N=8192 (counted 6.1 GiB with a state per key: skipped until 2026-11-28) and at 32768. At N=65536
    its float64 inputs and their gradients alone pass the budget and no run of rows shrinks them:
    the record says so with the fewest rows' count, whatever the work allowed."""
    delta = variants.build("deltanet")
    for n in (8192, 32768):
        w = Workload(batch=1, heads=8, kv_heads=8, nq=n, nk=n, head_dim=64, v_head_dim=64, causal=True)
        assert gradient_block(delta, w, 2**27) == n
    w = Workload(batch=1, heads=8, kv_heads=8, nq=2**16, nk=2**16, head_dim=64, v_head_dim=64, causal=True)
    for budget in (2**27, 2**40):  # the memory said first: a larger grad_check_scores would not help
        said = gradient_block(delta, w, budget)
        assert isinstance(said, str) and said.endswith("in blocks of 16 rows, the fewest"), said


def test_the_whole_oracle_runs_at_once_where_it_fits_whatever_its_work():
    """Below the memory budget every row goes in one call (sdpa at N=2048, H=8: 1.6 GiB)."""
    w = Workload(batch=1, heads=8, kv_heads=8, nq=2048, nk=2048, head_dim=64, v_head_dim=64, causal=False)
    assert gradient_block(variants.build("sdpa"), w, 1) == 2048


def test_the_block_count_holds_the_blocked_check_peak():
    """The count of a check in blocks of 64 of 1024 rows is within 0.5-1.2x the profiler's peak of it
    (sdpa, causal, B=1, H=8, D=64: ~60 MiB against ~400 MiB at once)."""
    w = Workload(batch=1, heads=8, kv_heads=8, nq=1024, nk=1024, head_dim=64, v_head_dim=64, causal=True)
    attn = variants.build("sdpa")
    g = torch.Generator().manual_seed(0)
    q, k, v, up = (torch.randn(1, 8, 1024, 64, generator=g) for _ in range(4))

    def run() -> None:
        oracle_gradients(attn, q, k, v, up, {"causal": True}, block=64)

    peak, count = cpu_peak_bytes(run), blocked_check_bytes(attn, w, 64)
    assert 0.5 * count <= peak <= 1.2 * count, (peak / 2**20, count / 2**20)
    assert count < attn.oracle_graph_bytes(w) / 4


def test_the_oracle_refuses_a_pattern_it_cannot_take():
    q = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"pattern must be the bool \(Nq, Nk\) = \(8, 8\)"):
        oracle(variants.build("sdpa"), q, q, q, pattern=torch.ones(8, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="computes its own formula"):
        oracle(variants.build("linear"), q, q, q, pattern=torch.ones(8, 8, dtype=torch.bool))


def test_rows_whose_pattern_reaches_few_keys_share_a_call():
    """A band of half-width 16 over 1024 keys: runs of 64 rows reach at most 64 + 32 keys, 6144 pairs
    within 16 rows against every key (16384); runs of 128 reach 160, 20480, over. A full or causal
    pattern (its last rows reach every key) keeps runs of 16; a first row that reaches every key (a
    global query) keeps its run short and the others long."""
    n = 1024
    i = torch.arange(n)
    band = (i[:, None] - i[None, :]).abs() <= 16
    assert oracle_calls(n, 16, band) == [(s, s + 64) for s in range(0, n, 64)]
    full = torch.ones(n, n, dtype=torch.bool)
    assert oracle_calls(n, 16, full) == oracle_calls(n, 16) == [(s, s + 16) for s in range(0, n, 16)]
    assert oracle_calls(n, 16, full.tril())[-1] == (n - 16, n)
    glob = band.clone()
    glob[0] = True
    assert oracle_calls(n, 16, glob)[:2] == [(0, 16), (16, 80)]
    assert oracle_calls(n, 2048, band) == [(0, n)] and oracle_calls(100, 16)[-1] == (96, 100)


def test_a_scorer_of_its_own_gets_every_key():
    """A third party's ``reference_scores`` may read a key's position from its index (here a bias
    that varies with it): the oracle hands it every key, so a run of rows over a window gives the
    whole oracle's output and gradients; left to the reached keys, the index would shift."""
    from variants.local_window import LocalWindowAttention

    class PositionScored(LocalWindowAttention):
        def reference_scores(self, q, k, scale=None):
            s = super().reference_scores(q, k, scale)  # (B, H, R, Nk)
            return s + torch.sin(0.7 * torch.arange(k.shape[2], dtype=s.dtype))  # not a shift per row

    attn = PositionScored(window=8)
    g = torch.Generator().manual_seed(5)
    q, k, v, up = (torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) for _ in range(4))
    kw = {"causal": True}
    blocked, _ = oracle_gradients(attn, q, k, v, up, kw, block=16)
    whole, _ = oracle_gradients(attn, q, k, v, up, kw)
    for which, got, want in zip("qkv", blocked, whole, strict=True):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), which
    rows = torch.arange(48, 64)
    assert torch.allclose(oracle(attn, q, k, v, rows=rows, **kw), oracle(attn, q, k, v, **kw)[:, :, rows])


def test_a_count_written_before_it_took_rows_counts_every_row():
    """A third party's ``oracle_graph_bytes(self, w)`` (no ``rows``): the job does not fail on the
    keyword; it counts every row, so no run of rows fits where the whole does not, and says so."""
    from variants.sdpa import SDPAAttention

    class OlderCount(SDPAAttention):
        def oracle_graph_bytes(self, w):
            return super().oracle_graph_bytes(w)

    w = Workload(batch=1, heads=8, kv_heads=8, nq=4096, nk=4096, head_dim=64, v_head_dim=64, causal=True)
    said = gradient_block(OlderCount(), w, 2**27)
    assert isinstance(said, str) and said.endswith("in blocks of 16 rows, the fewest"), said
    assert isinstance(gradient_block(SDPAAttention(), w, 2**27), int)


def test_grad_check_scores_decides_a_job_s_check_and_is_refused_on_a_forward(monkeypatch):
    """The knob through a job: at a memory budget of a run of 32 rows, the default checks sdpa's
    gradients in runs, a budget below its 2 * 128 * 129 / 2 causal scores skips them and says so. A
    forward has no gradients: the knob set there is refused in one line, not ignored."""
    from experiments.sweep.schema import BenchConfig, validate

    over = dict(SHAPE, causal=True)
    spec = job_spec(variant="sdpa", **over)
    w = spec.workload()
    monkeypatch.setattr(grad_budget, "GRAD_ORACLE_BYTES", blocked_check_bytes(variants.build("sdpa"), w, 32))
    checked = measure(spec)["figures"]
    assert checked["grad_check_calls"] > 1 and checked["valid"] is True
    skipped = measure(job_spec(variant="sdpa", grad_check_scores=2 * 128 * 129 // 2 - 1, **over))["figures"]
    assert "grad_rel_err" not in skipped
    assert skipped["grad_check_skipped"].endswith("1.65e+04 scores in blocks > grad_check_scores=1.65e+04")
    base = {"variant": {"_target_": "variants.sdpa.SDPAAttention"}, "grad_check_scores": 1000}
    validate(BenchConfig.from_config({**base, "mode": "fwd_bwd"}))
    with pytest.raises(ValueError, match=r"grad_check_scores=1000 applies to mode=fwd_bwd only"):
        validate(BenchConfig.from_config(base))
