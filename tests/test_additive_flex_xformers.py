"""What the registry-wide tests don't cover for additive, flex and the MultiHeadAttention layer
(xformers: tests/test_xformers.py).

Oracles here are independent of the code under test: the naive float64 additive form, the pattern
read back from the output of the FlexAttention kernel (``flex``, and ``local_window`` / ``sparse``
with ``impl=flex``), and ``torch.nn.MultiheadAttention``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import variants
from variants import Unsupported, flex_kernel, oracle
from variants.additive import AdditiveAttention
from variants.flex import FlexAttention
from variants.multihead import MultiHeadAttention

from .helpers import CASES, Case, make_inputs, rel_err

ROOT = Path(__file__).resolve().parent.parent


def _masks(b, h, nq, nk, *, padding=False, mask=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    kpm = None
    if padding:
        kpm = torch.ones(b, nk, dtype=torch.bool)
        kpm[-1, nk - 3 :] = False
        kpm[0, 1] = False
    am = torch.rand(b, h, nq, nk, generator=g) > 0.3 if mask else None
    return kpm, am


# ------------------------------------------------------------------------------------------ additive
ADDITIVE_CASES = [
    Case("causal_padding", b=2, h=2, nq=11, nk=11, d=4, dv=3, causal=True, padding=True),
    Case("attn_mask", b=2, h=2, nq=11, nk=11, d=4, dv=3, mask=True),
    Case("cross_padding", b=2, h=2, nq=7, nk=13, d=4, dv=5, padding=True),
]


@pytest.mark.parametrize("case", ADDITIVE_CASES, ids=lambda c: c.id)
def test_additive_chunk_sizes_all_match_the_naive_oracle(case):
    q, k, v, kw = make_inputs(case, dtype=torch.float64)
    torch.manual_seed(1)
    ref = None
    for chunk in [1, 3, 4, case.nq, case.nq + 5, None]:
        torch.manual_seed(1)  # same parameters for every chunk size
        attn = AdditiveAttention(heads=case.h, head_dim=case.d, hidden=6, chunk=chunk).double()
        if ref is None:
            ref = oracle(attn, q, k, v, **kw).detach()  # naive (B,H,Nq,Nk,hidden) form
        out = attn(q, k, v, **kw)
        assert out.shape == (case.b, case.h, case.nq, case.dv)
        assert rel_err(out.detach(), ref) <= 1e-12, f"chunk={chunk}"


@pytest.mark.parametrize("chunk", [1, 4, None])
def test_additive_parameter_gradients_match_the_oracle(chunk):
    case = ADDITIVE_CASES[0]
    q, k, v, kw = make_inputs(case, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(2)
    attn = AdditiveAttention(heads=case.h, head_dim=case.d, hidden=5, chunk=chunk).double()
    g = torch.randn(case.b, case.h, case.nq, case.dv, dtype=torch.float64)
    wrt = [q, k, v, attn.w_q, attn.w_k, attn.w]
    got = torch.autograd.grad(attn(q, k, v, **kw), wrt, g)
    want = torch.autograd.grad(oracle(attn, q, k, v, **kw), wrt, g)
    for name, gg, ww in zip(["q", "k", "v", "w_q", "w_k", "w"], got, want, strict=True):
        assert rel_err(gg, ww) <= 1e-10, name
        assert gg.abs().sum() > 0, f"{name}: gradient is identically zero"


@pytest.mark.parametrize("nq, hidden", [(1024, 64), (1000, 64), (4096, 16), (100, 64), (7, 3)])
def test_additive_automatic_chunk_is_a_quarter_of_a_score_tensor(nq, hidden):
    attn = AdditiveAttention(heads=1, head_dim=2, hidden=hidden)
    c = attn.query_chunk(nq)
    assert c >= 1
    # one chunk's (B,H,c,Nk,hidden) holds at most a quarter of (B,H,Nq,Nk)'s elements (or c is 1)
    assert c == 1 or c * hidden <= nq / 4
    assert (c + 1) * hidden > nq / 4  # and it is the largest such chunk
    assert AdditiveAttention(heads=1, head_dim=2, hidden=hidden, chunk=5).query_chunk(nq) == 5
    # short sequences: the chunk may grow to MIN_CHUNK_ELEMS elements, never past Nq
    from variants.additive import MIN_CHUNK_ELEMS

    row = 8 * 256 * hidden  # B=1, H=8, Nk=256
    big = attn.query_chunk(nq, row)
    assert big == max(c, min(MIN_CHUNK_ELEMS // row, nq // (2 * hidden)), 1)
    assert big == 1 or big * hidden <= nq / 2  # at most half a score tensor


def test_additive_peak_memory_stays_below_four_score_tensors():
    from experiments.measure.memory import cpu_peak_bytes

    # the automatic chunk gives about 4 * hidden chunks at any N: a small hidden keeps this quick
    b, h, n, d = 1, 4, 256, 16
    torch.manual_seed(0)
    attn = AdditiveAttention(heads=h, head_dim=d, hidden=8)
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    score = b * h * n * n * 4  # one (B,H,N,N) fp32 tensor

    def fwd():
        with torch.no_grad():
            attn(q, k, v)

    def fwd_bwd():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        attn(qq, kk, vv).sum().backward()

    fwd(), fwd_bwd()  # warm-up: first calls allocate lazily initialised buffers
    assert cpu_peak_bytes(fwd) <= 4 * score
    assert cpu_peak_bytes(fwd_bwd) <= 4 * score


def _plain_additive(qp, kp, v, w, allowed):
    """The formula with autograd's own ops: tanh of the full (B,H,Nq,Nk,hid) sum, masked softmax."""
    t = torch.tanh(qp[:, :, :, None, :] + kp[:, :, None, :, :])  # (B, H, Nq, Nk, hid)
    scores = torch.einsum("bhqke,he->bhqk", t, w).masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked row: zeros, as the convention says
    return p @ v  # (B, H, Nq, Dv)


