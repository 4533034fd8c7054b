"""chunked's Triton path (``impl=triton``) without a GPU: its kernels run under Triton's CPU
interpreter against the float64 oracle, and are compiled for sm_80 and sm_90 with Triton's own
``ptxas`` to check what only the real target sees (shared memory, register spills, code generation).

Triton reads ``TRITON_INTERPRET`` when it is imported (its own library functions are kernels too), so
the interpreted tests run in a child pytest with it set (:func:`test_interpreted_tests_pass`); in this
process they are skipped. On a GPU the registry-wide tests run the path as it is: chunked's ``auto``
takes it on CUDA."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

import variants
from variants import Unsupported, oracle

from .helpers import (
    CASES,
    INTERPRETING,
    Case,
    build,
    flags_allow,
    interpreted,
    make_inputs,
    rel_err,
    run_interpreted,
    workload,
)

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
ct = importlib.import_module("variants.chunked_triton")
dt = importlib.import_module("variants.decode_triton")


@pytest.mark.skipif(INTERPRETING, reason="the child run itself")
def test_interpreted_tests_pass():
    """This file's interpreted tests, in a child pytest with Triton's interpreter on."""
    run_interpreted(__file__)


def _grads(out, tensors):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return torch.autograd.grad(out, tensors, g.to(out.dtype))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@interpreted
def test_forward_and_gradients_match_the_oracle(case):
    attn = build("chunked", {"impl": "triton"}, case)
    assert flags_allow(attn, workload(case)), "the interpreter runs every case on the CPU"
    q, k, v, kw = make_inputs(case, requires_grad=True)
    out = attn(q, k, v, **kw)
    assert attn.describe()["impl_ran"] == "triton"
    want = oracle(attn, q, k, v, **kw)
    assert rel_err(out, want) <= 1e-5
    for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        assert rel_err(got, exp) <= 1e-4


#: several tiles each way, head sizes that are not powers of two, the diagonal inside tiles
MULTI_TILE = [
    Case("long_causal", b=1, h=2, nq=150, nk=150, d=40, dv=24, causal=True),
    Case("prefill_gqa", b=2, h=4, hkv=2, nq=70, nk=150, d=24, dv=40, causal=True, padding=True),
    Case("cross_bias", b=1, h=2, nq=90, nk=130, d=16, dv=16, bias=True, cross=True),
    Case("mask_softcap", b=1, h=2, nq=100, nk=100, d=72, dv=72, mask=True, softcap=0.8),
]


@pytest.mark.parametrize("case", MULTI_TILE, ids=lambda c: c.id)
@interpreted
def test_many_tiles_match_the_oracle(case):
    attn = build("chunked", {"impl": "triton"}, case)
    q, k, v, kw = make_inputs(case, requires_grad=True)
    out = attn(q, k, v, **kw)
    want = oracle(attn, q, k, v, **kw)
    assert rel_err(out, want) <= 1e-5
    for got, exp in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
        assert rel_err(got, exp) <= 1e-4


@interpreted
@pytest.mark.parametrize("wanted", ["q", "kv", "v"])
def test_the_backward_runs_only_the_kernels_whose_gradients_are_wanted(wanted, monkeypatch):
    ran = []
    real = ct._run
    monkeypatch.setattr(ct, "_run", lambda launch: (ran.append(launch[0].fn.__name__), real(launch)))
    case = Case("prefill_gqa", b=1, h=4, hkv=2, nq=40, nk=70, d=16, dv=24, causal=True)
    q, k, v, kw = make_inputs(case)
    named = {"q": q, "k": k, "v": v}
    inputs = [named[n].requires_grad_() for n in wanted]
    attn = build("chunked", {"impl": "triton"}, case)
    got = _grads(attn(q, k, v, **kw), inputs)
    assert ran == ["_fwd", "_bwd_dq" if wanted == "q" else "_bwd_dkdv"]
    for g, exp in zip(got, _grads(oracle(attn, q, k, v, **kw), inputs), strict=True):
        assert rel_err(g, exp) <= 1e-4


@interpreted
@pytest.mark.parametrize(
    "case",
    [
        Case(
            "sinks_gqa", b=2, h=4, hkv=2, nq=70, nk=70, d=64, dv=64, causal=True, padding=True, sinks="head"
        ),
        Case("sinks_per_query", b=2, h=2, nq=40, nk=90, d=16, dv=24, causal=True, bias=True, sinks="query"),
    ],
    ids=lambda c: c.id,
)
def test_sinks_are_taken_as_they_are_with_their_gradient(case, monkeypatch):
    """No extra key or feature: the forward is launched at D=64 (not 65, padded to 128) with the sink
    logits, and their gradient (sum over what they broadcast over) matches the oracle's."""
    launched = []
    real = ct._run
    monkeypatch.setattr(ct, "_run", lambda launch: (launched.append(launch[3]), real(launch)))
    q, k, v, kw = make_inputs(case, requires_grad=True)
    kw["sinks"].requires_grad_()
    attn = build("chunked", {"impl": "triton"}, case)
    out = attn(q, k, v, **kw)
    assert (launched[0]["D"], launched[0]["BLOCK_D"], launched[0]["HAS_SINK"]) == (case.d, case.d, True)
    want = oracle(attn, q, k, v, **kw)
    assert rel_err(out, want) <= 1e-5
    inputs = (q, k, v, kw["sinks"])
    for got, exp in zip(_grads(out, inputs), _grads(want, inputs), strict=True):
        assert rel_err(got, exp) <= 1e-4


