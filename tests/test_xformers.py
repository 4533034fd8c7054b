"""The ``xformers`` variant without a GPU: its refusals, its ``op`` and ``window`` knobs, and its CUDA
path (layout, grouped heads, masks, alignment) run on the CPU against an emulated kernel.

The emulated kernel computes attention in float64 and applies a mask through xFormers' own bias
classes (``materialize``), so the mapping of causal, windows and padding onto xFormers' types is
checked against xFormers' definition of them, and the output against the float64 oracle. The GPU
numbers themselves are checked by ``pytest -m cuda`` (tests/test_cuda.py).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import variants
from variants import Unavailable, Unsupported, oracle
from variants import xformers_attn as xf
from variants.local_window import LocalWindowAttention

from .helpers import CASES, Case, make_inputs, rel_err

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = importlib.util.find_spec("xformers") is not None
needs_xformers = pytest.mark.skipif(
    not INSTALLED, reason="xformers is not installed (pip install -e '.[dev]')"
)
CUDA_FP16 = variants.Workload(1, 2, 4, 4, 8, 8, device="cuda", dtype=torch.float16)  # check() needs no GPU
BUILT_FOR_OTHER_TORCH = (
    "xformers 0.0.35 cannot load its compiled kernels: built for torch 2.10.0+cu128 (CUDA 12.8), this is "
    f"torch {torch.__version__}; install the xformers release built for this torch "
    "(or the torch it was built for)"
)


def test_xformers_is_unsupported_on_cpu_with_its_own_reason():
    attn = variants.build("xformers")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(Unsupported) as e:
        attn(q, q, q)
    msg = str(e.value)
    assert "\n" not in msg and "pip install" not in msg  # installing would not make it run here
    assert msg.startswith("xformers does not run on device 'cpu': xFormers has no CPU operator")
    assert "cannot load its compiled kernels" not in msg  # true, but beside the point on a CPU
    if INSTALLED:
        assert "xFormers says: No operator found" in msg  # its own words, from a real call


def test_importing_variants_prints_nothing_and_does_not_import_xformers():
    code = (
        "import sys, torch, variants\n"
        "assert 'xformers' not in sys.modules, 'xformers imported eagerly'\n"
        "attn = variants.build('xformers')\n"
        "q = torch.randn(1, 2, 4, 8)\n"
        "try:\n"
        "    attn(q, q, q)\n"
        "except variants.Unsupported as e:\n"
        "    print('unsupported:', e)\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", f"something printed to stderr: {r.stderr[:500]}"
    assert r.stdout.startswith("unsupported: xformers")


def test_xformers_missing_reads_as_an_install_hint(monkeypatch):
    monkeypatch.setattr(xf, "_XOPS", None)
    monkeypatch.setattr(xf, "_IMPORT_ERROR", None)
    monkeypatch.setitem(sys.modules, "xformers", None)  # makes `import xformers...` raise ImportError
    monkeypatch.setitem(sys.modules, "xformers.ops", None)
    hint = r"xformers is not installed: on a CUDA machine, pip install"
    with pytest.raises(Unavailable, match=hint):
        variants.build("xformers").check(CUDA_FP16)


def test_the_extension_failure_names_both_builds(monkeypatch):
    # what xFormers' own loader leaves behind when its extension was built for another torch
    info = SimpleNamespace(torch_version="2.10.0+cu128", cuda_version=1208, python_version="3.10.19")
    failed = type("xFormersInvalidLibException", (Exception,), {})()
    failed.build_info = info
    fake_cpp_lib = SimpleNamespace(_cpp_library_load_exception=failed)
    monkeypatch.setitem(sys.modules, "xformers", SimpleNamespace(_cpp_lib=fake_cpp_lib))
    monkeypatch.setitem(sys.modules, "xformers._cpp_lib", fake_cpp_lib)
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.0.35")
    assert xf.extension_failure() == BUILT_FOR_OTHER_TORCH  # 1208 is CUDA 12.8, not 12.0


def test_xformers_not_implemented_message_is_summarised():
    msg = (
        "No operator found for `memory_efficient_attention_forward` with inputs:\n"
        "     query       : shape=(1, 4, 2, 8) (torch.float32)\n"
        "     p           : 0.0\n"
        "`fa2F` is not supported because:\n"
        "    device=cpu (supported: {'cuda'})\n"
        "`cutlassF-pt` is not supported because:\n"
        "    device=cpu (supported: {'cuda'})\n"
        "    operator wasn't built\n"
    )
    got = xf.summarize_not_implemented(msg)
    assert got == (
        "No operator found for `memory_efficient_attention_forward` "
        "(fa2F: device=cpu (supported: {'cuda'}) | cutlassF-pt: device=cpu (supported: {'cuda'}); "
        "operator wasn't built)"
    )


# ---------------------------------------------------------------------- an emulated xFormers, on CPU
class _FakeOp:
    """An operator family member: a name, the bias types it takes, and xFormers' refusal list."""

    NAME = "fake"
    TYPES: tuple = ()
    DTYPES = (torch.float16, torch.bfloat16, torch.float32)

    @classmethod
    def not_supported_reasons(cls, inp: dict) -> list[str]:
        reasons = []
        if type(inp["attn_bias"]) not in cls.TYPES:
            reasons.append(f"attn_bias type is {type(inp['attn_bias'])}")
        if inp["query"].dtype not in cls.DTYPES:
            reasons.append(f"dtype={inp['query'].dtype} (supported: fp16, bf16)")
        return reasons


