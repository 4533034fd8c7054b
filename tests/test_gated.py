"""The gated and delta-rule recurrences (ssd, gla, deltanet, gated_deltanet) beyond the registry-wide
tests (which check every form, chunk 1, 5 and 64, against the float64 token-by-token reference,
gradients included, and the decoding state): flash-linear-attention's pure-PyTorch references as a
second oracle (skipped with the reason where fla-core is not installed), what a padded key means,
and the numerics of strong decays."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import variants

GATED = ("ssd", "gla", "deltanet", "gated_deltanet")


def _qkv(b=2, h=3, n=40, d=8, dv=6, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, e, generator=g, dtype=dtype) for e in (d, d, dv))


def _build(name, h=3, d=8, **knobs):
    torch.manual_seed(0)
    return variants.build(name, heads=h, head_dim=d, **knobs)


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("name", GATED)
def test_a_padded_key_is_a_token_that_is_not_there(name):
    attn = _build(name, chunk=4)
    q, k, v = _qkv(b=1, n=20)
    drop = 9
    keep = [i for i in range(20) if i != drop]
    kpm = torch.ones(1, 20, dtype=torch.bool)
    kpm[0, drop] = False
    padded = attn(q, k, v, causal=True, key_padding_mask=kpm)
    without = attn(q[:, :, keep], k[:, :, keep], v[:, :, keep], causal=True)
    # the other positions' outputs are those of the sequence without it: no write, no decay
    assert _rel(padded[:, :, keep], without) < 1e-5


@pytest.mark.parametrize("name", GATED)
def test_strong_decays_and_long_chunks_stay_finite(name):
    attn = _build(name, chunk=64)
    with torch.no_grad():
        for p in attn.parameters():  # gates at their extremes: decays of e^-1 (gla's floor) and far below
            p.mul_(20.0)
    q, k, v = (10 * x for x in _qkv(b=1, n=300))
    out = attn(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    ref = variants.oracle(attn, q[:, :, -50:], k, v, causal=True)
    assert _rel(out[:, :, -50:], ref) < 1e-4


def test_gla_refuses_a_chunk_its_split_cannot_hold():
    with pytest.raises(ValueError, match="chunk in 1..64"):
        variants.build("gla", chunk=128)


def test_each_has_the_parameters_its_docstring_counts():
    h, d = 3, 8
    counts = {
        "ssd": h * (d + 2),
        "gla": h * (2 * d * 16 + d),
        "deltanet": h * (d + 1),
        "gated_deltanet": h * (2 * d + 3),
    }
    for name, want in counts.items():
        assert sum(p.numel() for p in _build(name, h, d).parameters()) == want, name


# ---------------------------------------------------------------------------------- fla as a second oracle
# only the tests that read fla skip without it (the others are this module's own checks)
needs_fla = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None, reason="fla-core is not installed (pip install -e '.[dev]')"
)


def _bthd(x):
    return x.transpose(1, 2).contiguous()  # (B, H, N, D) -> fla's (B, N, H, D)


@needs_fla
def test_ssd_is_flas_simple_gla():
    from fla.ops.simple_gla.naive import naive_chunk_simple_gla, naive_recurrent_simple_gla

    attn = _build("ssd", chunk=8)
    q, k, v = _qkv(n=50)
    with torch.no_grad():
        ours = attn(q, k, v, causal=True)
        g = attn._gates(k)[0]  # (B, H, N)
        for f in (naive_chunk_simple_gla, naive_recurrent_simple_gla):
            theirs = f(_bthd(q), _bthd(k), _bthd(v), g.transpose(1, 2).contiguous())[0].transpose(1, 2)
            assert _rel(ours, theirs) < 1e-5, f.__name__


@needs_fla
def test_gla_is_flas_recurrent_gla():
    from fla.ops.gla.naive import naive_recurrent_gla

    attn = _build("gla", chunk=8)
    q, k, v = _qkv(n=50)
    with torch.no_grad():
        ours = attn(q, k, v, causal=True)
        g = attn._gates(k)[0]  # (B, H, N, D)
        theirs = naive_recurrent_gla(_bthd(q), _bthd(k), _bthd(v), _bthd(g))[0].transpose(1, 2)
    assert _rel(ours, theirs) < 1e-5


@needs_fla
@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_the_delta_rules_are_flas(name):
    from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

    attn = _build(name, chunk=8)
    q, k, v = _qkv(n=64)
    with torch.no_grad():
        ours = attn(q, k, v, causal=True)
        g, beta = attn._gates(k)
        g = torch.zeros_like(beta) if g is None else g
        kn = torch.nn.functional.normalize(k, dim=-1, eps=1e-6)
        args = (_bthd(q), _bthd(kn), _bthd(v))
        rec = naive_recurrent_gated_delta_rule(*args, beta.transpose(1, 2), g.transpose(1, 2))[0]
        chunk = naive_chunk_gated_delta_rule(*args, g.transpose(1, 2), beta.transpose(1, 2), chunk_size=16)[0]
    assert _rel(ours, rec.transpose(1, 2)) < 1e-5
    assert _rel(ours, chunk.transpose(1, 2)) < 1e-5


@pytest.mark.parametrize("vector", [False, True])
def test_the_oracles_closed_form_is_its_recurrence(vector):
    """The float64 oracle answers few queries in closed form (decoding against a long context): the
    same numbers as its token-by-token recurrence, with padded keys, bottom-right queries and decays
    strong enough that a float32 difference of cumulative decays would show."""
    from variants.gated_reference import gated_dense_reference, gated_loop_reference

    q, k, v = _qkv(b=2, h=3, n=70, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    shape = (2, 3, 70, 8) if vector else (2, 3, 70)
    per_head = torch.tensor([0.01, 3.0, 30.0], dtype=torch.float64)  # weak, strong, very strong decays
    g = -torch.rand(shape, generator=gen, dtype=torch.float64) * per_head.view(1, 3, *[1] * (len(shape) - 2))
    kpm = torch.rand(2, 70, generator=gen) > 0.2
    for nq in (1, 5, 70):
        loop = gated_loop_reference(q[:, :, -nq:], k, v, g, None, kpm, 0.3, False)
        dense = gated_dense_reference(q[:, :, -nq:], k, v, log_decay=g, key_padding_mask=kpm, scale=0.3)
        small = gated_dense_reference(
            q[:, :, -nq:], k, v, log_decay=g, key_padding_mask=kpm, scale=0.3, block_bytes=1
        )  # one key per block: the blocking changes nothing
        assert _rel(dense, loop) < 1e-12, nq
        assert _rel(small, loop) < 1e-12, nq


@pytest.mark.parametrize("name", GATED)
def test_a_long_context_taken_a_segment_at_a_time_is_the_same_state(name, monkeypatch):
    """A context longer than a segment (8192 positions; 7 here) is taken segment by segment, the
    state carried across: the last queries' outputs and the prefilled state's next step are the
    float64 oracle's, with padded keys on both sides of a segment boundary."""
    import variants.gated_core as core

    monkeypatch.setattr(core, "SEGMENT", 7)
    attn = _build(name, chunk=3)
    q, k, v = _qkv(b=2, n=40)
    kpm = torch.ones(2, 40, dtype=torch.bool)
    kpm[1, [6, 7, 20]] = False
    with torch.no_grad():
        last = attn(q[:, :, -4:], k, v, causal=True, key_padding_mask=kpm)
        ref = variants.oracle(attn, q, k, v, causal=True, key_padding_mask=kpm)[:, :, -4:]
        state = attn.prefill(k[:, :, :39], v[:, :, :39], key_padding_mask=kpm[:, :39], heads=3)
        step, _ = attn.step(q[:, :, 39:], k[:, :, 39:], v[:, :, 39:], state)
    assert _rel(last, ref) < 1e-5
    assert _rel(step, ref[:, :, -1:]) < 1e-5


