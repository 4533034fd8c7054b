"""chunked's split-K decode kernel (variants/decode_kernel.c) against a float64 formula written
here, its fallback to the PyTorch path where it cannot be built or cannot take a call, and its
refusals with ``decode=kernel``."""

from __future__ import annotations

import pytest
import torch

import variants
from variants import Unavailable, Unsupported
from variants import decode_kernel as dk

from .helpers import needs_c_compiler


def _expected(q, k, v, causal: bool, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64, query head h on K/V head h // (H / Hkv), causal
    bottom-right: (B, H, Nq, Dv)."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(h // hkv, dim=1)  # (B, H, Nk, D)
    vv = v.double().repeat_interleave(h // hkv, dim=1)  # (B, H, Nk, Dv)
    s = q.double() @ kk.transpose(-2, -1) * (d**-0.5 if scale is None else scale)  # (B, H, Nq, Nk)
    if causal:
        pos = torch.arange(nq)[:, None] + (nk - nq)  # (Nq, 1): each query's position
        s = s.masked_fill(torch.arange(nk)[None, :] > pos, float("-inf"))
    return torch.softmax(s, dim=-1) @ vv


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


needs_kernel = needs_c_compiler  # with a compiler, a kernel that does not build fails these tests


@needs_kernel
@pytest.mark.parametrize(
    "b, h, hkv, nq, nk, d, dv, causal",
    [
        (1, 32, 4, 1, 5000, 128, 128, True),  # Llama-style decode: 8 query heads per K/V head
        (2, 4, 2, 3, 1000, 5, 7, True),  # a few queries onto a cache, odd head sizes
        (1, 2, 1, 1, 2, 8, 8, True),  # one cached key and the new one
        (2, 6, 3, 4, 777, 64, 32, False),  # not causal: every query sees every key
        (1, 8, 8, 16, 2049, 16, 16, True),  # 16 queries, no grouping, ranges of unequal length
    ],
)
def test_the_kernel_matches_the_float64_formula(b, h, hkv, nq, nk, d, dv, causal):
    g = torch.Generator().manual_seed(nk)
    q, k, v = (torch.randn(*s, generator=g) for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv)))
    attn = variants.build("chunked")
    with torch.no_grad():
        out = attn(q, k, v, causal=causal)
    assert attn.describe()["decode_ran"] == "kernel"
    assert _rel(out, _expected(q, k, v, causal)) <= 1e-5
    assert torch.equal(out, dk.decode(q, k, v, causal=causal, scale=d**-0.5))


@needs_kernel
@pytest.mark.parametrize("shape", [(8,), (2, 8, 3)], ids=["per_head", "per_query"])
def test_sink_logits_join_the_merge_without_a_copy_of_the_cache(shape, monkeypatch):
    """gpt-oss's sinks: e^sink more in each row's denominator, for a zero value; the formula here
    is the softmax over the keys and one more logit. The kernel takes them as they are: the cache is
    not copied with one more key and feature (which a decode step would pay for the whole cache)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(*s, generator=g) for s in ((2, 8, 3, 64), (2, 2, 3000, 64), (2, 2, 3000, 32)))
    sinks = 2 * torch.randn(shape, generator=g)
    from variants import base

    monkeypatch.setattr(base, "_sink_as_first_key", lambda *a: pytest.fail("the cache was copied"))
    attn = variants.build("chunked")
    with torch.no_grad():
        out = attn(q, k, v, causal=True, sinks=sinks)
    assert attn.describe()["decode_ran"] == "kernel"
    kk, vv = (t.double().repeat_interleave(4, dim=1) for t in (k, v))  # (B, H, Nk, D|Dv)
    s = q.double() @ kk.transpose(-2, -1) / 8  # (B, H, Nq, Nk); D = 64
    s = s.masked_fill(torch.arange(3000)[None, :] > torch.arange(3)[:, None] + 2997, float("-inf"))
    logit = sinks.double().view(1, 8, 1) if len(shape) == 1 else sinks.double()  # (B|1, H, Nq|1)
    full = torch.cat([s, logit.expand(2, 8, 3)[..., None]], dim=-1)  # the sink as one more column
    want = torch.softmax(full, dim=-1)[..., :-1] @ vv  # its value is 0
    assert _rel(out, want) <= 1e-5


@needs_kernel
def test_sinks_being_trained_take_the_path_with_a_backward():
    """A frozen model's sink logits trained alone: q, k, v need no gradient but the sinks do, so the
    decode kernel (no backward) must not take the call."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(*s, generator=g) for s in ((1, 4, 1, 16), (1, 2, 300, 16), (1, 2, 300, 16)))
    sinks = torch.randn(4, generator=g).requires_grad_()
    attn = variants.build("chunked")
    out = attn(q, k, v, causal=True, sinks=sinks)
    assert attn.describe()["decode_ran"] == "torch" and "no backward" in attn.describe()["decode_note"]
    (got,) = torch.autograd.grad(out.sum(), sinks)
    want = variants.oracle(attn, q, k, v, causal=True, sinks=sinks)
    (exp,) = torch.autograd.grad(want.sum(), sinks)
    assert _rel(got, exp) <= 1e-5


@needs_kernel
def test_the_kernel_reads_a_strided_cache_and_a_given_scale():
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 2, 300, 16, generator=g)  # (B, Hkv, capacity, D): a view of its first 257
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = cache[:, :, :257], cache[:, :, :257].flip(-1).contiguous()
    attn = variants.build("chunked")
    with torch.no_grad():
        out = attn(q, k, v, causal=True, scale=0.3)
    assert attn.describe()["decode_ran"] == "kernel"
    assert _rel(out, _expected(q, k, v, True, 0.3)) <= 1e-5