def _family(fw_name: str, bw_name: str | None, types: tuple, dtypes=None) -> SimpleNamespace:
    extra = {} if dtypes is None else {"DTYPES": dtypes}
    fw = type(fw_name, (_FakeOp,), {"NAME": fw_name, "TYPES": types, **extra})
    if bw_name is None:
        return SimpleNamespace(FwOp=fw)
    return SimpleNamespace(
        FwOp=fw, BwOp=type(bw_name, (_FakeOp,), {"NAME": bw_name, "TYPES": types, **extra})
    )


@pytest.fixture
def fake_xformers(monkeypatch):
    """``xformers.ops`` as the variant uses it on CUDA, with xFormers' real bias classes and a float64
    kernel that checks xFormers' input contract (layout, alignment, 5-D grouped heads)."""
    ab = pytest.importorskip("xformers.ops.fmha.attn_bias")
    calls: list[dict] = []

    def memory_efficient_attention(q, k, v, attn_bias=None, p=0.0, scale=None, op=None):
        assert all(t.stride(-1) == 1 for t in (q, k, v)), "stride(-1) == 1"
        assert q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0, "head sizes aligned to 8"
        grouped = q.dim() == 5
        calls.append({"bias": attn_bias, "op": op, "grouped": grouped})
        if grouped:  # (B, N, G, H/G, D): K and V expanded over each group, never copied
            assert k.stride(3) == 0 and v.stride(3) == 0, "grouped K/V must be expanded views"
            assert not any(t.requires_grad for t in (q, k, v)), "xFormers' grouped layout is forward-only"
            q, k, v = (t.flatten(2, 3) for t in (q, k, v))  # (B, N, H, D)
        b, nq, h, _ = q.shape
        nk = k.shape[1]
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale  # (B, H, Nq, Nk)
        if isinstance(attn_bias, torch.Tensor):
            assert attn_bias.dtype == q.dtype
            if grouped:
                assert attn_bias.dim() == 5
                attn_bias = attn_bias.flatten(1, 2)  # (B, G, H/G, Nq, Nk) -> (B, H, Nq, Nk)
            assert attn_bias.shape == (b, h, nq, nk)
            assert all(attn_bias.stride(i) % 8 == 0 for i in range(3)), "bias rows aligned to 8"
            s = s + attn_bias.double()
        elif attn_bias is not None:
            s = s + attn_bias.materialize((b, h, nq, nk), dtype=torch.float64)  # xFormers' definition
        pr = torch.softmax(s, dim=-1)  # an all -inf row gives NaN here, as it would in a kernel
        out = torch.einsum("bhqk,bkhd->bqhd", pr, v.double()).to(q.dtype)  # (B, Nq, H, Dv)
        return out

    def memory_efficient_attention_grouped(q, k, v, **kw):
        out = memory_efficient_attention(q, k, v, **kw)  # (B, N, H, Dv)
        # grouped inputs give a grouped output (B, N, G, H/G, Dv), xFormers' layout
        return out.unflatten(2, (q.shape[2], -1)) if q.dim() == 5 else out

    all_types = (
        type(None),
        torch.Tensor,
        ab.LowerTriangularMask,
        ab.LowerTriangularFromBottomRightMask,
        ab.LowerTriangularFromBottomRightLocalAttentionMask,
        ab.LocalAttentionFromBottomRightMask,
    )

    def dispatch_fw(inp, grad):
        # as on a GPU: no operator takes a two-sided local window in float32 (cutlass has no such
        # type, flash no float32)
        if (
            isinstance(inp["attn_bias"], ab.LocalAttentionFromBottomRightMask)
            and inp["query"].dtype == torch.float32
        ):
            raise NotImplementedError(
                "No operator found for `memory_efficient_attention_forward` with inputs:"
            )
        return SimpleNamespace(NAME="fakeF")

    def forward_only(q, k, v, op=None):  # what the probe calls, with xFormers' gate and refusals
        if not fake.fmha.common._built_with_cuda:
            raise NotImplementedError(
                "No operator found for `memory_efficient_attention_forward` with inputs:\n"
                "`cutlassF-pt` is not supported because:\n"
                f"    {xf.GATE_WORDS}\n"
            )
        reasons = [] if op is None else op.not_supported_reasons({"query": q, "attn_bias": None})
        if reasons:
            raise ValueError(
                "Operator `memory_efficient_attention` does not support inputs:\n"
                f"`{op.NAME}` is not supported because:\n    " + "\n    ".join(reasons) + "\n"
            )
        return memory_efficient_attention(q, k, v, scale=1.0)

    fake = SimpleNamespace(
        memory_efficient_attention=memory_efficient_attention_grouped,
        memory_efficient_attention_forward=forward_only,
        calls=calls,
        fmha=SimpleNamespace(
            attn_bias=ab,
            common=SimpleNamespace(Inputs=lambda **kw: kw, _built_with_cuda=True),
            dispatch=SimpleNamespace(
                _dispatch_fw=dispatch_fw,
                _dispatch_bw=lambda inp, varlen_lse_packed: SimpleNamespace(NAME="fakeB"),
            ),
            cutlass=_family(
                "cutlassF-pt", "cutlassB-pt", all_types[:3] + all_types[4:5]
            ),  # no two-sided window
            flash=_family(
                "fa2F@2.8-pt", "fa2B@2.8-pt", all_types[:1] + all_types[2:], (torch.float16, torch.bfloat16)
            ),
            triton_splitk=_family("triton_splitKF", None, all_types[:2]),
        ),
    )
    monkeypatch.setattr(xf, "load_xformers", lambda: fake)
    monkeypatch.setattr(xf, "_PROBED", {})
    monkeypatch.setattr(xf, "probe_input", lambda device, dtype: torch.zeros(1, 8, 1, 8, dtype=dtype))
    monkeypatch.setattr(xf.XFormersAttention, "_dispatch_cache", {})
    return fake