@interpreted
def test_sinks_fall_back_to_one_more_key_when_the_kernels_do_not_build(monkeypatch):
    def no_build(*args, **kwargs):
        raise ct.BUILD_ERRORS[-1](232448, 262144, "shared memory")

    monkeypatch.setattr(ct, "attend", no_build)
    case = Case("sinks", b=1, h=4, hkv=2, nq=20, nk=30, d=16, dv=16, causal=True, sinks="query")
    q, k, v, kw = make_inputs(case, requires_grad=True)
    attn = variants.build("chunked")  # auto: the CPU stands in for a GPU under the interpreter
    monkeypatch.setattr(type(attn), "_path", lambda self, w: "triton")
    out = attn(q, k, v, **kw)
    assert attn.describe()["impl_ran"] == "reference"
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5


@interpreted
def test_a_row_that_sees_nothing_is_zero_with_zero_gradients():
    case = Case("empty", b=2, h=2, nq=80, nk=80, d=16, dv=16)
    q, k, v, kw = make_inputs(case, requires_grad=True)
    kpm = torch.ones(2, 80, dtype=torch.bool)
    kpm[1] = False  # the second sequence has no key at all
    out = build("chunked", {"impl": "triton"}, case)(q, k, v, key_padding_mask=kpm)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    dq, dk, dv = _grads(out, (q, k, v))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert dq[1].abs().max() == 0 and dk[1].abs().max() == 0 and dv[1].abs().max() == 0


@interpreted
def test_float16_error_within_2x_sdpa_math():
    """Output and gradients. float16 only: Triton's interpreter (3.9) multiplies bfloat16 tiles wrongly
    (its numpy has no bfloat16; a 16x16 product came out 3e10 off). bfloat16 is tested on a GPU by the
    registry tests."""
    case = Case("lp", b=1, h=4, hkv=2, nq=100, nk=100, d=32, dv=32, causal=True, padding=True)
    attn = build("chunked", {"impl": "triton"}, case)
    math = variants.build("sdpa", backend="math")  # the same dtype's plain kernel sets the bar
    q, k, v, kw = make_inputs(case, dtype=torch.float16, requires_grad=True)
    want = oracle(attn, q, k, v, **kw)
    ours, theirs = attn(q, k, v, **kw), math(q, k, v, **kw)
    floor = torch.finfo(torch.float16).eps
    assert rel_err(ours, want) <= max(2 * rel_err(theirs, want), floor)
    exact = _grads(want, (q, k, v))
    for got, bar, exp in zip(_grads(ours, (q, k, v)), _grads(theirs, (q, k, v)), exact, strict=True):
        assert rel_err(got, exp) <= max(2 * rel_err(bar, exp), floor)


