"""The low-rank variants, ``nystrom`` and ``linformer``, beyond the registry-wide tests: their float64
oracles (``variants/reference.py``) on padding, grouped heads and scale, the Nystrom approximation
reproducing full attention at ``landmarks >= N``, the refusals with their reasons, gradients, FLOPs,
and agreement with lucidrains' ``nystrom-attention`` and ``linformer`` (skipped where not installed).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import variants
from variants import Unsupported, full_attention_reference, oracle
from variants.nystrom import iterative_pinv, segment_layout

from .helpers import Case, make_inputs, rel_err, workload

PADDED = Case("padding", padding=True)
MQA_PADDED = Case("mqa_padding", h=4, hkv=1, padding=True, dv=6, scale=0.3)
NYSTROM_KNOBS = [{"landmarks": 4}, {"landmarks": 7}, {"landmarks": 24}, {"landmarks": 64, "pinv_iters": 2}]
LINFORMER_KNOBS = [{"proj_len": 8, "max_len": 24}, {"proj_len": 40, "max_len": 100}]


def _build(name: str, knobs: dict) -> variants.AttentionVariant:
    torch.manual_seed(1)
    return variants.build(name, **knobs)


@pytest.mark.parametrize("case", [PADDED, MQA_PADDED], ids=lambda c: c.id)
@pytest.mark.parametrize(
    "name, knobs",
    [("nystrom", k) for k in NYSTROM_KNOBS] + [("linformer", k) for k in LINFORMER_KNOBS],
    ids=str,
)
def test_float64_output_and_gradients_match_the_oracle(name, knobs, case):
    """Padding and grouped heads with a scale, forward and every gradient (the parameters' too): the
    registry-wide gradient tests see grouped heads only with causal, which these refuse."""
    attn = _build(name, knobs).double()
    q, k, v, kw = make_inputs(case, dtype=torch.float64, requires_grad=True)
    out, want = attn(q, k, v, **kw), oracle(attn, q, k, v, **kw)
    assert rel_err(out, want) <= 1e-12
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    inputs = [q, k, v, *attn.parameters()]
    got = torch.autograd.grad(out, inputs, g)
    ref = torch.autograd.grad(want, inputs, g)
    for a, b in zip(got, ref, strict=True):
        assert torch.isfinite(a).all() and rel_err(a, b) <= 1e-10


@pytest.mark.parametrize(
    "name, knobs", [("nystrom", {"landmarks": 5}), ("linformer", {"proj_len": 8, "max_len": 12})], ids=str
)
def test_gradcheck_float64_noncausal_with_padding(name, knobs):
    """The registry's gradcheck runs causal, which these refuse: here non-causal, padded, grouped."""
    attn = _build(name, knobs).double()
    case = Case("tiny", b=1, h=2, hkv=1, nq=10, nk=10, d=3, dv=2, padding=True)
    q, k, v, kw = make_inputs(case, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: attn(a, b, c, **kw), (q, k, v), atol=1e-6)


@pytest.mark.parametrize("landmarks", [24, 100])
@pytest.mark.parametrize("padding", [False, True])
def test_nystrom_with_a_landmark_per_token_is_full_softmax_attention(landmarks, padding):
    """``landmarks >= N``: F = A = B = softmax(Q K^T), so F A^+ B V is full attention once the
    iteration has converged (30 steps here; the paper's 6 are not enough at this conditioning)."""
    case = Case("p", padding=padding)
    q, k, v, kw = make_inputs(case, dtype=torch.float64)
    full = full_attention_reference(q, k, v, **kw)
    converged = variants.build("nystrom", landmarks=landmarks, pinv_iters=30)
    assert rel_err(converged(q, k, v, **kw), full) <= 1e-10
    six = variants.build("nystrom", landmarks=landmarks)
    assert rel_err(six(q, k, v, **kw), full) > 1e-6  # the default is an approximation even here


def test_nystrom_approximates_full_attention_better_with_more_landmarks():
    q, k, v, kw = make_inputs(Case("plain", nq=48, nk=48), dtype=torch.float64)
    full = full_attention_reference(q, k, v, **kw)
    errs = [
        rel_err(variants.build("nystrom", landmarks=m, pinv_iters=30)(q, k, v), full) for m in (6, 24, 48)
    ]
    assert errs[0] > errs[1] > errs[2] and errs[2] <= 1e-10, errs


def test_iterative_pinv_converges_to_the_moore_penrose_inverse():
    g = torch.Generator().manual_seed(0)
    a = torch.softmax(torch.randn(3, 8, 8, generator=g, dtype=torch.float64), -1)
    assert rel_err(iterative_pinv(a, 30), torch.linalg.pinv(a)) <= 1e-10
    assert torch.equal(iterative_pinv(torch.zeros(4, 4), 6), torch.zeros(4, 4))  # no landmark: zeros


@pytest.mark.parametrize(
    "n, landmarks, layout",
    [(24, 4, (6, 4)), (24, 5, (5, 5)), (24, 7, (4, 6)), (24, 64, (1, 24)), (1, 3, (1, 1))],
)
def test_nystrom_segments(n, landmarks, layout):
    """ceil(N / m) tokens a segment, as many segments as that takes (at most m): no empty segment."""
    assert segment_layout(n, landmarks) == layout


@pytest.mark.parametrize(
    "name, knobs", [("nystrom", {"landmarks": 4}), ("linformer", {"proj_len": 8, "max_len": 24})], ids=str
)
def test_padded_positions_reach_no_output(name, knobs):
    """Changing the padded keys and values (and, for nystrom, the padded queries, which would enter its
    query landmarks) changes no output row of a real query."""
    attn = _build(name, knobs)
    q, k, v, kw = make_inputs(PADDED)
    pad = ~kw["key_padding_mask"]  # (B, N)
    q2, k2, v2 = (t.masked_fill(pad[:, None, :, None], 7.0) for t in (q, k, v))
    out, out2 = attn(q, k, v, **kw), attn(q2, k2, v2, **kw)
    real = kw["key_padding_mask"]
    assert torch.allclose(out.transpose(1, 2)[real], out2.transpose(1, 2)[real], atol=1e-6)


@pytest.mark.parametrize("where", ["right", "left", "holes"])
def test_a_padded_nystrom_row_is_that_row_alone(where):
    """A row's segments follow its real tokens, not the padded length: the batch's padding (set by its
    longest row) used to regroup them, 0.11 off in cosine at 8 landmarks (a pretrained encoder)."""
    n, real_n = 40, 29
    q, k, v, _ = make_inputs(Case("p", b=1, h=2, hkv=1, nq=n, nk=n, d=8, dv=6), dtype=torch.float64)
    keep = {
        "right": torch.arange(n) < real_n,
        "left": torch.arange(n) >= n - real_n,
        "holes": torch.ones(n, dtype=torch.bool).index_fill(
            0, torch.tensor([0, 5, 6, 17, 20, 21, 33, 38, 39, 2, 11]), False
        ),
    }[where][None]  # (1, N)
    attn = variants.build("nystrom", landmarks=8)
    padded = attn(q, k, v, key_padding_mask=keep)  # (1, H, N, Dv)
    idx = keep[0].nonzero().flatten()
    alone = attn(q[:, :, idx], k[:, :, idx], v[:, :, idx])  # (1, H, real, Dv)
    torch.testing.assert_close(padded[:, :, idx], alone, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["nystrom", "linformer"])
def test_causal_is_refused_with_the_reason(name):
    attn = _build(name, {})
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(Unsupported, match="no causal form"):
        attn(q, q, q, causal=True)
    with pytest.raises(Unsupported, match="attn_mask"):
        attn(q, q, q, attn_mask=torch.ones(16, 16, dtype=torch.bool))


def test_nystrom_refuses_decoding_with_the_reason():
    attn = variants.build("nystrom")
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 16, 8)
    with pytest.raises(Unsupported, match="cannot decode.*query landmarks"):
        attn(q, k, k)
    with pytest.raises(Unsupported, match="cross-attention"):
        attn(k, q, q)