@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["exp_product", "sigmoid_fallback"])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_additive_function_gradients_against_float64_autograd(scale, step):
    from variants.additive import _AdditiveFunction, _Masks

    # causal, a padded key and a query row that sees no key; scale 30 puts |qp| past the exp-product
    # path's limit (20), so the add-then-sigmoid path is the one checked
    b, h, n, hid, dv = 2, 2, 7, 3, 2
    g = torch.Generator().manual_seed(4)
    qp, kp = (scale * torch.randn(b, h, n, hid, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
    w = torch.randn(h, hid, generator=g, dtype=torch.float64)
    kpm = torch.ones(b, n, dtype=torch.bool)
    kpm[1, 0] = False  # query 0 of batch 1 sees only key 0: an empty row under causal
    kpm[0, 4] = False
    masks = _Masks(True, kpm[:, None, None, :], None)
    assert (qp.abs().amax() > 20) == (scale > 1)
    args = [t.clone().requires_grad_() for t in (qp, kp, v, w)]

    def fn(*a):
        return _AdditiveFunction.apply(*a, masks, step)

    assert torch.autograd.gradcheck(fn, args, atol=1e-7)
    allowed = torch.ones(n, n, dtype=torch.bool).tril() & kpm[:, None, None, :]  # (B, 1, N, N)
    gout = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
    plain = [t.clone().requires_grad_() for t in (qp, kp, v, w)]
    want_out = _plain_additive(*plain, allowed)
    got_out = fn(*args)
    assert rel_err(got_out.detach(), want_out.detach()) <= 1e-12
    assert got_out[1, :, 0].abs().max() == 0  # the empty row
    got = torch.autograd.grad(got_out, args, gout)
    want = torch.autograd.grad(want_out, plain, gout)
    for name, gg, ww in zip(["qp", "kp", "v", "w"], got, want, strict=True):
        assert torch.isfinite(gg).all(), name
        assert rel_err(gg, ww) <= 1e-10, name


def test_additive_large_projections_take_the_sigmoid_path_and_match_the_oracle():
    # |W_q q| well past 20: the exp-product form would overflow, the fallback must still be exact
    case = ADDITIVE_CASES[0]
    q, k, v, kw = make_inputs(case, dtype=torch.float32, requires_grad=True)
    torch.manual_seed(3)
    attn = AdditiveAttention(heads=case.h, head_dim=case.d, hidden=6, chunk=4)
    with torch.no_grad():
        attn.w_q.mul_(40)
    out = attn(q, k, v, **kw)
    assert torch.isfinite(out).all()
    assert rel_err(out.detach(), oracle(attn, q, k, v, **kw)) <= 1e-5
    got = torch.autograd.grad(out, [q, k, v], torch.ones_like(out))
    want = torch.autograd.grad(
        oracle(attn, q, k, v, **kw), [q, k, v], torch.ones_like(out, dtype=torch.float64)
    )
    for gg, ww in zip(got, want, strict=True):
        assert rel_err(gg, ww) <= 1e-4


def test_additive_checks_heads_and_head_dim():
    attn = AdditiveAttention(heads=3, head_dim=8, hidden=4)
    q = torch.randn(1, 3, 5, 6)
    with pytest.raises(Unsupported, match="head_dim=8.*head size is 6"):
        attn(q, q, q)
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(Unsupported, match="heads=3.*2 heads"):
        attn(q, q, q)


def test_additive_initialisation_follows_the_global_seed():
    torch.manual_seed(5)
    a = AdditiveAttention(heads=2, head_dim=4, hidden=3)
    torch.manual_seed(5)
    b = AdditiveAttention(heads=2, head_dim=4, hidden=3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert variants.get("additive").has_params and len(list(a.parameters())) == 3


# ---------------------------------------------------------------------------------------------- flex
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(20, 20), (13, 13), (9, 17), (17, 9)])
def test_flex_pattern_is_every_pair(nq, nk, causal):
    if causal and nq > nk:
        pytest.skip("causal needs Nq <= Nk (bottom-right aligned)")
    full = FlexAttention(compile=False)
    want = torch.ones(nq, nk, dtype=torch.bool)
    want = want.tril(nk - nq) if causal else want
    assert torch.equal(full.pattern(nq, nk, causal), want)
    assert full.num_pairs(nq, nk, causal) == int(want.sum())
    assert full.exact


def _eager(name: str, **knobs) -> variants.AttentionVariant:
    """``name`` built with ``knobs``, its FlexAttention kernel run eagerly: this checks the wiring
    (pattern, tiles, masks), not the compiler."""
    attn = variants.build(name, **knobs)
    for kernel in ("_flex", "_flex_local", "_flex_fine"):  # sparse: without its global rows, 64-wide tiles
        if hasattr(attn, kernel):
            getattr(attn, kernel).compile = False
    return attn


@pytest.mark.parametrize(
    "name, knobs",
    [
        ("flex", {}),
        ("local_window", {"window": 2, "block": 4, "impl": "flex"}),
        ("sparse", {"block": 3, "impl": "flex"}),
    ],
    ids=["flex", "local_window", "sparse"],
)
@pytest.mark.parametrize(
    "nq, nk, causal, padding, mask", [(14, 14, True, True, False), (9, 14, False, True, True)]
)
def test_flex_output_reveals_exactly_its_pattern(name, knobs, nq, nk, causal, padding, mask):
    # q = 0 spreads each row uniformly over the keys it may see; v = identity reads those keys back
    b, h = 2, 2
    attn = _eager(name, **knobs)
    q = torch.zeros(b, h, nq, 4)
    k = torch.randn(b, h, nk, 4)
    v = torch.eye(nk).expand(b, h, nk, nk).contiguous()  # (B, H, Nk, Dv=Nk)
    kpm, am = _masks(b, h, nq, nk, padding=padding, mask=mask and attn.supports_attn_mask)
    out = attn(q, k, v, causal=causal, key_padding_mask=kpm, attn_mask=am)
    want = attn.pattern(nq, nk, causal)[None, None]
    if kpm is not None:
        want = want & kpm[:, None, None, :]
    if am is not None:
        want = want & am
    assert torch.equal(out > 1e-6, want.expand_as(out))
    assert torch.isfinite(out).all()


def test_flex_block_masks_are_cached_and_follow_in_place_edits():
    case = CASES[3]  # causal + padding
    attn = FlexAttention(block=8, compile=False)
    q, k, v, kw = make_inputs(case)
    attn(q, k, v, **kw)
    attn(q, k, v, **kw)
    assert len(attn._flex._masks) == 1  # built once for the same shape and mask
    kw["key_padding_mask"][0, :6] = False  # in place: the cached block list would be stale
    out = attn(q, k, v, **kw)
    assert len(attn._flex._masks) == 2
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5


@pytest.mark.parametrize("causal,padding", [(False, False), (True, True)])
def test_flex_sparse_blocks_inside_larger_tiles_keep_their_exact_pattern(monkeypatch, causal, padding):
    # on CUDA a sparse layout of 64-blocks runs in 128-wide tiles; the same arrangement at CPU sizes
    # (8-blocks in 32-wide tiles) must compute exactly the 8-block pattern, partial tiles included
    monkeypatch.setattr(flex_kernel, "tile_size", lambda block, device, cuda_tile=128, n=None: 32)
    case = Case("tiles", b=2, h=2, nq=100, nk=100, d=8, dv=8, causal=causal, padding=padding)
    attn = _eager("sparse", block=8, impl="flex")
    q, k, v, kw = make_inputs(case)
    out = attn(q, k, v, **kw)
    assert attn.describe()["tile"] == 32
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5
    assert not attn.pattern(100, 100, causal).all()  # a real sparse pattern, not full attention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq", [96, 90], ids=["self", "prefill_onto_cache"])  # 90: 2 global rows left
def test_flex_sparse_leaves_its_global_rows_to_one_dense_call(monkeypatch, causal, nq):
    # in the block mask the global rows' tile row would walk every key tile: apart, the kernel's walks
    # none, those rows come from a dense call, and the output is still the layout's (the oracle)
    monkeypatch.setattr(flex_kernel, "tile_size", lambda block, device, cuda_tile=128, n=None: 8)
    n, block = 96, 8
    layout = dict(block=block, window_blocks=1, global_blocks=1, random_blocks=1, impl="flex")
    attn = _eager("sparse", **layout)
    q, k, v, kw = make_inputs(Case("g", b=2, h=2, nq=nq, nk=n, d=8, dv=8, causal=causal, padding=True))
    attn(q, k, v, **kw)
    assert attn.describe()["global_rows"] == "block mask"  # auto on the CPU: no tail to remove
    attn = _eager("sparse", **layout, global_rows="dense")  # as auto chooses with few heads on a GPU
    out = attn(q, k, v, **kw)
    assert attn.describe()["global_rows"] == "dense"
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5

    def visited(kernel):  # key tiles each query tile visits, partial and full
        bm = kernel.block_mask(q, k, causal, None, None)
        full = bm.full_kv_num_blocks[0, 0] if bm.full_kv_num_blocks is not None else 0
        return bm.kv_num_blocks[0, 0] + full

    if nq == n:
        tiles = visited(attn._flex_local)
        assert int(tiles[0]) == 0 and int(tiles.max()) <= 5  # global rows: none; others: 3 + global + random
        assert int(visited(attn._flex)[0]) == (1 if causal else n // block)  # what the dense call spares


def test_sparse_keeps_global_rows_apart_only_where_their_tile_row_is_the_tail():
    # the shapes timed (bf16 fwd+bwd, tiles 128, 132 SMs; the share of the 128 x 128 tiles the block
    # mask visits, from scripts/pattern_vs_flex.py). Side by side on one H100: N=16384 at B*H = 8 faster
    # with the rows apart (2.34 ms against 3.17), N=4096 slower (1.39 against 0.76: the tail is too
    # short to pay for the dense call). Across two cards only: B*H = 64 at N=16384 slower apart (H200
    # 5.5x dense SDPA, H100 in the block mask 6.9x), B*H = 8 at N=65536 faster (7.9x against 5.6x)
    from variants.sparse import MIN_TAIL_EXCESS_TILES, tail_excess

    def tail_bound(*shape):
        return tail_excess(*shape) >= MIN_TAIL_EXCESS_TILES

    assert tail_bound(8, 0.054 * 128 * 128, 128, 132)
    assert not tail_bound(64, 0.054 * 128 * 128, 128, 132)
    assert not tail_bound(8, 0.208 * 32 * 32, 32, 132)
    assert tail_bound(8, 0.014 * 512 * 512, 512, 132)


def test_global_rows_is_a_knob_of_the_flex_route_alone():
    with pytest.raises(ValueError, match="global_rows must be one of auto, dense, block_mask; got 'apart'"):
        variants.build("sparse", global_rows="apart")
    q = torch.randn(1, 2, 32, 8)
    for impl in (
        "kernel",
        "sdpa",
        "blocked",
    ):  # they compute the global rows their own way: said, not ignored
        attn = variants.build("sparse", block=8, impl=impl, global_rows="dense")
        with pytest.raises(
            Unsupported,
            match=f"global_rows=dense places the global rows of the flex route; this call runs impl={impl}",
        ):
            attn(q, q, q)
    assert variants.build("sparse", global_rows="block_mask").knobs()["global_rows"] == "block_mask"


def test_causal_sparse_keeps_its_global_rows_in_the_block_mask():
    # causal, the global rows see only their own first tile: nothing to spare, whatever the tail rule
    # says of the whole key range (checked before the device, so a CUDA device object suffices here)
    from types import SimpleNamespace

    attn = variants.build("sparse", block=64, impl="flex")
    on_gpu = SimpleNamespace(device=torch.device("cuda"), shape=(1, 8, 16384, 64))
    assert attn._global_rows_apart(on_gpu, on_gpu, causal=True) is False


def test_flex_tiles_on_cuda_and_block_sizes_the_gpu_kernel_cannot_take():
    w = variants.Workload(1, 2, 256, 256, 64, 64, device="cuda", dtype=torch.float16)  # check(): no GPU
    assert flex_kernel.tile_size(64, "cuda") == 128
    assert flex_kernel.tile_size(256, "cuda") == 256
    assert flex_kernel.tile_size(64, "cpu") == 64
    # the CPU tiles compiled flex gets wrong: under 16, and past a short call's length
    assert flex_kernel.tile_size(8, "cpu") == 16
    assert flex_kernel.tile_size(128, "cpu", n=40) == 32 and flex_kernel.tile_size(128, "cpu", n=100) == 64
    assert flex_kernel.tile_size(64, "cpu", n=8) == 16 and flex_kernel.tile_size(64, "cpu", n=4096) == 64
    variants.build("sparse", block=64, impl="flex").check(w)
    variants.build("local_window", block=96, impl="flex").check(w)  # the band does not depend on the tile
    variants.build("flex", block=96).check(w)  # nor does full attention
    with pytest.raises(Unsupported, match="block=96"):
        variants.build("sparse", block=96, impl="flex").check(w)


def test_a_smaller_cuda_tile_fits_the_layout_and_autotunes_its_kernel(monkeypatch):
    # cuda_tile=64: a 64-block layout fills whole tiles on CUDA; inductor's default Hopper configs do
    # not divide a 64 tile, so that kernel alone is compiled with max_autotune (its 64-wide candidates)
    assert flex_kernel.tile_size(64, "cuda", 64) == 64
    assert flex_kernel.tile_size(32, "cuda", 64) == 64
    assert flex_kernel.tile_size(192, "cuda", 64) == 64  # the layout in whole 64 tiles, as asked
    assert flex_kernel.tile_size(256, "cuda") == 256  # the default keeps a multiple of 128 as its tile
    w = variants.Workload(1, 2, 256, 256, 64, 64, device="cuda", dtype=torch.float16)
    assert flex_kernel.flex_refusal(w, layout_block=96, cuda_tile=64) is not None
    assert flex_kernel.flex_refusal(w, layout_block=32, cuda_tile=64) is None
    assert flex_kernel.flex_refusal(w, layout_block=192, cuda_tile=64) is None
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    small = flex_kernel.FlexKernel(None, 64, cuda_tile=64)
    assert small.autotune_for("cuda") and not small.autotune_for("cpu")
    assert not flex_kernel.FlexKernel(None, 64).autotune_for("cuda")  # 128 tiles: the defaults divide them
    assert flex_kernel.FlexKernel(None, 128, cuda_tile=64).autotune_for("cuda")  # a 128 block in 64 tiles
    small._flex_fn("cuda", on_cache=False)
    small._flex_fn("cpu", on_cache=False)
    small._flex_fn("cuda", on_cache=True)  # a decoding call: its own kernel, shapes free to change
    assert [kw["options"] for kw in compiled] == [{"max_autotune": True}, None, {"max_autotune": True}]
    assert [kw["dynamic"] for kw in compiled] == [False, False, None]
    with pytest.raises(ValueError, match="sparse cuda_tile must be auto or one of 64, 128; got 32"):
        variants.build("sparse", cuda_tile=32)  # no forward configuration is narrower than 64
    with pytest.raises(ValueError, match="cuda_tile must be one of 64, 128; got 48"):
        flex_kernel.FlexKernel(None, 64, cuda_tile=48)


@pytest.mark.parametrize(
    "excess, knobs, kernel, rows",
    [
        (74, {}, "_flex_fine", "block mask"),  # auto: 64-wide tiles, the rows in the mask
        (74, {"global_rows": "block_mask"}, "_flex_fine", "block mask"),
        (74, {"global_rows": "dense"}, "_flex_local", "dense"),  # the knob keeps 128 tiles, dense call
        (74, {"cuda_tile": 128}, "_flex_local", "dense"),  # 128 tiles: the rows apart
        (74, {"cuda_tile": 64}, "_flex", "block mask"),  # 64 tiles chosen: the rows stay in the mask
        (74, {"block": 128}, "_flex_local", "dense"),  # a block of 128: 128 tiles, the rows apart
        (74, {"block": 32}, "_flex_local", "dense"),  # 32: 64 tiles would be partial (not measured)
        (19, {}, "_flex_fine", "block mask"),  # a short tail (N=4096 at B*H=8): still 64 tiles
        (19, {"cuda_tile": 128}, "_flex", "block mask"),  # too short to pay for the dense call
        (-300, {}, "_flex", "block mask"),  # no tail (many batch-heads): 128 tiles, as timed
    ],
)
def test_sparse_routes_a_call_by_its_tail_tile_and_rows(monkeypatch, excess, knobs, kernel, rows):
    # by how much the global tile row would be the 128 kernel's tail (faked: on the CPU there is none),
    # each route computes the layout exactly; which one ran is said in the record
    layout = {
        "block": 64,
        "window_blocks": 1,
        "global_blocks": 1,
        "random_blocks": 1,
        "impl": "flex",
        **knobs,
    }
    attn = _eager("sparse", **layout)
    monkeypatch.setattr(attn, "_tail_excess", lambda q, k, causal: excess)
    monkeypatch.setattr(flex_kernel, "tile_size", lambda block, device, cuda_tile=128, n=None: block)
    n = 6 * layout["block"]
    q, k, v, kw = make_inputs(Case("tail", b=1, h=2, nq=n, nk=n, d=8, dv=8, padding=True))
    with torch.no_grad():
        out = attn._flex_attend(q, k, v, causal=False, key_padding_mask=kw.get("key_padding_mask"))
    assert attn.flex_ran is getattr(attn, kernel)
    assert attn.global_rows_ran == rows
    attn.impl_ran = "flex"
    assert attn.describe()["global_rows"] == rows
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5


def test_the_tail_rule_reads_the_128_wide_block_mask(monkeypatch):
    # auto's choice of 64 tiles rests on the tail of the 128-wide kernel: its block mask is the one read
    from types import SimpleNamespace

    attn = variants.build("sparse", block=64, impl="flex")
    n, tile = 16384, 128
    rows = n // tile
    per_row = torch.full((1, 1, rows), 5, dtype=torch.int32)  # a handful of key tiles per tile row
    per_row[0, 0, 0] = rows  # the global tile row walks them all
    built = []

    def mask(kernel):
        def block_mask(q, k, causal, kpm, am):
            built.append(kernel)
            return SimpleNamespace(kv_num_blocks=per_row, full_kv_num_blocks=None, BLOCK_SIZE=(tile, tile))

        return block_mask

    for name in ("_flex", "_flex_fine", "_flex_local"):
        monkeypatch.setattr(getattr(attn, name), "block_mask", mask(name))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132)
    )
    q = SimpleNamespace(device=torch.device("cuda"), shape=(1, 8, n, 64))
    assert attn._tail_excess(q, q, causal=False) == pytest.approx(128 - 8 * 763 / 132)  # 46 per SM
    assert built == ["_flex"]
    q = SimpleNamespace(device=torch.device("cuda"), shape=(32, 16, n, 64))
    assert attn._tail_excess(q, q, causal=False) < 0  # 512 batch-heads: the load, not the row, is long


