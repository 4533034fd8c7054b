"""chunked's split-K decode on its Triton path (:mod:`variants.decode_triton`) without a GPU: the kernel
runs under Triton's CPU interpreter against the float64 oracle (in a child pytest, as in
``test_chunked_triton.py``), and is compiled for sm_80 and sm_90 with Triton's own ``ptxas``.

The split count is sized from the GPU's SM count; under the interpreter it stands in 4 SMs, so the
cases below run from one split to a few dozen, with ranges that end inside a tile, ranges whose keys
are all padding, and rows that see no key at all."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

import variants
from variants import Unsupported, oracle

from .helpers import CASES, INTERPRETING, Case, build, interpreted, make_inputs, rel_err, run_interpreted

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
ct = importlib.import_module("variants.chunked_triton")
dt = importlib.import_module("variants.decode_triton")


@pytest.mark.skipif(INTERPRETING, reason="the child run itself")
def test_interpreted_tests_pass():
    """This file's interpreted tests, in a child pytest with Triton's interpreter on."""
    run_interpreted(__file__)


def _decode(case: Case, dtype=torch.float32, **extra):
    """chunked on its Triton path for ``case`` (no gradient): the output, the oracle's and the record."""
    attn = build("chunked", {"impl": "triton"}, case)
    q, k, v, kw = make_inputs(case, dtype=dtype)
    kw.update(extra)
    out = attn(q, k, v, **kw)
    return out, oracle(attn, q, k, v, **kw), attn.describe()


DECODES = [c for c in CASES if c.nq < c.nk]


@pytest.mark.parametrize("case", DECODES, ids=lambda c: c.id)
@interpreted
def test_every_registry_decode_case_runs_the_kernel_and_matches_the_oracle(case):
    out, want, rec = _decode(case)
    assert (rec["impl_ran"], rec["decode_ran"]) == ("triton", "kernel"), rec["decode_note"]
    assert rel_err(out, want) <= 1e-5


#: many splits, GQA 8:1, several queries per head (speculative decoding), head sizes that are not
#: powers of two, Dv != D, a range that ends inside a tile, per-head masks and biases
SPLITS = [
    Case("gqa8_one_query", b=1, h=16, hkv=2, nq=1, nk=1000, d=24, dv=40, causal=True),
    Case("four_queries_causal", b=2, h=8, hkv=2, nq=4, nk=700, d=16, dv=16, causal=True, padding=True),
    Case("mask_bias_cap", b=1, h=4, hkv=2, nq=3, nk=530, d=72, dv=72, mask=True, bias=True, softcap=0.8),
    Case("sixty_four_rows", b=1, h=32, hkv=1, nq=2, nk=300, d=16, dv=16, causal=True),
    Case("sinks_per_query", b=2, h=8, hkv=2, nq=2, nk=600, d=64, dv=64, causal=True, sinks="query"),
    Case(
        "sinks_per_head", b=1, h=8, hkv=1, nq=1, nk=900, d=64, dv=64, causal=True, padding=True, sinks="head"
    ),
]