def test_linformer_refuses_a_length_above_max_len_and_takes_max_len():
    attn = _build("linformer", {"proj_len": 4, "max_len": 16})
    x = torch.randn(1, 2, 17, 8)
    with pytest.raises(Unsupported, match="max_len=16.*Nk=17"):
        attn(x, x, x)
    assert attn(x[:, :, :16], x[:, :, :16], x[:, :, :16]).shape == (1, 2, 16, 8)
    # only the key length is bounded: 17 queries read the projections of 16 keys
    assert attn(x, x[:, :, :16], x[:, :, :16]).shape == (1, 2, 17, 8)


def test_linformer_parameters_are_reproducible_per_layer():
    torch.manual_seed(5)
    first, second = (
        variants.build("linformer", proj_len=4, max_len=32),
        variants.build("linformer", proj_len=4, max_len=32),
    )
    torch.manual_seed(5)
    again = variants.build("linformer", proj_len=4, max_len=32)
    assert type(first).has_params and sum(p.numel() for p in first.parameters()) == 2 * 4 * 32
    assert torch.equal(first.e, again.e) and torch.equal(first.f, again.f)
    assert not torch.equal(first.e, second.e)  # two layers built in a row get their own draws
    assert not torch.equal(first.e, first.f)


def test_flops_count_each_algorithm_and_grow_linearly():
    nys = variants.build("nystrom", landmarks=8, pinv_iters=6)
    lin = variants.build("linformer", proj_len=16, max_len=1 << 16)
    w = workload(Case("w", b=1, h=2, hkv=1, nq=64, nk=64, d=4, dv=4))
    m, n, d = 8, 64, 4
    per_head = 4 * 2 * n * m * d + 2 * 2 * m * m * d + 8 * m**3 * 6 + n * d
    assert nys.flops(w) == per_head * 2 + n * d  # two query heads, one K/V head's landmark sums
    assert lin.flops(w) == 1 * 2 * 16 * n * 2 * d + 2 * 2 * n * 16 * 2 * d
    for attn in (nys, lin):
        big = workload(Case("w", b=1, h=8, nq=1 << 14, nk=1 << 14, d=64, dv=64))
        bigger = workload(Case("w", b=1, h=8, nq=1 << 15, nk=1 << 15, d=64, dv=64))
        assert 1.9 < attn.flops(bigger) / attn.flops(big) < 2.1