def test_sparse_cuda_tile_is_refused_where_no_cuda_flex_kernel_runs():
    attn = variants.build("sparse", block=64, cuda_tile=64)
    assert attn.knobs()["cuda_tile"] == 64
    attn.check(variants.Workload(1, 2, 256, 256, 64, 64, device="cuda", dtype=torch.float16))
    q = torch.randn(1, 2, 128, 8)
    with pytest.raises(Unsupported, match="cuda_tile=64 sets the tile of FlexAttention's CUDA kernel"):
        attn(q, q, q)  # the CPU: the tile is the layout's block there, nothing to set
    cuda = variants.Workload(1, 2, 256, 256, 64, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(Unsupported, match="runs impl=sdpa on cuda"):
        variants.build("sparse", block=64, impl="sdpa", cuda_tile=64).check(cuda)


def test_flex_refuses_float64_and_cpu_backward():
    attn = FlexAttention(compile=False)
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    with pytest.raises(Unsupported, match="float64"):
        attn(q, q, q)
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with pytest.raises(Unsupported, match="backward"):
        attn(q, q, q)
    assert FlexAttention.compiled


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor
def test_flex_kernel_compiled_matches_the_oracle():
    # the one compiled run (the band, as the pattern gates run it): ~5 s with a warm inductor cache,
    # ~30 s cold on this machine (< 60 s)
    case = Case("compiled", b=2, h=2, nq=40, nk=40, d=16, dv=16, causal=True, padding=True)
    attn = variants.build("local_window", window=5, block=16, impl="flex")
    q, k, v, kw = make_inputs(case)
    kw["key_padding_mask"][0] = False  # batch element 0 sees no key at all
    out = attn(q, k, v, **kw)
    assert attn.describe()["impl_ran"] == "flex"
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5
    again = attn(q, k, v, **kw)  # cached block mask and kernel
    assert torch.equal(out, again)


@pytest.mark.parametrize("block,tile", [(8, 16), (128, 32)])
def test_compiled_flex_on_the_cpu_runs_only_tiles_it_computes_right(block, tile):
    """Asked for a tile of 8, or for one past a 40-token call, compiled flex (torch 2.13) gave NaN or
    errors of 2-4 against the oracle; it now runs 16 and 32 there, and says so."""
    case = Case("compiled", b=2, h=2, nq=40, nk=40, d=16, dv=16, causal=False)
    attn = variants.build("local_window", window=4, block=block, impl="flex")
    q, k, v, kw = make_inputs(case)
    out = attn(q, k, v, **kw)
    assert attn.describe()["impl_ran"] == "flex" and attn.describe()["tile"] == tile
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5


def test_a_decoding_call_keeps_its_key_tile():
    """One query against 512 keys: the tile once followed the shorter side, so the keys were walked
    in tiles of 16 (309 ms against 131 with 128 at Nk = 65536 on this project's VM). The key tile
    follows the keys (128), the query tile the one query, and the output is the oracle's."""
    case = Case("decode", b=1, h=4, nq=1, nk=512, d=16, dv=16, causal=True, hkv=2)
    attn = variants.build("flex", block=128)
    q, k, v, kw = make_inputs(case)
    out = attn(q, k, v, **kw)
    assert attn.describe()["tile"] == 128
    assert attn._flex.tiles(q, k) == (16, 128)
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5


def test_a_decoding_loop_compiles_twice_not_once_per_token(monkeypatch):
    """A model decoding through compiled flex: every token's call has one key more, and flex was
    compiled with static shapes, so every step compiled a kernel, and past Dynamo's limit of 8 ran
    eagerly (198 ms per token in the llama store, against sdpa's 8). The loop now compiles a kernel
    for its first shape and one for any cache length, and every step's output is the oracle's. A
    step's one query sees every key, so its block mask is whole tiles, built without evaluating the
    causal predicate on every pair (3 ms a step at 1k keys, four times the kernel's time)."""
    from torch.nn.attention import flex_attention as fa

    def no_predicate(*args, **kwargs):
        raise AssertionError("a decoding step evaluated a predicate on every pair")

    monkeypatch.setattr(fa, "create_block_mask", no_predicate)
    torch._dynamo.reset()  # this test counts the compiled kernels: none from an earlier test
    attn = variants.build("flex")
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, 2, 80, 16, generator=g)
    for nk in range(64, 74):  # a cache of nk keys, one query: copies, as a model's cache concatenates
        q = torch.randn(1, 4, 1, 16, generator=g)
        kc, vc = k[:, :, :nk].clone(), v[:, :, :nk].clone()
        out = attn(q, kc, vc, causal=True)
        assert rel_err(out, oracle(attn, q, kc, vc, causal=True)) <= 1e-5, nk
    code = flex_kernel._flex_on_a_cache.__code__
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) == 2