@pytest.mark.parametrize("case", SPLITS, ids=lambda c: c.id)
@interpreted
def test_split_ranges_merge_to_the_oracle(case):
    hkv = case.hkv or case.h
    block = dt.tile(case.d, case.dv, case.h // hkv * case.nq, torch.float32)[0]
    assert dt.splits_for(case.b, hkv, case.nk, block, torch.device("cpu"))[0] > 1  # long enough to split
    out, want, rec = _decode(case)
    assert rec["decode_ran"] == "kernel"
    assert rel_err(out, want) <= 1e-5


@interpreted
def test_ranges_of_padding_only_and_rows_that_see_nothing():
    case = Case("padded", b=2, h=4, hkv=2, nq=2, nk=600, d=16, dv=16, causal=True)
    kpm = torch.ones(2, 600, dtype=torch.bool)
    kpm[0, 100:] = False  # the first sequence: most ranges hold nothing but padding
    kpm[1] = False  # the second sequence sees no key at all
    out, want, rec = _decode(case, key_padding_mask=kpm)
    assert rec["decode_ran"] == "kernel"
    assert rel_err(out[0], want[0]) <= 1e-5
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@interpreted
def test_float16_error_within_2x_sdpa_math():
    """float16 only: the interpreter multiplies bfloat16 tiles wrongly (see test_chunked_triton)."""
    case = Case("lp", b=1, h=8, hkv=2, nq=1, nk=900, d=64, dv=64, causal=True, padding=True)
    out, want, rec = _decode(case, dtype=torch.float16)
    assert rec["decode_ran"] == "kernel"
    q, k, v, kw = make_inputs(case, dtype=torch.float16)
    theirs = variants.build("sdpa", backend="math")(q, k, v, **kw)
    assert rel_err(out, want) <= max(2 * rel_err(theirs, want), torch.finfo(torch.float16).eps)


@interpreted
def test_what_the_kernel_cannot_take_runs_the_general_kernels_and_says_why():
    case = Case("decode", b=1, h=4, hkv=2, nq=2, nk=40, d=16, dv=16, causal=True)
    attn = build("chunked", {"impl": "triton"}, case)
    q, k, v, kw = make_inputs(case, requires_grad=True)
    out = attn(q, k, v, **kw)  # a gradient is wanted: the forward and backward kernels
    rec = attn.describe()
    assert (rec["decode_ran"], rec["decode_note"]) == ("torch", "the split-K decode kernel has no backward")
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5
    with pytest.raises(Unsupported, match="chunked decode=kernel: the split-K decode kernel has no backward"):
        build("chunked", {"impl": "triton", "decode": "kernel"}, case)(q, k, v, **kw)
    torch_path = build("chunked", {"impl": "triton", "decode": "torch"}, case)
    with torch.no_grad():
        torch_path(q, k, v, **kw)
    assert torch_path.describe()["decode_ran"] is None and torch_path.describe()["impl_ran"] == "triton"


@interpreted
def test_sinks_being_trained_take_the_kernels_with_a_backward():
    case = Case("sinks", b=1, h=4, hkv=2, nq=1, nk=200, d=16, dv=16, causal=True, sinks="head")
    q, k, v, kw = make_inputs(case)
    kw["sinks"].requires_grad_()  # q, k and v frozen: only the sinks are trained
    attn = build("chunked", {"impl": "triton"}, case)
    out = attn(q, k, v, **kw)
    assert attn.describe()["decode_note"] == "the split-K decode kernel has no backward"
    (got,) = torch.autograd.grad(out.sum(), kw["sinks"])
    (exp,) = torch.autograd.grad(oracle(attn, q, k, v, **kw).sum(), kw["sinks"])
    assert rel_err(got, exp) <= 1e-4


def test_refusals_are_one_line():
    w = variants.Workload(
        batch=1, heads=32, kv_heads=1, nq=4, nk=100, head_dim=128, v_head_dim=128, device="cuda"
    )
    assert dt.decode_refusal(w) == (
        "the split-K decode kernel takes at most 32 query rows per K/V head (G x Nq) at head size 128 in "
        "float32, not 128"
    )
    assert "at most 64" in dt.decode_refusal(replace(w, dtype=torch.bfloat16))
    assert dt.decode_refusal(replace(w, nq=1, dtype=torch.bfloat16)) is None
    assert "fewer queries than keys" in dt.decode_refusal(replace(w, nq=100))
    assert dt.decode_refusal(replace(w, nq=1, backward=True)) == "the split-K decode kernel has no backward"
    assert "head sizes up to 256" in dt.decode_refusal(replace(w, nq=1, head_dim=320, v_head_dim=320))


@pytest.mark.parametrize(
    "b, hkv, nk, block",
    [(1, 4, 65536, 64), (1, 1, 100, 64), (8, 8, 4096, 32), (64, 8, 1000, 16), (1, 2, 257, 16)],
)
def test_splits_cover_every_key_once_in_whole_tiles(b, hkv, nk, block):
    splits, span = dt.splits_for(b, hkv, nk, block, torch.device("cpu"))
    assert span % block == 0 and splits >= 1
    assert (splits - 1) * span < nk <= splits * span  # no empty range, every key in one
    if splits > 1:  # a split range holds at least a few tiles, and there are no more than wanted
        assert span >= 4 * block
        assert splits <= -(-4 * dt._INTERPRETED_SMS // (b * hkv))


def test_a_long_cache_fills_an_h100(monkeypatch):
    """The shape the kernel is for: B=1, 4 K/V heads, 64k keys on 132 SMs: about 4 programs per SM, of
    8 key tiles each."""
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    splits, span = dt.splits_for(1, 4, 65536, 64, torch.device("cuda"))
    assert (splits, span) == (128, 512)  # 512 programs: 3.9 per SM


# -------------------------------------------------------------------- compiled for the real targets
def _launch(d: int, rows: int, dtype: torch.dtype, features: bool) -> ct.Launch:
    """The kernel's launch at head size ``d`` with ``rows`` query rows on one K/V head, causal, with a
    key padding mask, a per-head mask and bias, a soft cap and sink logits when ``features``; CPU
    tensors (only their types, strides and the launch's constants are read)."""
    n, splits = 4096, 8
    q = torch.zeros(1, rows, 1, d, dtype=dtype)
    k, v = torch.zeros(1, 1, n, d, dtype=dtype), torch.zeros(1, 1, n, d, dtype=dtype)
    kpm = torch.ones(1, n, dtype=torch.bool) if features else None
    am = torch.ones(1, rows, 1, n, dtype=torch.bool) if features else None
    bias = torch.zeros(1, rows, 1, n, dtype=dtype) if features else None
    out, lse = torch.empty(1, 1, splits, rows, d), torch.empty(1, 1, splits, rows)
    sinks = torch.zeros(1, rows, 1) if features else None
    cap = 30.0 if features else None
    return dt.decode_launch(q, k, v, out, lse, kpm, am, bias, True, 0.1, cap, splits, 512, sinks)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(dt.TILES), ids=lambda t: f"{t[0]}bit_d{t[1]}_rows{t[2]}")
def test_every_tile_compiles_for_sm80_and_sm90_within_shared_memory_and_16_bit_does_not_spill(key):
    from .test_chunked_triton import SHARED_LIMIT

    bits, d, rows = key
    dtype = torch.float32 if bits == 32 else torch.bfloat16
    for arch, limit in SHARED_LIMIT.items():
        used = ct.compile_for(_launch(d, rows, dtype, features=True), arch)
        assert used["shared"] <= limit, f"{key} sm_{arch}: {used}"
        if bits == 16:
            plain = ct.compile_for(_launch(d, rows, dtype, features=False), arch)
            assert plain["stack"] == 0, f"{key} sm_{arch}: {plain}"