# ---------------------------------------------------------------------------------- peers (optional)
NO_NYSTROM = "lucidrains' nystrom-attention is not installed (pip install nystrom-attention)"
NO_LINFORMER = "lucidrains' linformer is not installed (pip install linformer)"


def _qkv_as_input(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(B, N, 3 H D)``: q, k and v side by side, heads flattened as the peers lay them out."""
    return torch.cat([t.transpose(1, 2).flatten(2) for t in (q, k, v)], -1)  # (B, H, N, D) -> (B, N, H D)


def _identity_out(linear: torch.nn.Linear, inner: int) -> None:
    """Make the peer's output projection ``(3 inner) x inner`` copy its input into the first columns."""
    with torch.no_grad():
        linear.weight.zero_()
        linear.weight[:inner] = torch.eye(inner, dtype=linear.weight.dtype)
        linear.bias.zero_()


@pytest.mark.skipif(importlib.util.find_spec("nystrom_attention") is None, reason=NO_NYSTROM)
@pytest.mark.parametrize("n, landmarks", [(32, 8), (33, 8), (24, 6)])
def test_nystrom_agrees_with_lucidrains_nystrom_attention(n, landmarks):
    """Its core on our q, k, v: identity projections in and out, no residual convolution, a mask of
    ones (without one it lets its own front padding into the softmax over keys). Ours runs the
    sequence padded by 3 tokens, theirs the real tokens alone: a padded row lays its segments out over
    its real tokens (theirs would over the padded length). One batch element and head: its
    pseudo-inverse takes one norm over the whole batch, ours one per matrix."""
    from nystrom_attention import NystromAttention

    b, h, d = 1, 1, 8
    q, k, v, _ = make_inputs(Case("p", b=b, h=h, nq=n, nk=n, d=d), dtype=torch.float64)
    kpm = torch.ones(b, n, dtype=torch.bool)
    kpm[:, -3:] = False  # their layout of the N - 3 real tokens has no segment of padding alone
    peer = NystromAttention(
        dim=3 * h * d, dim_head=d, heads=h, num_landmarks=landmarks, pinv_iterations=6, residual=False
    ).double()
    with torch.no_grad():
        peer.to_qkv.weight.copy_(torch.eye(3 * h * d))
    _identity_out(peer.to_out[0], h * d)
    alone = _qkv_as_input(q, k, v)[:, : n - 3]  # (B, N - 3, 3 H D): the real tokens
    theirs = peer(alone, mask=kpm[:, : n - 3])[..., : h * d]  # (B, N - 3, H D)
    ours = variants.build("nystrom", landmarks=landmarks)(q, k, v, key_padding_mask=kpm)
    ours = ours.transpose(1, 2).flatten(2)  # (B, H, N, Dv) -> (B, N, H Dv)
    assert rel_err(ours[kpm], theirs.flatten(0, 1)) <= 1e-10


@pytest.mark.skipif(importlib.util.find_spec("linformer") is None, reason=NO_LINFORMER)
@pytest.mark.parametrize("n", [24, 40])
def test_linformer_agrees_with_lucidrains_linformer(n):
    """Its ``LinformerSelfAttention`` with identity projections, our E and F as its ``proj_k`` and
    ``proj_v`` (its layout is ``(seq_len, k)``, ours ``(k, max_len)``), a shorter sequence than its
    ``seq_len`` (both cut the projections). It takes no padding mask."""
    from linformer import LinformerSelfAttention

    b, h, d, p, max_len = 2, 3, 8, 16, 40
    q, k, v, _ = make_inputs(Case("p", b=b, h=h, nq=n, nk=n, d=d), dtype=torch.float64)
    ours = _build("linformer", {"proj_len": p, "max_len": max_len}).double()
    peer = LinformerSelfAttention(dim=3 * h * d, seq_len=max_len, k=p, heads=h, dim_head=d).double()
    inner = h * d
    with torch.no_grad():
        for i, lin in enumerate((peer.to_q, peer.to_k, peer.to_v)):
            lin.weight.zero_()
            lin.weight[:, i * inner : (i + 1) * inner] = torch.eye(inner, dtype=torch.float64)
        peer.proj_k.copy_(ours.e.T)
        peer.proj_v.copy_(ours.f.T)
    _identity_out(peer.to_out, inner)
    theirs = peer(_qkv_as_input(q, k, v))[..., :inner]  # (B, N, H D)
    mine = ours(q, k, v).transpose(1, 2).flatten(2)  # (B, H, N, Dv) -> (B, N, H Dv)
    assert rel_err(mine, theirs) <= 1e-12