@pytest.mark.parametrize("nq", [1, 72])
def test_compiled_flex_on_the_cpu_computes_every_pair_right_at_head_size_16(nq):
    """With no pattern, causality or mask, flex handed FlexAttention no block mask, and compiled on the
    CPU its own (128-wide tiles) gave an error of 0.37 for one query on 72 keys at head size 16, and
    NaN for 72 on 72. A mask of whole tiles of the kernel's own size is right; uncompiled calls, and
    CUDA's, still get None."""
    attn = FlexAttention()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, nq, 16, generator=g), *torch.randn(2, 1, 2, 72, 16, generator=g)
    assert rel_err(attn(q, k, v), oracle(attn, q, k, v)) <= 1e-5
    assert attn._flex.tiles(q, k) == (16 if nq == 1 else 64, 64)
    plain = FlexAttention(compile=False)._flex
    assert plain.block_mask(q, k, False, None, None) is None
    assert (plain.block_mask(q, k, True, None, None) is None) == (nq == 1)  # one causal query sees all


# ---------------------------------------------------------------------------------------- multihead
def _torch_mha(mine: MultiHeadAttention) -> nn.MultiheadAttention:
    e, kv = mine.embed_dim, mine.kv_dim
    ref = nn.MultiheadAttention(
        e, mine.heads, bias=True, batch_first=True, kdim=kv, vdim=kv, dtype=torch.float64
    )
    with torch.no_grad():
        if ref._qkv_same_embed_dim:
            ref.in_proj_weight.copy_(torch.cat([mine.q_proj.weight, mine.k_proj.weight, mine.v_proj.weight]))
        else:
            ref.q_proj_weight.copy_(mine.q_proj.weight)
            ref.k_proj_weight.copy_(mine.k_proj.weight)
            ref.v_proj_weight.copy_(mine.v_proj.weight)
        ref.in_proj_bias.copy_(torch.cat([mine.q_proj.bias, mine.k_proj.bias, mine.v_proj.bias]))
        ref.out_proj.weight.copy_(mine.out_proj.weight)
        ref.out_proj.bias.copy_(mine.out_proj.bias)
    return ref