def _on_cpu(attn: xf.XFormersAttention) -> xf.XFormersAttention:
    attn.check = lambda w: None  # the real check refuses the CPU; forward does the rest as on CUDA
    return attn


XF_CASES = [
    *(c for c in CASES if not (c.bias or c.sinks or c.softcap)),
    Case("odd_dims", d=3, dv=5, padding=True),
    Case("window_both_ways", h=4, hkv=2, window=3),
    Case("window_short_q", nq=8, nk=24, causal=True, window=4),
]


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("case", XF_CASES, ids=lambda c: c.id)
def test_xformers_cuda_path_against_an_emulated_kernel(fake_xformers, case, grad):
    # the layout change, grouped heads, bias translation, alignment padding and empty-row fix, on CPU
    attn = _on_cpu(variants.build("xformers"))
    q, k, v, kw = make_inputs(case, requires_grad=grad)
    if kw["key_padding_mask"] is not None:
        kw["key_padding_mask"][0] = False  # batch element 0 sees no key: never NaN, zeros
    out = attn(q, k, v, **kw)
    assert out.shape == (case.b, case.h, case.nq, case.dv)
    assert rel_err(out, oracle(attn, q, k, v, **kw)) <= 1e-5
    call = fake_xformers.calls[-1]
    assert call["grouped"] == (case.hkv not in (None, case.h) and not grad)
    assert attn.gqa_layout == (None if case.hkv in (None, case.h) else "repeated" if grad else "grouped 5-D")
    masked = kw["key_padding_mask"] is not None or kw.get("attn_mask") is not None
    no_operator_takes_the_type = case.window is not None and not case.causal  # float32, two-sided window
    # a dense bias only where a mask asks for one, or no operator takes xFormers' type
    assert isinstance(call["bias"], torch.Tensor) == (masked or no_operator_takes_the_type)
    assert attn.bias_kind == xf.bias_kind(call["bias"])
    if grad:
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        assert attn.op_bw_ran == "fakeB"
    if kw["key_padding_mask"] is not None:
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        if grad:
            assert torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))
    assert attn.op_ran == "fakeF" and attn.describe()["op_ran"] == "fakeF"