def test_what_the_triton_path_cannot_take_is_one_line():
    case = Case("plain")
    attn = build("chunked", {"impl": "triton"}, case)
    q, k, v, kw = make_inputs(case)
    if not INTERPRETING:
        with pytest.raises(Unsupported, match="Triton kernels run on CUDA, not cpu"):
            attn(q, k, v, **kw)
    big = dict(batch=1, heads=2, nq=8, nk=8, head_dim=320, v_head_dim=320, device="cuda")
    assert "head sizes up to 256" in ct.refusal(variants.Workload(**big))
    wide = variants.Workload(**{**big, "head_dim": 64, "v_head_dim": 64, "dtype": torch.float64})
    assert "not float64" in ct.refusal(wide)
    assert "not 70000" in ct.refusal(
        variants.Workload(**{**big, "head_dim": 64, "v_head_dim": 64, "batch": 70000})
    )
    long = variants.Workload(**{**big, "head_dim": 128, "v_head_dim": 128, "nq": 2**24, "nk": 2**24})
    assert "below 2^31" in ct.refusal(long)
    assert ct.refusal(variants.Workload(**{**big, "head_dim": 64, "v_head_dim": 64})) is None
    with pytest.raises(ValueError, match="query_chunk and key_chunk size the reference path"):
        variants.build("chunked", impl="triton", query_chunk=64)
    with pytest.raises(ValueError, match="impl must be one of auto, reference, triton"):
        variants.build("chunked", impl="cuda")


def test_kernels_that_do_not_build_fall_back_under_auto_and_are_unavailable_when_forced(monkeypatch):
    """A Triton other than the one the tiles were sized with may not fit them on a card: ``auto`` then
    runs the reference and says why; ``impl=triton`` is ``unavailable`` with the same reason."""
    from variants import Unavailable, chunked

    def no_build(*args, **kwargs):
        raise ct.BUILD_ERRORS[-1](232448, 262144, "shared memory")  # OutOfResources(required, limit, name)

    monkeypatch.setattr(ct, "attend", no_build)
    monkeypatch.setattr(ct, "refusal", lambda w: None)  # the CPU stands in for a GPU here
    monkeypatch.setattr(ct, "interpreting", lambda: True)
    monkeypatch.setattr(
        chunked.ChunkedAttention, "_path", lambda self, w: self.impl.replace("auto", "triton")
    )
    case = Case("causal", causal=True)
    q, k, v, kw = make_inputs(case)
    attn = build("chunked", {}, case)
    out = attn(q, k, v, **kw)
    assert attn.describe()["impl_ran"] == "reference"
    assert "did not build for this GPU" in attn.describe()["impl_note"]
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5
    with pytest.raises(Unavailable, match="chunked impl=triton: the Triton kernels did not build"):
        build("chunked", {"impl": "triton"}, case)(q, k, v, **kw)
    monkeypatch.setattr(dt, "decode", no_build)  # decode=kernel asked for the decode kernel: no fallback
    monkeypatch.setattr(dt, "decode_refusal", lambda w: None)
    with pytest.raises(Unavailable, match="chunked decode=kernel: the Triton kernels did not build"):
        build("chunked", {"decode": "kernel"}, case)(q[:, :, -2:], k, v, causal=True)