@needs_kernel
@pytest.mark.parametrize("b,hkv", [(3, 1), (3, 2), (1, 2)])
def test_the_kernel_reads_a_cache_laid_out_token_major(b, hkv):
    """Hugging Face's layout, ``(B, N, Hkv, D)`` seen as ``(B, Hkv, N, D)``: with one K/V head torch
    calls the view contiguous with a head stride of D, and the kernel read batch row 1 at row 0's
    second token (0.85 off)."""
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(b, 40, hkv, 8, generator=g).transpose(1, 2) for _ in "kv")  # (B, Hkv, N, D)
    q = torch.randn(b, 4, 2, 8, generator=g)
    attn = variants.build("chunked")
    with torch.no_grad():
        out = attn(q, k, v, causal=True)
    assert attn.describe()["decode_ran"] == "kernel"
    assert _rel(out, _expected(q, k, v, True)) <= 1e-5


def test_what_the_kernel_cannot_take_runs_in_pytorch_and_says_why():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 2, 8, generator=g, requires_grad=True)
    k, v = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    attn = variants.build("chunked")
    out = attn(q, k, v, causal=True)
    assert attn.describe()["decode_ran"] == "torch"
    assert attn.describe()["decode_note"] == "the decode kernel has no backward"
    assert _rel(out, _expected(q.detach(), k, v, True)) <= 1e-5
    kpm = torch.ones(1, 40, dtype=torch.bool)
    kpm[0, 3] = False
    with torch.no_grad():
        attn(q, k, v, causal=True, key_padding_mask=kpm)
    assert "causal masking only" in attn.describe()["decode_note"]
    with torch.no_grad():
        attn(q[:, :, :1].expand(1, 4, 40, 8), k, v)  # as many queries as keys: not a decode
    assert attn.describe()["decode_ran"] is None
    with torch.no_grad():
        variants.build("chunked", decode="torch")(q, k, v, causal=True)
    assert variants.build("chunked", decode="torch").describe()["decode_ran"] is None


@needs_kernel
def test_chunks_set_by_hand_size_the_decodes_of_decode_auto():
    """query_chunk / key_chunk size the PyTorch path; with decode=auto a decode then runs there, and
    the note says why, rather than the chunks being ignored by the kernel. decode=kernel keeps the
    kernel for decodes."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 2, 8, generator=g)
    k, v = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    attn = variants.build("chunked", query_chunk=1, key_chunk=7)
    with torch.no_grad():
        out = attn(q, k, v, causal=True)
    assert attn.describe()["decode_ran"] == "torch"
    assert attn.describe()["decode_note"].startswith("query_chunk/key_chunk were set: they size the PyTorch")
    assert _rel(out, _expected(q, k, v, True)) <= 1e-5
    attn = variants.build("chunked", query_chunk=1, key_chunk=7, decode="kernel")
    with torch.no_grad():
        out = attn(q, k, v, causal=True)
    assert attn.describe()["decode_ran"] == "kernel"
    assert _rel(out, _expected(q, k, v, True)) <= 1e-5


def test_decode_kernel_refuses_in_one_line_what_it_cannot_take():
    attn = variants.build("chunked", decode="kernel")
    w = variants.Workload(1, 4, 1, 40, 8, 8, causal=True, kv_heads=2, backward=True)
    with pytest.raises(Unsupported, match=r"^chunked decode=kernel: the decode kernel has no backward$"):
        attn.check(w)
    w = variants.Workload(1, 4, 1, 40, 8, 8, causal=True, kv_heads=2, dtype=torch.float64)
    with pytest.raises(Unsupported, match="takes float32 CPU tensors, not float64 on cpu"):
        attn.check(w)
    w = variants.Workload(1, 64, 2, 40, 8, 8, causal=True, kv_heads=1)
    with pytest.raises(Unsupported, match="at most 64 query rows per K/V head, not 128"):
        attn.check(w)
    with pytest.raises(ValueError, match="chunked decode must be one of auto, kernel, torch; got 'c'"):
        variants.build("chunked", decode="c")


def test_without_a_compiler_chunked_falls_back_and_decode_kernel_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setattr(dk._KERNEL, "lib", None)
    monkeypatch.setattr(dk._KERNEL, "error", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path / "cache"))
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 4, 1, 8, generator=g),
        torch.randn(1, 2, 30, 8, generator=g),
        torch.randn(1, 2, 30, 8, generator=g),
    )
    attn = variants.build("chunked")
    with torch.no_grad():
        out = attn(q, k, v, causal=True)
    assert attn.describe()["decode_ran"] == "torch"
    assert attn.describe()["decode_note"].startswith("the decode kernel could not be built or loaded with")
    assert _rel(out, _expected(q, k, v, True)) <= 1e-5
    w = variants.Workload(1, 4, 1, 30, 8, 8, causal=True, kv_heads=2)
    with pytest.raises(Unavailable, match="^chunked decode=kernel: the decode kernel could not be built"):
        variants.build("chunked", decode="kernel").check(w)


@needs_kernel
def test_the_kernel_is_built_once_into_the_cache_named_by_its_source(monkeypatch, tmp_path):
    monkeypatch.setattr(dk._KERNEL, "lib", None)
    monkeypatch.setattr(dk._KERNEL, "error", None)
    monkeypatch.setenv("ATTNBENCH_CACHE", str(tmp_path))
    assert dk.kernel() is not None
    built = list(tmp_path.glob("decode_kernel-*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("*.tmp*"))
    monkeypatch.setattr(dk._KERNEL, "lib", None)
    mtime = built[0].stat().st_mtime_ns
    assert dk.kernel() is not None and built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
