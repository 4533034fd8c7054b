"""sparse's block-sparse C kernel (variants/sparse_kernel.c) against a float64 formula written here
from the kernel's contract (each query block sees the key blocks listed for it), through the variant
against its own layout, its fallback where it cannot be built or take a call, and its refusals with
``impl=kernel``."""

from __future__ import annotations

import pytest
import torch

import variants
from variants import Unavailable, Unsupported, Workload
from variants import sparse_kernel as sk

from .helpers import needs_c_compiler


def _masked_expected(q, k, v, allowed, kpm) -> torch.Tensor:
    """softmax over the ``allowed (Nq, Nk)`` keys and key padding in float64, query head ``h`` on K/V
    head ``h // (H / Hkv)``; a row with no allowed key is zero."""
    b, h, nq, d = q.shape
    allowed = allowed.expand(b, 1, nq, k.shape[2])
    if kpm is not None:
        allowed = allowed & kpm[:, None, None, :]  # (B, 1, Nq, Nk)
    kk = k.double().repeat_interleave(h // k.shape[1], dim=1)  # (B, H, Nk, D)
    vv = v.double().repeat_interleave(h // k.shape[1], dim=1)  # (B, H, Nk, Dv)
    s = (q.double() @ kk.transpose(-2, -1) * d**-0.5).masked_fill(~allowed, float("-inf"))  # (B, H, Nq, Nk)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no allowed key: all NaN -> 0
    return p @ vv


def _allowed(rows, block, causal, nq, nk) -> torch.Tensor:
    """The kernel's contract ``(Nq, Nk)``: query ``i`` at position ``i + Nk - Nq`` sees the keys of the
    blocks listed for its block (and none after it when causal)."""
    pos = torch.arange(nq) + (nk - nq)  # (Nq,) each query's position
    allowed = torch.zeros(nq, nk, dtype=torch.bool)
    for r, cols in rows:
        for c in cols:
            allowed[(pos // block == r)[:, None] & (torch.arange(nk) // block == c)[None, :]] = True
    if causal:
        allowed &= torch.arange(nk)[None, :] <= pos[:, None]
    return allowed


def _expected(q, k, v, rows, block, causal, kpm) -> torch.Tensor:
    return _masked_expected(q, k, v, _allowed(rows, block, causal, q.shape[2], k.shape[2]), kpm)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


needs_kernel = needs_c_compiler  # with a compiler, a kernel that does not build fails these tests


@needs_kernel
@pytest.mark.parametrize(
    "b, h, hkv, nq, nk, d, dv, block, causal, padded",
    [
        (1, 8, 8, 512, 512, 64, 64, 64, False, False),  # the benchmark's shape, smaller
        (2, 4, 2, 300, 300, 64, 128, 64, True, True),  # GQA, Dv != D, a partial last block
        (1, 2, 1, 1, 200, 16, 24, 32, True, False),  # decoding: one query onto the cache
        (2, 3, 3, 70, 250, 20, 20, 100, False, True),  # Nq < Nk, two query chunks per block, odd D
        (1, 2, 2, 37, 37, 8, 8, 5, True, True),  # tiny blocks: partial vectors everywhere
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_the_kernel_matches_the_float64_formula(b, h, hkv, nq, nk, d, dv, block, causal, padded, threads):
    g = torch.Generator().manual_seed(nk + block)
    q, k, v = (torch.randn(*s, generator=g) for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv)))
    kpm = torch.rand(b, nk, generator=g) > 0.3 if padded else None
    if padded:
        kpm[0, :block] = False  # query block 0's own keys all padded: rows that see (almost) nothing
    nb = -(-nk // block)
    first = (nk - nq) // block
    # any set of key blocks per query block: the diagonal, block 0, and a random few; with more than
    # one query block, the next to last sees none
    rows = []
    for r in range(first, nb):
        cols = {r, 0, *torch.randint(nb, (2,), generator=g).tolist()}
        rows.append((r, sorted(cols) if r != nb - 2 else []))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = sk.forward(
            q, k, v, sk.layout(rows, nb), block, causal=causal, key_padding_mask=kpm, scale=d**-0.5
        )
    finally:
        torch.set_num_threads(old)
    want = _expected(q, k, v, rows, block, causal, kpm)
    assert _rel(out, want) <= 1e-5
    assert not out.isnan().any()
    empty = (want == 0).all(dim=-1)  # rows with no visible key come out exactly zero
    assert (out[empty] == 0).all() and (empty.any() or len(rows) == 1)


@needs_kernel
@pytest.mark.parametrize(
    "h, hkv, nq, nk, d, dv, block, causal, padded, window, sinks",
    [
        (4, 2, 300, 300, 64, 64, 64, True, True, None, 0),  # GQA, causal, padding, a partial block
        (2, 2, 70, 250, 20, 12, 100, False, True, None, 0),  # Nq < Nk, two chunks per block, odd sizes
        (3, 1, 200, 200, 16, 16, 32, True, False, 40, 3),  # a band with sinks (local_window's masks)
        (2, 2, 37, 37, 8, 8, 5, False, True, 6, 0),  # tiny blocks
    ],
)
def test_the_kernels_backward_matches_float64_autograd(
    h, hkv, nq, nk, d, dv, block, causal, padded, window, sinks
):
    g = torch.Generator().manual_seed(nk + block + 1)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, h, nq, d), (2, hkv, nk, d), (2, hkv, nk, dv)))
    grad = torch.randn(2, h, nq, dv, generator=g)
    kpm = torch.rand(2, nk, generator=g) > 0.3 if padded else None
    if padded:
        kpm[0, :block] = False
    nb, first = -(-nk // block), (nk - nq) // block
    rows = [(r, sorted({r, 0, *torch.randint(nb, (2,), generator=g).tolist()})) for r in range(first, nb)]
    rows[len(rows) // 2] = (rows[len(rows) // 2][0], [])  # a query block that sees nothing
    got = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sk.forward(
        *got,
        sk.layout(rows, nb),
        block,
        causal=causal,
        key_padding_mask=kpm,
        scale=d**-0.5,
        window=window,
        sinks=sinks,
    )
    out.backward(grad)
    # the oracle: the float64 formula of the kernel's contract, the band on top, through autograd
    want = [t.double().requires_grad_() for t in (q, k, v)]
    p = torch.arange(nq)[:, None] + (nk - nq)
    j = torch.arange(nk)[None, :]
    band = torch.ones(nq, nk, dtype=torch.bool) if window is None else ((p - j).abs() <= window) | (j < sinks)
    ref = _masked_expected(*want, _allowed(rows, block, causal, nq, nk) & band, kpm)
    ref.backward(grad.double())
    assert _rel(out, ref.detach()) <= 1e-5
    for a, b in zip(got, want, strict=True):
        assert not a.grad.isnan().any()
        assert _rel(a.grad, b.grad) <= 1e-4


@needs_kernel
@pytest.mark.parametrize("causal", [False, True])
def test_sparse_runs_its_layout_on_the_kernel_by_default_on_the_cpu(causal):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 400, 32, generator=g) for _ in range(3))
    knobs = {"block": 32, "window_blocks": 1, "global_blocks": 2, "random_blocks": 2, "stride_blocks": 4}
    attn, ref = variants.build("sparse", **knobs), variants.build("sparse", **knobs, impl="sdpa")
    with torch.no_grad():
        out, want = attn(q, k, v, causal=causal), ref(q, k, v, causal=causal)
        dec = attn(q[:, :, -3:], k, v, causal=causal)  # three queries onto the cache
    assert attn.describe()["impl_ran"] == "kernel" and attn.describe()["impl_note"] is None
    assert _rel(out, want.double()) <= 1e-5
    assert _rel(dec, want[:, :, -3:].double()) <= 1e-5
    # with a gradient too: the kernel's own backward, against the SDPA route's
    g1 = [t.clone().requires_grad_() for t in (q, k, v)]
    g2 = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(out)
    attn(*g1, causal=causal).backward(grad)
    assert attn.describe()["impl_ran"] == "kernel"
    ref(*g2, causal=causal).backward(grad)
    for a, b in zip(g1, g2, strict=True):
        assert _rel(a.grad, b.grad.double()) <= 1e-5


def _band_expected(q, k, v, window, sinks, causal, kpm) -> torch.Tensor:
    """Sliding-window attention with sinks: the query at ``p = i + Nk - Nq`` sees key ``j`` iff
    ``|p - j| <= window`` or ``j < sinks``, and ``j <= p`` when causal."""
    nq, nk = q.shape[2], k.shape[2]
    p = torch.arange(nq)[:, None] + (nk - nq)  # (Nq, 1)
    j = torch.arange(nk)[None, :]  # (1, Nk)
    allowed = ((p - j).abs() <= window) | (j < sinks)
    if causal:
        allowed &= j <= p
    return _masked_expected(q, k, v, allowed, kpm)


@needs_kernel
@pytest.mark.parametrize(
    "h, hkv, nq, nk, window, sinks, causal, padded, block",
    [
        (4, 4, 600, 600, 128, 0, False, False, None),  # the benchmark's band, smaller
        (4, 2, 600, 600, 100, 4, True, True, None),  # StreamingLLM: sinks, causal, GQA, padding
        (2, 1, 3, 700, 64, 4, True, False, None),  # three queries onto a cache: the band and the sinks
        (2, 2, 130, 500, 7, 70, False, True, None),  # more sinks than the band, a prefill onto a cache
        (2, 2, 40, 40, 3, 100, True, False, None),  # more sinks than keys: full causal attention
        (2, 1, 301, 301, 20, 3, True, True, 16),  # the block knob: blocks of 16, a ragged last one
        (2, 2, 97, 250, 9, 0, False, False, 5),  # blocks of 5, narrower than the band, onto a cache
    ],
)
def test_local_window_runs_its_band_on_the_kernel(h, hkv, nq, nk, window, sinks, causal, padded, block):
    g = torch.Generator().manual_seed(nk + window)
    q = torch.randn(2, h, nq, 32, generator=g)
    k, v = (torch.randn(2, hkv, nk, 32, generator=g) for _ in range(2))
    kpm = torch.rand(2, nk, generator=g) > 0.2 if padded else None
    attn = variants.build("local_window", window=window, sink_tokens=sinks, block=block)
    with torch.no_grad():
        out = attn(q, k, v, causal=causal, key_padding_mask=kpm)
    assert attn.describe()["impl_ran"] == "kernel"
    assert attn.describe()["tile"] == (block or 64)  # the block knob reaches the kernel
    assert _rel(out, _band_expected(q, k, v, window, sinks, causal, kpm)) <= 1e-5
    with torch.no_grad():  # one decoded query: auto takes one fused SDPA call, and says why
        step = attn(q[:, :, -1:], k, v, causal=causal, key_padding_mask=kpm)
    assert attn.describe()["impl_ran"] == "sdpa"
    assert attn.describe()["impl_note"].startswith("one query onto a cache")
    assert _rel(step, _band_expected(q[:, :, -1:], k, v, window, sinks, causal, kpm)) <= 1e-5


def test_the_kernel_refuses_in_one_line_what_it_cannot_take():
    lw = variants.build("local_window", impl="kernel")
    with pytest.raises(
        Unsupported, match="^local_window impl=kernel: the block-sparse kernel takes float32 CPU"
    ):
        lw.check(Workload(1, 2, 64, 64, 16, 16, dtype=torch.bfloat16))
    attn = variants.build("sparse", impl="kernel")
    with pytest.raises(Unsupported, match="^sparse impl=kernel: the block-sparse kernel takes float32 CPU"):
        attn.check(Workload(1, 2, 64, 64, 16, 16, dtype=torch.float64))
    attn.check(Workload(1, 2, 64, 64, 16, 16, backward=True))  # the kernel has its own backward
    with pytest.raises(Unsupported, match="takes head sizes up to 256, not 512"):
        attn.check(Workload(1, 2, 64, 64, 512, 512))
    with pytest.raises(ValueError, match="sparse impl must be one of auto, kernel, sdpa, blocked, flex"):
        variants.build("sparse", impl="c")


def test_without_a_compiler_sparse_falls_back_and_impl_kernel_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setattr(sk._KERNEL, "lib", None)
    monkeypatch.setattr(sk._KERNEL, "error", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 50, 8, generator=g) for _ in range(3))
    attn = variants.build("sparse", block=8)
    with torch.no_grad():
        out = attn(q, k, v)
    assert attn.describe()["impl_ran"] == "sdpa"
    assert attn.describe()["impl_note"].startswith(
        "the block-sparse kernel could not be built or loaded with"
    )
    rows = [(r, attn.block_pattern(50)[r].nonzero().flatten().tolist()) for r in range(7)]
    assert _rel(out, _expected(q, k, v, rows, 8, False, None)) <= 1e-5
    with pytest.raises(Unavailable, match="^sparse impl=kernel: the block-sparse kernel could not be built"):
        variants.build("sparse", impl="kernel").check(Workload(1, 2, 50, 50, 8, 8))


@needs_kernel
@pytest.mark.parametrize(
    "knobs", [{"window": 2**32}, {"window": 2, "sink_tokens": 2**31}], ids=["window", "sinks"]
)
def test_a_band_or_sinks_past_the_keys_reach_the_kernel_as_they_are(knobs):
    """The C side takes ints: a window of 2**32 was read as 0, 2**31 sinks as none (3.7 and 2.3 off)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    attn = variants.build("local_window", **knobs)
    with torch.no_grad():
        out = attn(q, k, v, causal=False)
    assert attn.describe()["impl_ran"] == "kernel"
    assert _rel(out, _band_expected(q, k, v, 40, 0, False, None)) <= 1e-5  # every key: full attention