def test_without_triton_the_variants_import_and_chunked_runs_its_other_paths():
    """``pip install -e .`` does not install Triton: the Triton modules must import without it (the
    kernels undefined), chunked must run, and impl=triton must say why it cannot."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # import triton now raises ImportError
        "import torch, variants\n"
        "from variants import chunked_triton, decode_triton\n"
        "assert chunked_triton.IMPORT_ERROR and decode_triton.triton is None\n"
        "q = torch.randn(1, 4, 1, 16); k = torch.randn(1, 2, 40, 16)\n"
        "a = variants.build('chunked')\n"
        "out = a(q, k, k, causal=True, sinks=torch.randn(4))\n"
        "assert out.shape == (1, 4, 1, 16) and a.describe()['impl_ran'] in (None, 'reference')\n"
        "try:\n"
        "    variants.build('chunked', impl='triton')(q, k, k)\n"
        "except variants.Unavailable as exc:\n"
        "    assert 'Triton could not be imported' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('impl=triton ran without Triton')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_auto_runs_the_reference_on_the_cpu_and_says_nothing():
    case = Case("plain")
    attn = build("chunked", {}, case)
    q, k, v, kw = make_inputs(case)
    attn(q, k, v, **kw)
    assert attn.describe()["impl_ran"] == "reference" and attn.describe()["impl_note"] is None


# -------------------------------------------------------------------- compiled for the real targets
#: the most shared memory one block may use: A100 (sm_80), H100/H200 (sm_90)
SHARED_LIMIT = {80: 166912, 90: 232448}


def _launches(d: int, dtype: torch.dtype, features: bool) -> dict[str, ct.Launch]:
    """The three kernels' launches for head size ``d``, GQA 2:1, causal, with every mask, a bias, a
    soft cap and sink logits when ``features`` (the most registers) or none; tensors on the CPU (only
    their types, strides and the launch's constants are read)."""
    b, h, hkv, n = 1, 4, 2, 256
    q, k, v = (
        torch.zeros(b, h, n, d, dtype=dtype),
        torch.zeros(b, hkv, n, d, dtype=dtype),
        torch.zeros(b, hkv, n, d, dtype=dtype),
    )
    kpm = torch.ones(b, n, dtype=torch.bool) if features else None
    am = torch.ones(1, 1, n, n, dtype=torch.bool).expand(b, h, n, n) if features else None
    bias = torch.zeros(1, h, n, n, dtype=dtype) if features else None
    cap = 30.0 if features else None
    out, lse = torch.empty(b, h, n, d, dtype=dtype), torch.empty(b * h, n)
    grads = ct._grad(q, (b, h, n), d), ct._grad(k, (b, hkv, n), d), ct._grad(v, (b, hkv, n), d)
    sinks = torch.zeros(b, h, n) if features else None
    fwd = ct.forward_launch(q, k, v, out, lse, kpm, am, bias, True, 0.1, cap, sinks)
    dkdv, dq = ct.backward_launches(q, k, v, out, lse, lse, *grads, kpm, am, bias, True, 0.1, cap)
    return {"fwd": fwd, "dkdv": dkdv, "dq": dq}


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernels_compile_for_sm80_and_sm90_within_their_shared_memory(d, dtype):
    for arch, limit in SHARED_LIMIT.items():
        for kernel, launch in _launches(d, dtype, features=True).items():
            used = ct.compile_for(launch, arch)
            assert used["shared"] <= limit, f"{kernel} D={d} {dtype} sm_{arch}: {used}"


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
def test_16_bit_kernels_do_not_spill_on_sm90(d):
    """The shapes the GPU goals time (causal, no mask, D=64 and 128, bf16): no register spilled."""
    for kernel, launch in _launches(d, torch.bfloat16, features=False).items():
        used = ct.compile_for(launch, 90)
        assert used["stack"] == 0, f"{kernel} D={d}: {used}"


def test_rows_past_32_bit_offsets_are_copied_before_the_kernels_see_them(monkeypatch):
    """The kernels index one batch-head's rows in 32 bits: a view whose rows reach past 2^31 elements
    (a (B, N, H, D) layout of a very long sequence) goes in as a contiguous copy, any other as it is.
    Meta tensors: the strides of such a view without its 8 GiB."""
    near = torch.empty_strided((1, 2, 3, 4), (0, 4, 2**29, 1), device="meta")  # reach 2^30 + 3
    far = torch.empty_strided((1, 2, 3, 4), (0, 4, 2**30, 1), device="meta")  # reach 2^31 + 3
    assert ct._within_32_bits(near) is near
    copied = ct._within_32_bits(far)
    assert copied.is_contiguous() and copied.shape == far.shape
    # and attend hands the kernels the copy, for each of q, k and v
    seen = []
    monkeypatch.setattr(ct._TritonChunked, "apply", lambda q, k, v, *rest: seen.extend((q, k, v)))
    common = dict(causal=False, key_padding_mask=None, attn_mask=None, bias=None, scale=1.0, softcap=None)
    ct.attend(far, near, far, **common)
    assert [t.is_contiguous() for t in seen] == [True, False, True]
