"""linear, retention and performer beyond the registry-wide tests: their formulas against independent
computations (flash-linear-attention's references where installed, a recurrence written here), the
structure of the causal form (no N x N tensor, no future key), padding, the refusals with reasons,
performer's convergence to softmax and its numerical stability, and their FLOPs."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import variants
from variants import Unsupported, Workload, oracle
from variants.retention import decay_rates

from .helpers import Case, make_inputs, rel_err

FLA = importlib.util.find_spec("fla") is not None
NO_FLA = "fla-core is not installed (pip install fla-core==0.6.0 triton packaging numpy)"
FAMILY = [
    ("linear", {"chunk": 8}),
    ("linear", {"feature_map": "relu", "chunk": 8}),
    ("retention", {"chunk": 8}),
    ("performer", {"features": 32, "chunk": 8}),
]


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ------------------------------------------------------------------ flash-linear-attention's references
@pytest.mark.skipif(not FLA, reason=NO_FLA)
def test_linear_identity_unnormalised_is_fla_linear_attention():
    from fla.ops.linear_attn.naive import naive_chunk_linear_attn, naive_recurrent_linear_attn

    attn = variants.build("linear", feature_map="identity", normalize=False, chunk=16)
    for n, scale in [(50, None), (128, 0.3)]:
        q, k, v = (_randn(2, 3, n, 8, seed=s, dtype=torch.float32) for s in range(3))
        ours = attn(q, k, v, causal=True, scale=scale)  # (B, H, N, Dv)
        # fla's layout is (B, T, H, D)
        fla_q, fla_k, fla_v = (x.transpose(1, 2) for x in (q, k, v))
        rec, _ = naive_recurrent_linear_attn(fla_q, fla_k, fla_v, scale=scale)
        assert rel_err(ours, rec.transpose(1, 2)) <= 1e-5
        if n % 64 == 0:  # fla's chunked reference needs whole 64-token chunks
            chunk = naive_chunk_linear_attn(fla_q, fla_k, fla_v, scale=scale)
            assert rel_err(ours, chunk.transpose(1, 2)) <= 1e-5


@pytest.mark.skipif(not FLA, reason=NO_FLA)
def test_retention_is_fla_naive_retention():
    from fla.ops.retention.naive import naive_retention

    q, k, v = (_randn(2, 4, 40, 8, seed=s, dtype=torch.float32) for s in range(3))
    want = naive_retention(q, k, v)  # (B, H, N, D), RetNet's gamma_h per head
    for chunk in (1, 7, 64):
        assert rel_err(variants.build("retention", chunk=chunk)(q, k, v, causal=True), want) <= 1e-5


# ------------------------------------------------------------------ retention's forms
def test_retention_parallel_chunked_recurrent_and_step_agree_with_a_recurrence():
    b, h, n, d, dv = 2, 3, 30, 5, 4
    q, k, v = _randn(b, h, n, d, seed=0), _randn(b, h, n, d, seed=1), _randn(b, h, n, dv, seed=2)
    # the recurrence written here: S_t = gamma S_{t-1} + k_t v_t^T, o_t = s q_t S_t
    gamma = 1 - 2.0 ** (-5.0 - torch.arange(h, dtype=torch.float64))
    assert torch.allclose(torch.exp(-decay_rates(h)), gamma, rtol=0, atol=1e-15)
    state = torch.zeros(b, h, d, dv, dtype=torch.float64)
    rows = []
    for t in range(n):
        state = gamma[None, :, None, None] * state + k[:, :, t, :, None] * v[:, :, t, None, :]
        rows.append(d**-0.5 * (q[:, :, t, None, :] @ state)[:, :, 0])
    want = torch.stack(rows, 2)  # (B, H, N, Dv)
    assert rel_err(oracle(variants.build("retention"), q, k, v, causal=True), want) <= 1e-12
    for chunk in (n, 7, 1):  # parallel, chunked, recurrent
        got = variants.build("retention", chunk=chunk)(q, k, v, causal=True)
        assert rel_err(got, want) <= 1e-12, chunk
    attn, st, outs = variants.build("retention"), None, []
    for t in range(n):
        out, st = attn.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], st)
        outs.append(out)
    assert rel_err(torch.cat(outs, 2), want) <= 1e-12


def test_retention_decay_stays_accurate_far_into_a_sequence():
    # at position 20000 the absolute log decay is 20000 * 0.03: the core must not lose it to float32
    attn = variants.build("retention", chunk=64)
    _, k, v, _ = make_inputs(Case("ctx", b=1, h=2, nq=20000, nk=20000, d=4, dv=4))
    state = attn.prefill(k, v)
    q1, k1, v1 = (_randn(1, 2, 1, 4, seed=s, dtype=torch.float32) for s in (7, 8, 9))
    out, _ = attn.step(q1, k1, v1, state)
    kk, vv = torch.cat([k, k1], 2)[:, :, -2000:], torch.cat([v, v1], 2)[:, :, -2000:]
    # gamma_1^2000 = (1 - 1/64)^2000 < 1e-13: the last 2000 keys carry the answer
    want = oracle(attn, q1, kk, vv, causal=True)
    assert rel_err(out, want) <= 1e-4


# ------------------------------------------------------------------ the causal form's structure
class _LargestTensor(TorchDispatchMode):
    """Records the most elements any operator's output had."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("vp", FAMILY, ids=lambda p: p[0] + str(p[1]))