@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("nq,nk", [(1, 9000), (40, 300), (100, 100), (5, 70)])
def test_flops_are_the_matmuls_the_forward_runs(name, nq, nk):
    """flops() against torch's count of the forward's matmuls, plus the delta rule's triangular
    solves (which the counter does not see: ``n c (Dk + Dv)`` per chunked pass, as written here).
    With fewer queries than keys the keys before them only leave a state (no scores, no reads): the
    record counted them as queries, 2.3-4x the work at a decoding step."""
    from torch.utils.flop_counter import FlopCounterMode

    b, h, d = 1, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(b, h, nq, d, generator=g), *(torch.randn(b, h, nk, d, generator=g) for _ in "kv")
    attn = variants.build(name, heads=h, head_dim=d)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        attn(q, k, v, causal=True)
    solves = 0
    if attn.delta:  # the queries' pass, then the context's passes of at most 8192 positions
        for n in [nq, *(min(8192, nk - nq - a) for a in range(0, nk - nq, 8192))]:
            c = min(attn.chunk, n)
            solves += -(-n // c) * c * c * 2 * d * b * h
    w = variants.Workload(batch=b, heads=h, nq=nq, nk=nk, head_dim=d, v_head_dim=d, causal=True)
    assert 1.0 <= attn.flops(w) / (counter.get_total_flops() + solves) <= 1.08  # + gates, norms, decays


@pytest.mark.parametrize("name", GATED)
def test_the_oracle_refuses_what_a_recurrence_has_no_form_for(name):
    """One ``oracle_forward`` for the four (their gates apart): a non-causal call or an attn_mask is
    refused in one line naming the variant, never computed as the causal recurrence."""
    attn = _build(name)
    q, k, v = _qkv(dtype=torch.float64)
    with pytest.raises(variants.Unsupported, match=f"^{name} is a causal recurrence"):
        attn.oracle_forward(q, k, v, causal=False)
    with pytest.raises(variants.Unsupported, match=f"^{name} is a causal recurrence"):
        attn.oracle_forward(q, k, v, attn_mask=torch.ones(40, 40, dtype=torch.bool))