@pytest.mark.parametrize(
    "nq, nk, kv_dim, causal, padding, mask",
    [
        (10, 10, None, False, False, False),
        (10, 10, None, True, False, False),
        (10, 10, None, False, True, False),
        (10, 10, None, True, True, True),
        (7, 12, 6, False, True, True),
    ],
    ids=["plain", "causal", "padding", "causal_padding_mask", "cross"],
)
def test_multihead_matches_torch_multiheadattention(nq, nk, kv_dim, causal, padding, mask):
    b, e, h = 2, 12, 3
    torch.manual_seed(0)
    mine = MultiHeadAttention(e, h, variant="naive", kv_dim=kv_dim).double()
    with torch.no_grad():  # non-zero biases, so a mix-up of q/k/v biases would show
        for lin in (mine.q_proj, mine.k_proj, mine.v_proj, mine.out_proj):
            lin.bias.normal_()
    ref = _torch_mha(mine)
    x_q = torch.randn(b, nq, e, dtype=torch.float64)
    x_kv = x_q if kv_dim is None and nq == nk else torch.randn(b, nk, kv_dim or e, dtype=torch.float64)
    kpm, am = _masks(b, 1, nq, nk, padding=padding, mask=mask)
    am = None if am is None else am[:, 0]  # (B, Nq, Nk): the same mask for every head
    if am is not None:
        am[:, :, 0] = True  # every row sees a key: torch's layer would give NaN otherwise
    ours = mine(
        x_q,
        None if x_kv is x_q else x_kv,
        causal=causal,
        key_padding_mask=kpm,
        attn_mask=None if am is None else am[:, None],  # (B, 1, Nq, Nk)
    )
    t_am = am  # torch's layer takes causal as part of attn_mask
    if causal:
        tri = torch.ones(nq, nk, dtype=torch.bool).tril()
        t_am = tri.expand(b, nq, nk) if t_am is None else t_am & tri
    # torch's layer: True = masked out (the opposite convention), attn_mask (B*H, Nq, Nk)
    t_am = None if t_am is None else (~t_am).repeat_interleave(h, dim=0)
    t_kpm = None if kpm is None else ~kpm
    want, _ = ref(x_q, x_kv, x_kv, key_padding_mask=t_kpm, attn_mask=t_am, need_weights=False)
    assert ours.shape == (b, nq, e)
    assert rel_err(ours, want) <= 1e-12


def test_multihead_uses_any_variant_and_trains_its_parameters():
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, variant="additive", hidden=8)
    assert isinstance(layer.core, AdditiveAttention) and layer.core.head_dim == 4
    names = {n for n, _ in layer.named_parameters()}
    assert {"core.w_q", "core.w_k", "core.w", "q_proj.weight", "out_proj.bias"} <= names
    x = torch.randn(2, 9, 16)
    layer(x, causal=True).sum().backward()
    assert all(p.grad is not None for p in layer.parameters())
    prebuilt = variants.build("chunked", query_chunk=3, key_chunk=4)
    assert MultiHeadAttention(16, 4, variant=prebuilt).core is prebuilt
    with pytest.raises(TypeError):
        MultiHeadAttention(16, 4, variant=prebuilt, window=3)
    with pytest.raises(ValueError, match="multiple of heads"):
        MultiHeadAttention(10, 4)
