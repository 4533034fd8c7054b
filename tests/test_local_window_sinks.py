"""``local_window``'s ``sink_tokens`` (StreamingLLM's attention sinks, Xiao et al., 2023) against a
float64 oracle written here from the definition, not from the variant's ``pattern()``.

The query at position ``p = i + Nk - Nq`` sees key ``j`` iff ``|p - j| <= window`` or ``j <
sink_tokens``, and ``j <= p`` when causal; key padding on top; a key both in the band and among the
sinks is one term of the softmax. Checked for every implementation that runs on the CPU (``sdpa``,
``blocked``, and ``flex`` run eagerly: its wiring; the compiled kernel under ``pytest -m cuda``),
causal and not, with key padding, grouped K/V heads, decoding far past the sinks, and sinks that
overlap the band; gradients; that the knob changes the output; that decoding reads only the sinks
and the window (the rest of the cache poisoned with NaN); ``cache_len``.
"""

from __future__ import annotations

import pytest
import torch

import variants
from variants import Unsupported, oracle
from variants.local_window import LocalWindowAttention

from .helpers import NO_CUDA, rel_err

IMPLS = ["sdpa", "blocked", "flex"]  # flex: eager on the CPU (compiled: test_compiled_flex_on_cuda)


def _visible(nq: int, nk: int, window: int, sink_tokens: int, causal: bool) -> torch.Tensor:
    """Boolean ``(Nq, Nk)`` from the definition, pair by pair."""
    rows = []
    for i in range(nq):
        p = i + nk - nq  # bottom-right: the queries are the last Nq positions
        row = []
        for j in range(nk):
            seen = abs(p - j) <= window or j < sink_tokens  # one boolean: a key is never counted twice
            row.append(seen and (j <= p or not causal))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def _oracle(q, k, v, *, window, sink_tokens, causal, key_padding_mask=None):  # noqa: ANN001, ANN202
    """Float64 softmax attention over :func:`_visible` and the key padding; rows that see no key give
    zeros. ``k``, ``v`` may have fewer heads than ``q`` (each serves ``H / Hkv`` query heads)."""
    b, h, nq, d = q.shape
    nk = k.shape[2]
    group = h // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)  # (B, H, Nk, D): query head h reads h // group
    v64 = v.double().repeat_interleave(group, dim=1)  # (B, H, Nk, Dv)
    allowed = _visible(nq, nk, window, sink_tokens, causal).to(q.device)[None, None]  # (1, 1, Nq, Nk)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]  # (B, 1, Nq, Nk)
    scores = (q.double() @ k64.transpose(-2, -1)) * d**-0.5  # (B, H, Nq, Nk)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    weights = torch.where(allowed.any(-1, keepdim=True), weights, torch.zeros((), dtype=torch.float64))
    return weights @ v64  # (B, H, Nq, Dv)


def _inputs(b, h, hkv, nq, nk, d=8, dv=6, seed=0, requires_grad=False):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, nk, dv, generator=g, dtype=torch.float64)
    return tuple(t.float().requires_grad_(requires_grad) for t in (q, k, v))


def _padding(b: int, nk: int) -> torch.Tensor:
    """``(B, Nk)``: batch element 0 has a padded sink key (key 1) and a hole in the middle; the last
    ends in 5 padded keys."""
    kpm = torch.ones(b, nk, dtype=torch.bool)
    kpm[0, 1] = False
    kpm[0, nk // 2] = False
    kpm[-1, nk - 5 :] = False
    return kpm


def _build(impl: str, **knobs: object) -> LocalWindowAttention:
    attn = LocalWindowAttention(impl=impl, **knobs)
    attn._flex.compile = False  # flex on the CPU: eager (the wiring, not the compiler; a few ms)
    return attn


# (nq, nk, window, block, sink_tokens): each with and without causal masking, padding, GQA
SHAPES = [
    pytest.param(37, 37, 5, 8, 4, id="self-attention"),
    pytest.param(12, 12, 3, 4, 6, id="sinks-overlap-the-band"),  # p < window + sink_tokens
    pytest.param(20, 20, 0, 4, 3, id="window-0"),
    pytest.param(9, 9, 2, 4, 40, id="more-sinks-than-keys"),
    pytest.param(1, 200, 8, None, 4, id="decode-1"),  # the sinks far outside the window
    pytest.param(3, 200, 8, None, 4, id="decode-3"),
    pytest.param(20, 200, 8, 8, 4, id="prefill-onto-cache"),  # more queries than a block: the spans path
    pytest.param(4, 14, 8, None, 4, id="decode-sinks-reach-the-band"),  # lo <= sink_tokens: no cut
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True], ids=["both-ways", "causal"])
@pytest.mark.parametrize("nq, nk, window, block, sink_tokens", SHAPES)
def test_every_impl_matches_the_oracle(impl, causal, nq, nk, window, block, sink_tokens):
    attn = _build(impl, window=window, block=block, sink_tokens=sink_tokens)
    q, k, v = _inputs(2, 4, 2, nq, nk)  # grouped heads: 2 K/V heads for 4 query heads
    kpm = _padding(2, nk)
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    assert attn.describe()["impl_ran"] == impl
    want = _oracle(q, k, v, window=window, sink_tokens=sink_tokens, causal=causal, key_padding_mask=kpm)
    assert rel_err(out, want) <= 1e-5
    # and the registry's oracle, built from pattern(), agrees with the one written here
    assert rel_err(oracle(attn, q, k, v, causal=causal, key_padding_mask=kpm), want) <= 1e-12