@needs_xformers
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nq, nk", [(9, 9), (4, 13), (1, 13)])
@pytest.mark.parametrize("window", [0, 1, 3, 12, None])
def test_xformers_bias_types_are_local_windows_pattern(nq, nk, window, causal):
    # xFormers' own definition of each type (materialize) against local_window's pattern
    from xformers.ops import fmha

    xops = SimpleNamespace(fmha=fmha)
    bias = xf.typed_bias(xops, nq, nk, causal=causal, window=window)
    visible = (
        torch.ones(nq, nk, dtype=torch.bool)
        if bias is None
        else torch.isfinite(bias.materialize((nq, nk), dtype=torch.float32))
    )
    expected = LocalWindowAttention(window=nk if window is None else window).pattern(nq, nk, causal)
    assert torch.equal(visible, expected)


def test_a_window_becomes_a_type_in_half_precision_and_a_dense_bias_where_no_operator_takes_it(fake_xformers):
    ab = fake_xformers.fmha.attn_bias
    q, k, v, kw = make_inputs(Case("w", h=4, hkv=2), dtype=torch.float16)
    attn = _on_cpu(variants.build("xformers", window=3))
    out16 = attn(q, k, v)
    assert isinstance(fake_xformers.calls[-1]["bias"], ab.LocalAttentionFromBottomRightMask)
    out32 = attn(q.float(), k.float(), v.float())  # no operator takes that type in float32: dense
    assert attn.bias_kind.startswith("dense") and isinstance(fake_xformers.calls[-1]["bias"], torch.Tensor)
    ref = oracle(attn, q.double(), k.double(), v.double())
    assert rel_err(out32, ref) <= 1e-5 and rel_err(out16, ref) <= 2e-3
    # a call's window narrower than the knob wins; a wider one does not widen it
    narrow = attn(q.float(), k.float(), v.float(), window=1)
    assert (
        rel_err(narrow, oracle(variants.build("xformers", window=1), q.double(), k.double(), v.double()))
        <= 1e-5
    )
    wide = attn(q.float(), k.float(), v.float(), window=7)
    assert torch.equal(wide, out32)


@pytest.mark.parametrize(
    "op, fw, bw", [("cutlass", "cutlassF-pt", "cutlassB-pt"), ("flash", "fa2F@2.8-pt", "fa2B@2.8-pt")]
)
def test_a_forced_operator_is_passed_to_xformers_and_recorded(fake_xformers, op, fw, bw):
    attn = _on_cpu(variants.build("xformers", op=op))
    q, k, v, kw = make_inputs(Case("causal_grad", causal=True), dtype=torch.float16, requires_grad=True)
    out = attn(q, k, v, **kw)
    assert [o.NAME for o in fake_xformers.calls[-1]["op"]] == [fw, bw]
    assert (attn.op_ran, attn.op_bw_ran) == (fw, bw)
    assert rel_err(out, oracle(attn, q.double(), k.double(), v.double(), **kw)) <= 2e-3


def test_a_forced_operator_that_cannot_take_the_input_is_refused_in_its_words(fake_xformers):
    q, k, v, kw = make_inputs(Case("plain"))  # float32: the fake flash takes fp16 and bf16 only
    with pytest.raises(Unsupported) as e:
        _on_cpu(variants.build("xformers", op="flash"))(q, k, v)
    msg = str(e.value)
    assert (
        msg.startswith("xformers op=flash cannot run this input: fa2F@2.8-pt: dtype=torch.float32")
        and "\n" not in msg
    )
    # a type the forced operator lacks becomes a dense bias rather than a refusal
    attn = _on_cpu(variants.build("xformers", op="triton_splitk", window=2))
    qd, kd, vd, kwd = make_inputs(Case("decode", nq=1, nk=24, causal=True), dtype=torch.float16)
    out = attn(qd, kd, vd, causal=True)
    assert attn.bias_kind == f"dense {(qd.shape[0], qd.shape[1], 1, 24)}" and attn.op_ran == "triton_splitKF"
    assert rel_err(out, oracle(attn, qd.double(), kd.double(), vd.double(), causal=True)) <= 2e-3


def test_op_knob_values_and_forward_only_operators_are_refused_in_one_line(fake_xformers):
    with pytest.raises(
        ValueError,
        match="xformers op must be one of auto, cutlass, flash, flash3, triton_splitk, ck; got 'fa3'",
    ):
        variants.build("xformers", op="fa3")
    with pytest.raises(ValueError, match="window must be an integer >= 0"):
        variants.build("xformers", window=-1)
    attn = variants.build("xformers", op="triton_splitk")
    w = variants.Workload(1, 2, 4, 4, 8, 8, device="cuda", dtype=torch.float16, backward=True)
    with pytest.raises(
        Unsupported, match=r"^xformers op=triton_splitk has no backward operator \(forward only"
    ):
        attn.check(w)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float16, requires_grad=True)
    with pytest.raises(Unsupported, match="has no backward operator"):
        _on_cpu(attn)(q, q, q)
    fake_xformers.fmha.ck = None  # an xFormers without that family
    with pytest.raises(Unavailable, match="this xformers has no operator family 'ck'"):
        variants.build("xformers", op="ck").check(CUDA_FP16)


