"""The float64 oracle's memory: grouped K/V heads are read, never copied per query head, and a job's
budget (``oracle_bytes``) counts what the oracle holds.

The peak is the profiler's count of the oracle's allocations (``cpu_peak_bytes``, checked against the
process's high-water mark in ``test_memory.py``); the count each variant gives is an analytic one
written from its reference's tensors.
"""

from __future__ import annotations

import pytest
import torch

import variants
from experiments.measure.memory import cpu_peak_bytes
from variants import Workload, oracle
from variants.base import Unsupported, grouped_matmul, repeat_kv

from .test_runner import job_spec

# what decoding checks: 32 query heads on 4 K/V heads, one query, a long cache
DECODE = dict(batch=1, heads=32, kv_heads=4, nq=1, nk=4096, head_dim=64, v_head_dim=64, causal=True)
KERNEL_FAMILY = ["sdpa", "local_window", "linear", "performer", "retention", "window_linear"]
GATED = ["ssd", "gla", "deltanet", "gated_deltanet"]  # built for 8 heads of 64


def _inputs(w: Workload, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(w.batch, w.heads, w.nq, w.head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(w.batch, w.hkv, w.nk, w.head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(w.batch, w.hkv, w.nk, w.v_head_dim, generator=g, dtype=torch.float64)
    return q, k, v


def test_grouped_matmul_is_the_product_with_repeated_heads():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 12, 5, 7, generator=g, dtype=torch.float64)
    b = torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64)
    want = a @ repeat_kv(b, 12)  # query head h against key head h // 4, written with a copy
    assert torch.equal(grouped_matmul(a, b), want)
    assert torch.equal(grouped_matmul(a.transpose(-1, -2).contiguous().transpose(-1, -2), b), want)


@pytest.mark.parametrize("name", KERNEL_FAMILY)
def test_a_decode_oracle_reads_grouped_heads_without_a_copy_per_query_head(name):
    """At 32:4 heads a float64 copy of K and V per query head is 8x the cache (32 MiB here against
    4 MiB); the oracle's peak stays within 2.5x the variant's own count of its tensors, which holds
    K and V once per K/V head (the repeated copies put sdpa at 4.7x, performer at 3.8x)."""
    attn = variants.build(name)
    w = Workload(**DECODE)
    q, k, v = _inputs(w)
    with torch.no_grad():
        peak = cpu_peak_bytes(lambda: oracle(attn, q, k, v, causal=True))
    assert peak <= 2.5 * attn.oracle_bytes(w), (peak / 2**20, attn.oracle_bytes(w) / 2**20)


SHAPES = [(2, 4, 4, 256, 256, 32), (1, 8, 2, 512, 512, 32), (1, 32, 4, 16, 4096, 64)]  # B, H, Hkv, Nq, Nk, D


@pytest.mark.parametrize("name", KERNEL_FAMILY)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_oracle_count_is_within_a_small_factor_of_its_peak(name, shape):
    """The count is the scores, the float64 inputs and a reference's features; the softmax's
    temporaries (its exponentials, the probabilities, the mask) take the peak to at most ~4x it. The
    count takes every key; the oracle computes the keys some row reaches, so the peak may be that
    share of it lower (local_window's 16 decoding queries reach 143 of 4096 keys)."""
    b, h, hkv, nq, nk, d = shape
    w = Workload(batch=b, heads=h, kv_heads=hkv, nq=nq, nk=nk, head_dim=d, v_head_dim=d, causal=True)
    attn = variants.build(name)
    q, k, v = _inputs(w)
    with torch.no_grad():
        peak = cpu_peak_bytes(lambda: oracle(attn, q, k, v, causal=True))
    reach = float(attn.pattern(nq, nk, True).any(0).double().mean())  # of the keys, by some row
    assert 0.5 * reach * attn.oracle_bytes(w) <= peak <= 4.5 * attn.oracle_bytes(w)


def _gradient_check_peak(attn: variants.AttentionVariant, w: Workload) -> int:
    """The profiler's peak of a job's gradient check: the float64 oracle over all rows of ``w`` and
    the gradients of q, k and v through it."""
    q, k, v = (t.requires_grad_(True) for t in _inputs(w))

    def run() -> None:
        out = oracle(attn, q, k, v, causal=w.causal)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    return cpu_peak_bytes(run)


def _graph_cases():
    """``(name, workload)``: each variant but the recurrences (below) at the shapes it takes, causal
    where it can be, up to 600 MiB of count (additive's hidden layer is the bulk at 512)."""
    shapes = [(1, 4, 4, 128, 32), (2, 4, 2, 256, 32), (1, 8, 8, 128, 64), (1, 8, 8, 512, 64)]
    for name in sorted(set(variants.registry.available()) - set(GATED)):
        attn = variants.build(name)
        for b, h, hkv, n, d in shapes:
            for causal in (True, False):
                sizes = dict(batch=b, heads=h, kv_heads=hkv, nq=n, nk=n, head_dim=d, v_head_dim=d)
                w = Workload(**sizes, causal=causal)
                try:
                    attn.check(w)
                except (Unsupported, ValueError):
                    continue
                if attn.oracle_graph_bytes(w) <= 600 * 2**20:
                    yield pytest.param(name, w, id=f"{name}-{b}x{h}:{hkv}x{n}x{d}")
                break


@pytest.mark.parametrize("name,w", list(_graph_cases()))
def test_the_gradient_check_count_holds_its_peak(name, w):
    """A job checks the gradients only while ``oracle_graph_bytes`` is within its budget. The count was
    the forward's (a float64 score per pair): the softmax's graph (scores, exponentials, probabilities
    and their gradients) took the peak to 3.9-5.3x it, so a 256 MiB budget held about 1.3 GiB for sdpa
    and 256 MiB for the recurrences. The count now holds the peak for every variant (within 1.2x at
    the smallest shapes), and is not more than 2x over it."""
    attn = variants.build(name)
    peak, count = _gradient_check_peak(attn, w), attn.oracle_graph_bytes(w)
    assert 0.5 * count <= peak <= 1.2 * count, (peak / 2**20, count / 2**20)


def test_performer_counts_its_random_features():
    w = Workload(**DECODE)
    plain = variants.build("linear").oracle_bytes(w)
    pairs = w.batch * w.heads * w.nq * w.nk * 8
    assert plain == pairs + 8 * (32 * 64 + 4 * 4096 * 128)  # q per query head, k and v per K/V head
    m = variants.build("performer").features
    assert variants.build("performer").oracle_bytes(w) == plain + 2 * 8 * m * (32 * 1 + 4 * 4096)


def test_a_job_skips_the_gradient_check_when_the_oracle_features_exceed_the_budget(monkeypatch):
    # performer's (N, m) random features are 16x its (N, N) scores at N=64, m=256: a budget counting
    # only the scores would run the check; the count with the features skips it and says so
    from experiments.measure import grad_budget
    from experiments.measure.kernel import measure

    spec = job_spec(variant="performer", mode="fwd_bwd", seq_len=64, heads=2, head_dim=16, min_run_time=0.02)
    w = spec.workload()
    scores = w.batch * w.heads * w.nq * w.nk * 8
    monkeypatch.setattr(grad_budget, "GRAD_ORACLE_BYTES", 4 * scores)
    figures = measure(spec)["figures"]
    assert "grad_rel_err" not in figures
    assert figures["grad_check_skipped"].startswith("float64 oracle ")


# --------------------------------------------------------------- the gated and delta-rule recurrences


def _gated_peak(name: str, w: Workload, rows: int | None) -> tuple[int, int]:
    """``(peak, count)``: the oracle's peak checking ``rows`` evenly spread rows (None: all rows, and
    the gradients of q, k and v through it, as a job's gradient check), and the variant's count."""
    attn = variants.build(name)
    if rows is None:
        return _gradient_check_peak(attn, w), attn.oracle_graph_bytes(w)
    q, k, v = _inputs(w)
    checked = torch.arange(0, w.nq, max(1, w.nq // rows))[:rows]
    with torch.no_grad():
        peak = cpu_peak_bytes(lambda: oracle(attn, q, k, v, causal=True, rows=checked))
    return peak, attn.oracle_bytes(w, rows=len(checked))


@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize(
    "nq,nk,rows",
    [(1, 8192, 1), (16, 8192, 16), (2048, 2048, 256), (256, 256, None), (1024, 1024, None)],
    ids=["decode-1", "decode-16", "rows-256", "gradients", "gradients-32-segments"],
)
def test_the_gated_oracle_count_holds_its_peak(name, nq, nk, rows):
    """The count was the softmax's (a float64 score per checked row and key): gla's closed form held
    float64 gates for every key per query head and blocks of 256 MiB, 17-26x that count at 1-16 rows
    (ssd 5-6x, the delta rules 3-4x); the loop's graph kept a state per key, and now one per
    checkpointed segment. The count now holds the peak, and is not so high that it skips checks that
    fit."""
    w = Workload(batch=1, heads=8, kv_heads=2, nq=nq, nk=nk, head_dim=64, v_head_dim=64, causal=True)
    peak, count = _gated_peak(name, w, rows)
    assert peak <= count <= 4 * peak, (peak / 2**20, count / 2**20)