@pytest.mark.parametrize("impl", ["sdpa", "blocked"])
@pytest.mark.parametrize("nq, nk", [(24, 24), (5, 40)], ids=["self-attention", "prefill-onto-cache"])
def test_gradients_match_the_oracle(impl, nq, nk):
    attn = _build(impl, window=3, block=4, sink_tokens=3)
    q, k, v = _inputs(2, 4, 2, nq, nk, requires_grad=True)
    kpm = _padding(2, nk)
    out = attn(q, k, v, causal=True, key_padding_mask=kpm)
    want = _oracle(q, k, v, window=3, sink_tokens=3, causal=True, key_padding_mask=kpm)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g.float())
    ref = torch.autograd.grad(want, (q, k, v), g)
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) <= 1e-4


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nq", [1, 20])
def test_the_sinks_change_the_output(impl, nq):
    # a no-op knob fails here: the sinks lie outside every query's band, so they add keys
    q, k, v = _inputs(1, 2, 2, nq, 64)
    plain = _build(impl, window=4, block=8)(q, k, v, causal=True)
    sunk = _build(impl, window=4, block=8, sink_tokens=4)(q, k, v, causal=True)
    assert rel_err(sunk, plain) > 1e-2
    # and sink_tokens=0 is the plain band (the same code path)
    zero = _build(impl, window=4, block=8, sink_tokens=0)(q, k, v, causal=True)
    assert torch.equal(zero, plain)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nq", [1, 3, 20])
def test_decoding_reads_only_the_sinks_and_the_window(impl, nq):
    # keys 4 .. Nk - Nq - window - 1 are out of every query's reach: NaN there must not reach the output
    nk, window, s = 200, 8, 4
    attn = _build(impl, window=window, block=8, sink_tokens=s)
    q, k, v = _inputs(2, 4, 2, nq, nk)
    want = _oracle(q, k, v, window=window, sink_tokens=s, causal=True)
    lo = nk - nq - window  # the first key of the first query's band
    kp, vp = k.clone(), v.clone()
    kp[:, :, s:lo] = float("nan")
    vp[:, :, s:lo] = float("nan")
    out = attn(q, kp, vp, causal=True)
    assert torch.isfinite(out).all()
    assert rel_err(out, want) <= 1e-5
    # StreamingLLM's rolling cache: only the sinks and the last keys kept gives the same rows
    keep = torch.cat([torch.arange(s), torch.arange(lo, nk)])  # (s + Nk - lo,)
    assert len(keep) == attn.cache_len(nk - nq) + nq
    rolled = attn(q, k[:, :, keep], v[:, :, keep], causal=True)
    assert rel_err(rolled, want) <= 1e-5


def test_cache_len_counts_the_sinks_and_the_window():
    attn = LocalWindowAttention(window=8, sink_tokens=4)
    assert [attn.cache_len(n) for n in (1, 5, 12, 13, 200, 10**6)] == [1, 5, 12, 12, 12, 12]
    assert LocalWindowAttention(window=8).cache_len(200) == 8  # as without the knob
    assert LocalWindowAttention(window=0, sink_tokens=2).cache_len(200) == 2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "nq, nk, window, s", [(24, 24, 3, 2), (12, 12, 3, 6), (1, 200, 8, 4), (6, 11, 2, 3), (9, 9, 0, 40)]
)
def test_pattern_and_num_pairs_follow_the_definition(nq, nk, window, s, causal):
    attn = LocalWindowAttention(window=window, sink_tokens=s)
    want = _visible(nq, nk, window, s, causal)
    assert torch.equal(attn.pattern(nq, nk, causal), want)
    assert attn.num_pairs(nq, nk, causal) == int(want.sum())


def test_a_narrower_call_window_keeps_the_sinks():
    attn = _build("sdpa", window=6, block=4, sink_tokens=3)
    q, k, v = _inputs(2, 4, 2, 30, 30)
    out = attn(q, k, v, causal=True, window=2)
    assert attn._narrower[2].sink_tokens == 3
    assert rel_err(out, _oracle(q, k, v, window=2, sink_tokens=3, causal=True)) <= 1e-5
    assert rel_err(out, oracle(attn, q, k, v, causal=True, window=2)) <= 1e-5


def test_knobs_validation_and_the_other_sinks():
    attn = LocalWindowAttention(window=8, sink_tokens=4)
    assert attn.knobs()["sink_tokens"] == 4
    assert variants.build("local_window", window=8, sink_tokens=4).sink_tokens == 4
    with pytest.raises(ValueError, match="sink_tokens must be >= 0"):
        LocalWindowAttention(sink_tokens=-1)
    # the forward argument sinks= (learned sink logits) is another feature, still refused
    q, k, v = _inputs(1, 2, 2, 8, 8)
    with pytest.raises(Unsupported, match="sinks"):
        attn(q, k, v, sinks=torch.zeros(2))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("nq, nk", [(256, 256), (1, 1024), (64, 1024)])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_flex_on_cuda(nq, nk, causal):
    # the compiled Triton kernel with band OR sinks as its block mask (tiles of 128)
    attn = LocalWindowAttention(window=32, sink_tokens=4, impl="flex")
    q, k, v = (t.cuda() for t in _inputs(2, 4, 2, nq, nk, d=64, dv=64))
    kpm = _padding(2, nk).cuda()
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    assert attn.describe()["impl_ran"] == "flex"
    want = _oracle(q, k, v, window=32, sink_tokens=4, causal=causal, key_padding_mask=kpm)
    assert rel_err(out, want) <= 1e-5