def test_an_extension_that_did_not_load_does_not_refuse_an_operator_that_runs(fake_xformers, monkeypatch):
    # xFormers 0.0.35 built for torch 2.10 on another torch: cutlass and flash call PyTorch's kernels
    monkeypatch.setattr(xf, "extension_failure", lambda: BUILT_FOR_OTHER_TORCH)
    attn = variants.build("xformers")
    attn.check(CUDA_FP16)  # the probe's real call succeeded: not refused
    assert attn.describe()["xformers_extension"] == f"not loaded: {BUILT_FOR_OTHER_TORCH}"
    monkeypatch.setattr(xf, "extension_failure", lambda: None)
    attn.check(CUDA_FP16)
    assert attn.describe()["xformers_extension"] == "loaded"


def test_no_operator_that_runs_is_unavailable_in_xformers_words_with_the_extension_note(
    fake_xformers, monkeypatch
):
    monkeypatch.setattr(xf, "extension_failure", lambda: BUILT_FOR_OTHER_TORCH)

    def no_operator(q, k, v, op=None):
        raise NotImplementedError(
            "No operator found for `memory_efficient_attention_forward` with inputs:\n"
            "     query       : shape=(1, 8, 1, 8) (torch.float16)\n"
            "`cutlassF-pt` is not supported because:\n"
            "    operator wasn't built\n"
        )

    fake_xformers.memory_efficient_attention_forward = no_operator
    with pytest.raises(Unavailable) as e:
        variants.build("xformers").check(CUDA_FP16)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("xformers cannot run on this machine: No operator found")
    assert "cutlassF-pt: operator wasn't built" in msg and "built for torch 2.10.0+cu128 (CUDA 12.8)" in msg
    with pytest.raises(Unavailable, match="^xformers op=cutlass cannot run on this machine"):
        variants.build("xformers", op="cutlass").check(CUDA_FP16)


def test_xformers_gate_refuses_everything_until_lifted(fake_xformers, monkeypatch):
    # seen on an H200: xFormers 0.0.35 built for torch 2.10, torch 2.11: its gate refuses every CUDA
    # operator, also those that call PyTorch's kernels; lift_gate=true lets those run, and says so
    monkeypatch.setattr(xf, "extension_failure", lambda: BUILT_FOR_OTHER_TORCH)
    fake_xformers.fmha.common._built_with_cuda = False
    with pytest.raises(Unavailable) as e:
        variants.build("xformers").check(CUDA_FP16)
    msg = str(e.value)
    assert xf.GATE_WORDS in msg and msg.endswith(xf.GATE_HINT) and "\n" not in msg
    attn = variants.build("xformers", lift_gate=True)
    attn.check(CUDA_FP16)
    assert fake_xformers.fmha.common._built_with_cuda is True
    assert attn.describe()["xformers_extension"].endswith(
        "CUDA gate lifted for this process (lift_gate=true)"
    )
    assert attn.knobs()["lift_gate"] is True
    # once the operator runs here, a dtype it does not take is unsupported, in its words
    w32 = variants.Workload(1, 2, 4, 4, 8, 8, device="cuda", dtype=torch.float32)
    with pytest.raises(
        Unsupported, match=r"^xformers op=flash cannot run float32: .*fa2F@2.8-pt: dtype=torch.float32"
    ):
        variants.build("xformers", op="flash", lift_gate=True).check(w32)
    with pytest.raises(ValueError, match="lift_gate must be true or false"):
        variants.build("xformers", lift_gate="yes")


def test_xformers_bias_keeps_the_broadcast_shape_for_key_padding():
    kpm = torch.ones(2, 13, dtype=torch.bool)
    kpm[1, 10:] = False
    bias, empty = xf.additive_bias(
        2, 4, 9, 13, causal=False, key_padding_mask=kpm, attn_mask=None, dtype=torch.float16, device="cpu"
    )
    assert bias.shape == (2, 4, 9, 13) and empty is None
    assert bias.stride()[1:3] == (0, 0)  # (B, 1, 1, Nk) expanded: O(B Nk) memory, not O(B H Nq Nk)
    assert bias.stride(0) % 8 == 0
    assert torch.equal(bias[1, 0, 0, 10:], torch.full((3,), float("-inf"), dtype=torch.float16))
    assert torch.equal(bias[0], torch.zeros_like(bias[0]))