def test_causal_form_never_holds_an_n_by_n_tensor(vp):
    name, knobs = vp
    n = 512
    q, k, v = (_randn(1, 2, n, 8, seed=s, dtype=torch.float32).requires_grad_() for s in range(3))
    attn = variants.build(name, **knobs)
    with _LargestTensor() as spy:
        attn(q, k, v, causal=True).sum().backward()
    # the chunk's (c, c) blocks, the features and the states before each chunk: all O(N), far below
    # the (B, H, N, N) scores
    assert spy.most < 2 * n * n // 8, f"{name}: an operator produced {spy.most} elements"


@pytest.mark.parametrize("vp", FAMILY, ids=lambda p: p[0] + str(p[1]))
def test_padded_keys_are_in_no_sum_and_queries_that_see_none_give_zeros(vp):
    name, knobs = vp
    attn = variants.build(name, **knobs)
    case = Case("pad", b=2, h=2, nq=20, nk=20, d=6, dv=5)
    q, k, v, _ = make_inputs(case)
    kpm = torch.ones(2, 20, dtype=torch.bool)
    kpm[0, :4] = False  # left padding: causal queries 0-3 of sequence 0 see no key
    kpm[1, 11:15] = False
    k2, v2 = k.clone(), v.clone()
    k2[~kpm[:, None, :].expand(2, 2, 20)] = 7.0  # whatever the padded keys and values hold
    v2[~kpm[:, None, :].expand(2, 2, 20)] = -1e4
    for causal in (True, False) if type(attn).supports_noncausal else (True,):
        out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
        assert torch.equal(out, attn(q, k2, v2, causal=causal, key_padding_mask=kpm)) or (
            rel_err(out, attn(q, k2, v2, causal=causal, key_padding_mask=kpm)) <= 1e-6
        )
        if causal:
            assert torch.equal(out[0, :, :4], torch.zeros_like(out[0, :, :4]))


@pytest.mark.parametrize("vp", FAMILY, ids=lambda p: p[0] + str(p[1]))
def test_refusals_say_why(vp):
    name, knobs = vp
    attn = variants.build(name, **knobs)
    q = _randn(1, 2, 8, 4, dtype=torch.float32)
    with pytest.raises(Unsupported, match="never forms the"):
        attn(q, q, q, causal=True, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(Unsupported, match="never forms the"):
        attn(q, q, q, causal=True, bias=torch.zeros(8, 8))
    if name == "retention":
        with pytest.raises(Unsupported, match="causal only"):
            attn(q, q, q)
        with pytest.raises(Unsupported, match="causal only"):
            attn(q[:, :, :4], q, q)  # decoding-shaped, but not causal


# ------------------------------------------------------------------ performer
def test_performer_deviation_from_softmax_falls_as_features_grow():
    """The records' deviation from full attention (mean absolute error, ``output_accuracy``) falls about
    as 1/sqrt(m). With q, k entries of 0.5: FAVOR+'s variance grows as exp(|x + y|^2), and at unit
    entries a few draws of 4 do not show the fall cleanly at every step (it still falls overall)."""
    from experiments.measure.accuracy import output_accuracy

    q, k, v = (_randn(2, 4, 64, 16, seed=s) * f for s, f in ((0, 0.5), (1, 0.5), (2, 1.0)))
    errors = []
    for m in (8, 32, 128, 512):
        errs = []
        for seed in range(4):
            attn = variants.build("performer", features=m, seed=seed)
            errs.append(output_accuracy(attn, q, k, v, attn(q, k, v), {})["dev_full_mean_err"])
        errors.append(sum(errs) / len(errs))
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < errors[0] / 3, errors  # 64x the features: 1/8 of the error in theory


def test_performer_draw_is_fixed_by_its_seed_and_orthogonal():
    a, b, c = (variants.build("performer", features=40, seed=s) for s in (3, 3, 4))
    w = a.projection(16)
    assert w.shape == (40, 16) and torch.equal(w, b.projection(16)) and not torch.equal(w, c.projection(16))
    block = w[:16] / w[:16].norm(dim=1, keepdim=True)  # the first 16 rows: one orthogonal block
    assert torch.allclose(block @ block.T, torch.eye(16, dtype=torch.float64), atol=1e-12)


def test_performer_casts_its_draw_once_per_device_and_dtype(monkeypatch):
    # a forward that copied the float64 host draw every call could not be captured in a CUDA graph
    # (H100, 2026-11-26: "Cannot copy between CPU and CUDA tensors during CUDA graph capture")
    attn = variants.build("performer", features=16)
    q = torch.randn(1, 2, 24, 8)
    first = attn(q, q, q)
    casts = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **kw: casts.append(t.dtype) or real_to(t, *a, **kw))
    again = attn(q, q, q)
    assert torch.float64 not in casts  # the cached float32 draw was used
    assert torch.equal(first, again)
    attn(q.double(), q.double(), q.double())
    assert set(attn._cast) == {(8, q.device, torch.float32), (8, q.device, torch.float64)}
    fresh = variants.build("performer", features=16)
    with torch.inference_mode():  # a first call that builds no graph must not poison the cache
        fresh(q, q, q)
    x = q.clone().requires_grad_()
    fresh(x, x, x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_performer_is_stable_with_large_inputs_and_in_16_bits(dtype):
    # |q|, |k| entries of 10 (scores of hundreds): unstabilised features would overflow
    q, k, v = (_randn(1, 2, 40, 16, seed=s) * (10.0 if s < 2 else 1.0) for s in range(3))
    attn = variants.build("performer", features=64, chunk=8)
    for causal in (False, True):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = attn(*x, causal=causal)
        assert torch.isfinite(out).all(), (dtype, causal)
        out.float().square().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in x), (dtype, causal)
        if dtype == torch.float32:  # against the float64 formula (which does not overflow there)
            assert rel_err(out, oracle(attn, *x, causal=causal)) <= 1e-3
    state = attn.prefill(k[:, :, :30].to(dtype), v[:, :, :30].to(dtype))
    out, _ = attn.step(q[:, :, 30:31].to(dtype), k[:, :, 30:31].to(dtype), v[:, :, 30:31].to(dtype), state)
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------ FLOPs and the state's size
@pytest.mark.parametrize("causal", [False, True])
def test_linear_flops_are_its_matmuls_and_linear_in_n(causal):
    attn = variants.build("linear", feature_map="identity", normalize=False, chunk=32)
    n, d = 256, 16
    q, k, v = (_randn(2, 4, n, d, seed=s, dtype=torch.float32) for s in range(3))
    with FlopCounterMode(display=False) as counter:
        attn(q, k, v, causal=causal)
    w = Workload(batch=2, heads=4, nq=n, nk=n, head_dim=d, v_head_dim=d, causal=causal)
    # the counter sees the matmuls; flops() adds the scale on q (and, causal, the carry's sums)
    assert 0.9 * attn.flops(w) <= counter.get_total_flops() <= attn.flops(w)
    big = Workload(batch=2, heads=4, nq=64 * n, nk=64 * n, head_dim=d, v_head_dim=d, causal=causal)
    assert attn.flops(big) == pytest.approx(64 * attn.flops(w), rel=0.01)  # linear in N, not pairs


@pytest.mark.parametrize("nq, nk", [(16, 256), (33, 97), (64, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_linear_flops_under_grouped_heads_count_the_keys_state_once_per_kv_head(causal, nq, nk):
    """8 query heads on 2 K/V heads, 16 queries after 240 earlier keys (a decode's shape), 33
    queries (padded to 5 chunks of 8) after 64, and 64 after none (training): the keys' chunk states
    and the keys that only build the state are summed per K/V head. The counter sees the matmuls;
    the count must hold them (within the scale and the carry, <= 10%) and be below the count with
    repeated heads (by half for the long context, by a fifth for training, causal)."""
    attn = variants.build("linear", feature_map="identity", normalize=False, chunk=8)
    d = 16
    q = _randn(2, 8, nq, d, seed=0, dtype=torch.float32)
    k, v = (_randn(2, 2, nk, d, seed=s, dtype=torch.float32) for s in (1, 2))
    with FlopCounterMode(display=False) as counter:
        attn(q, k, v, causal=causal)
    w = Workload(batch=2, heads=8, kv_heads=2, nq=nq, nk=nk, head_dim=d, v_head_dim=d, causal=causal)
    assert 0.9 * attn.flops(w) <= counter.get_total_flops() <= attn.flops(w)
    repeated = Workload(batch=2, heads=8, nq=nq, nk=nk, head_dim=d, v_head_dim=d, causal=causal)
    if nk == 256:
        assert attn.flops(w) < 0.5 * attn.flops(repeated)  # the 240 (256) keys' sums were 4x as many
    if nq == nk and causal:  # each chunk's state once per K/V head: 2 of 5 products a query head had
        assert attn.flops(w) < 0.8 * attn.flops(repeated)


@pytest.mark.parametrize("name", ["linear", "performer", "window_linear"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
def test_causal_training_under_grouped_heads_keeps_one_chunk_state_per_kv_head(name, backward):
    """32 query heads on 4 K/V heads, N=1024 (training, Nq = Nk): the chunk states, key features and
    values are the K/V heads' own, so the call takes at least a tenth less memory than the same call
    on K and V repeated to the 32 heads (the profiler's count, inputs allocated before it; repeating
    them inside the call, as before, took as much or more: 1.00-1.14x)."""
    from experiments.measure.memory import cpu_peak_bytes
    from variants.base import repeat_kv

    attn = variants.build(name)
    q = _randn(1, 32, 1024, 64, seed=0, dtype=torch.float32)
    k, v = (_randn(1, 4, 1024, 64, seed=s, dtype=torch.float32) for s in (1, 2))

    def peak(kk: torch.Tensor, vv: torch.Tensor) -> int:
        x = [t.clone().requires_grad_(backward) for t in (q, kk, vv)]

        def call() -> None:
            with torch.set_grad_enabled(backward):
                out = attn(*x, causal=True)
                if backward:
                    out.sum().backward()

        return cpu_peak_bytes(call)

    grouped, repeated = peak(k, v), peak(repeat_kv(k, 32).contiguous(), repeat_kv(v, 32).contiguous())
    assert grouped <= 0.9 * repeated, (grouped / 2**20, repeated / 2**20)


def test_state_bytes_of_the_family():
    w = Workload(batch=1, heads=8, nq=1, nk=131072, head_dim=64, v_head_dim=64, causal=True)
    assert variants.build("linear").state_bytes(w) == 8 * 64 * 65 * 4  # D x (Dv + 1) fp32 per head
    assert variants.build("linear", normalize=False).state_bytes(w) == 8 * 64 * 64 * 4
    assert variants.build("retention").state_bytes(w) == 8 * (64 * 64 * 4 + 8)  # + its float64 position
    assert variants.build("performer").state_bytes(w) == 8 * (256 * 65 * 4 + 4)  # m x (Dv + 1) + max
    assert variants.build("sdpa").state_bytes(w) == 8 * 131072 * 128 * 4  # the K/V cache: 512 MiB


def test_grouped_heads_share_one_state_where_the_key_features_are_the_keys_alone():
    """32 query heads on 4 K/V heads: linear's, performer's and window_linear's key features and log
    weights are the key's alone, so a group's query heads read one state (as they read one K/V cache);
    retention's decay is per query head, so it keeps 32. Counted from the definitions, then held."""
    w = Workload(batch=1, heads=32, kv_heads=4, nq=1, nk=4096, head_dim=16, v_head_dim=16, causal=True)
    want = {
        "linear": 4 * 16 * 17 * 4,  # D x (Dv + 1) fp32 per K/V head
        "performer": 4 * (256 * 17 * 4 + 4),  # m x (Dv + 1) and the running maximum per K/V head
        "window_linear": 4 * 64 * 32 * 4 + 64 + 4 * 16 * 17 * 4,  # window cache, its mask, linear state
        "retention": 32 * (16 * 16 * 4 + 8),  # per query head: each has its decay
    }
    torch.manual_seed(0)
    k, v = torch.randn(2, 4, 100, 16), torch.randn(2, 4, 100, 16)
    for name, size in want.items():
        attn = variants.build(name)
        assert attn.state_bytes(w) == size, name
        state = attn.prefill(k, v, heads=32)
        kv = state.far_kv if name == "window_linear" else state.kv
        assert kv.shape[:2] == (2, 32 if name == "retention" else 4), name


@pytest.mark.parametrize("path", ["cpu loop", "cumsum"])
def test_the_segmented_sum_over_chunks_restarts_where_a_document_begins(path):
    """The chunks' prefix sum that packed documents restart (the CPU's loop and the cumsum form other
    devices take), in value and gradient, against a float64 sum written here: out[t] sums x[u..t-1]
    from the last chunk u < t where a document begins (keep 0), or from the first."""
    from variants.linear_core import _segmented_sum_by_cumsum, _SegmentedExclusiveSum

    g, n = 3, 9
    keep = (torch.rand(g, n, generator=torch.Generator().manual_seed(0)) > 0.4).double()
    x = torch.randn(g, n, 4, 5, dtype=torch.float64, requires_grad=True)
    want = torch.zeros(g, n, 4, 5, dtype=torch.float64)
    for i in range(g):
        for t in range(1, n):
            u = max([s for s in range(t) if keep[i, s] == 0], default=0)
            want[i, t] = x[i, u:t].detach().sum(0)
    run = (
        (lambda a: _SegmentedExclusiveSum.apply(a, keep))
        if path == "cpu loop"
        else (lambda a: _segmented_sum_by_cumsum(a, keep))
    )
    torch.testing.assert_close(run(x), want)
    assert torch.autograd.gradcheck(run, (x,))
    assert (want - x.detach().cumsum(1).roll(1, 1)).abs().max() > 0.1  # the restarts matter


def test_the_cumsum_form_keeps_a_late_short_document_to_float32_rounding():
    """The cumsum form took a short document late in a long packed row as the difference of two large
    float32 sums: 1000x further from the document alone than the CPU's loop at 128k tokens."""
    from variants.linear_core import _segmented_sum_by_cumsum

    g, n = 2, 4096  # chunk states of a long packed row; the last document is its last 3 chunks
    x = torch.rand(g, n, 8, generator=torch.Generator().manual_seed(1)) + 1.0  # (G, n, F), all positive
    keep = torch.ones(g, n)
    keep[:, n - 4] = 0  # a document begins inside chunk n - 4: the sums after it start there
    got = _segmented_sum_by_cumsum(x, keep)[:, -1]  # x[n - 4] + x[n - 3] + x[n - 2]
    want = x[:, n - 4 : n - 1].double().sum(1)
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6
