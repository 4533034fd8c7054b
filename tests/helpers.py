"""Shared pieces of the registry-wide tests: cases, inputs and the error measure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import variants
from variants import AttentionVariant, Workload


@dataclass(frozen=True)
class Case:
    """One call shape and mask combination."""

    id: str
    b: int = 2
    h: int = 3
    nq: int = 24
    nk: int = 24
    d: int = 8
    dv: int = 8
    causal: bool = False
    padding: bool = False
    mask: bool = False
    hkv: int | None = None  # key/value heads (None: = h)
    scale: float | None = None
    bias: bool = False  # a random float bias of shape (H, Nq, Nk)
    cross: bool = False  # the queries are another sequence (cross-attention)
    sinks: str | None = None  # "head": one sink logit per head (gpt-oss); "query": per head and query
    softcap: float | None = None  # Gemma2's soft-capping of the scores
    window: int | None = None  # a model's sliding window (|p - j| <= window)


CASES = [
    Case("plain"),
    Case("causal", causal=True),
    Case("padding", padding=True),
    Case("causal_padding", causal=True, padding=True),
    Case("attn_mask", mask=True),
    Case("short_q", nq=16, nk=24, dv=6),  # the last 16 positions of the keys' sequence, both ways
    Case("short_q_padding", nq=12, nk=24, padding=True),
    Case("cross", nq=24, nk=16, cross=True),  # more queries than keys: cross-attention only
    Case("cross_short", nq=16, nk=24, dv=6, padding=True, cross=True),  # an encoder longer than the decoder
    Case("gqa", h=4, hkv=2, causal=True),
    Case("mqa_padding", h=4, hkv=1, padding=True),
    Case("decode", nq=1, nk=24, causal=True, padding=True),
    Case("decode_gqa", h=4, hkv=2, nq=1, nk=24, causal=True),
    Case("prefill_onto_cache", nq=8, nk=24, causal=True, padding=True),
    Case("scale", scale=0.3, causal=True),
    Case("bias", bias=True, causal=True, padding=True),
    Case("sinks", h=4, hkv=2, causal=True, padding=True, sinks="head"),
    Case("sinks_per_query", nq=8, nk=24, causal=True, bias=True, sinks="query"),
    Case("sinks_masked", causal=True, mask=True, bias=True, sinks="query"),  # Nq == Nk, every row its own
    Case("softcap", h=4, hkv=2, causal=True, padding=True, bias=True, softcap=0.8),  # bites at |s| ~ 1
    Case("window", h=4, hkv=2, causal=True, padding=True, window=2),  # narrower than local_window's
    Case("window_decode", nq=4, nk=24, causal=True, window=2),
]


#: what every sweep a test starts runs with, unless the test sets the knob itself: no waiting for the
#: machine to go quiet and no second attempt for a slow machine or an unstable figure. Both read the
#: real host (its load, the speed of its canary), so a test that left them on would run differently on
#: a busy machine; the tests of settling and retrying set them, and fake the state they read. No
#: roofline either (3.3 s of GEMM and copies in each sweep's first job on the project's VM): the tests
#: of the ceilings and of the report's share of them turn it on.
MACHINE_INDEPENDENT = {"settle_s": 0, "retry_unstable": 0, "roofline": "false"}


def sweep_overrides(*args: str) -> list[str]:
    """``args`` plus :data:`MACHINE_INDEPENDENT` for each knob ``args`` does not set."""
    given = {a.split("=", 1)[0].lstrip("+~") for a in args}
    return [*args, *(f"{k}={v}" for k, v in MACHINE_INDEPENDENT.items() if k not in given)]


NO_CUDA = "no CUDA GPU here (torch.cuda.is_available() is False); on a GPU machine run: pytest -m cuda"

#: the devices the registry-wide tests run on: CUDA ones carry the ``cuda`` mark (``pytest -m cuda``)
#: and are skipped, with the reason, where torch sees no GPU
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)],
    ),
]


def variant_params() -> list[tuple[str, dict]]:
    """(name, knobs) for every registered variant and each of its example knob sets."""
    return [(n, dict(kn)) for n in variants.available() for kn in variants.get(n).example_knobs]


def param_id(p: tuple[str, dict]) -> str:
    name, knobs = p
    return name + "".join(f"-{k}={v}" for k, v in knobs.items())


def make_inputs(case: Case, dtype=torch.float32, requires_grad=False, seed=0, device="cpu"):
    """q, k, v and the mask keywords of ``case``, drawn on the CPU (the same numbers on every device)
    and moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    hkv = case.hkv or case.h
    q = torch.randn(case.b, case.h, case.nq, case.d, generator=g, dtype=torch.float64)
    k = torch.randn(case.b, hkv, case.nk, case.d, generator=g, dtype=torch.float64)
    v = torch.randn(case.b, hkv, case.nk, case.dv, generator=g, dtype=torch.float64)
    q, k, v = (t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in (q, k, v))
    kpm = None
    if case.padding:
        kpm = torch.ones(case.b, case.nk, dtype=torch.bool)
        kpm[-1, case.nk - 5 :] = False  # the last sequence has 5 padded keys
    am = None
    if case.mask:
        am = torch.rand(case.b, case.h, case.nq, case.nk, generator=g) > 0.3
    kpm, am = (None if m is None else m.to(device) for m in (kpm, am))
    kw = dict(causal=case.causal, key_padding_mask=kpm, attn_mask=am)
    if case.scale is not None:
        kw["scale"] = case.scale
    if case.cross:
        kw["cross"] = True
    if case.sinks is not None:  # logits around the scores' own size, so the sink takes a real share
        shape = (case.h,) if case.sinks == "head" else (case.b, case.h, case.nq)
        kw["sinks"] = (1.5 * torch.randn(shape, generator=g)).to(device=device, dtype=dtype)
    if case.softcap is not None:
        kw["softcap"] = case.softcap
    if case.window is not None:
        kw["window"] = case.window
    if case.bias:  # an ALiBi-sized spread of values, per head, query and key
        kw["bias"] = (2 * torch.randn(case.h, case.nq, case.nk, generator=g)).to(device=device, dtype=dtype)
    return q, k, v, kw


def build(name: str, knobs: dict, case: Case, device: str = "cpu") -> AttentionVariant:
    torch.manual_seed(1)  # learned variants get the same parameters in every test
    return variants.build(name, heads=case.h, head_dim=case.d, **knobs).to(device)


def workload(case: Case, dtype=torch.float32, backward=False, device="cpu") -> Workload:
    return Workload(
        batch=case.b,
        heads=case.h,
        nq=case.nq,
        nk=case.nk,
        head_dim=case.d,
        v_head_dim=case.dv,
        device=device,
        dtype=dtype,
        causal=case.causal,
        key_padding=case.padding,
        attn_mask=case.mask,
        backward=backward,
        kv_heads=case.hkv,
        scale=case.scale,
        bias=case.bias,
        cross=case.cross,
        sinks=case.sinks is not None,
        softcap=case.softcap,
        window=case.window,
    )


def flags_allow(cls: type[AttentionVariant] | AttentionVariant, w: Workload) -> bool:
    """What the capability facts alone say about ``w`` (the tests' independent expectation): a
    class's, or an instance's where a knob changes one (linear's ``normalize`` and ``scale``)."""
    return (
        w.device in cls.devices
        and w.dtype in cls.dtypes
        and (not w.causal or (cls.supports_causal and w.nq <= w.nk))
        and (w.causal or cls.supports_noncausal)
        and (not w.key_padding or cls.supports_key_padding)
        and (not w.attn_mask or cls.supports_attn_mask)
        and (w.nq <= w.nk or cls.supports_cross)
        and (not w.cross or cls.supports_cross)
        and (not w.sinks or cls.supports_sinks)
        and (w.softcap is None or cls.supports_softcap)
        and (w.window is None or cls.native_window or cls.supports_attn_mask)
        and (w.nq >= w.nk or cls.supports_cross or cls.supports_decode)
        and (w.scale is None or cls.supports_scale)
        and (not w.bias or cls.supports_bias)
        and (not w.backward or w.device in cls.backward_devices)
    )


def oracle_hint(name: str, err: float, tol: float, case: Case | None = None) -> str:
    """The message of a failed comparison with :func:`variants.oracle`: the error, the call's features
    the variant claimed to take (``case``), and the hooks of the variant the oracle builds its expected
    output from (README, "Adding a variant")."""
    features = [f for f in ("bias", "sinks", "softcap", "window") if case is not None and getattr(case, f)]
    claimed = (
        f" This call passes {', '.join(f'{f}=' for f in features)}, which the variant says it takes "
        "(its supports_ facts): check that _attend applies it. Otherwise:"
        if features
        else ""
    )
    return (
        f"{name}: relative error {err:.3g} against the float64 oracle (allowed {tol:g}).{claimed} The oracle "
        "computes softmax(reference_scores(q, k)) over the pairs pattern() allows, plus the call's masks: a "
        "variant that scores pairs differently (a temperature, a bias of its own) overrides "
        "reference_scores(); one that skips pairs, pattern() (and num_pairs()/flops() follow it); one that "
        "is not a restricted softmax, oracle_forward()"
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error divided by the reference output's scale (its max abs value)."""
    out, ref = out.detach().double(), ref.detach().double()  # plain numbers: no graph to keep
    scale = ref.abs().max().clamp_min(1e-12)
    return float((out - ref).abs().max() / scale)


#: whether this process runs Triton's CPU interpreter (set for the child pytest of run_interpreted)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
#: a test that runs Triton kernels: only in the interpreted child (run_interpreted), skipped here
interpreted = pytest.mark.skipif(
    not INTERPRETING, reason="run under TRITON_INTERPRET=1 by test_interpreted_tests_pass, in a child pytest"
)


def run_interpreted(test_file: str) -> None:
    """Run ``test_file``'s tests in a child pytest with Triton's CPU interpreter on
    (``TRITON_INTERPRET=1``: Triton reads it when it is imported, so not in this process), and assert
    they all passed and none was skipped. The child leaves out slow tests and the wrapper calling this
    (named ``test_interpreted_tests_pass``)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-m", "not slow"]
    cmd += ["-k", "not test_interpreted_tests_pass"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


def c_compiler() -> str | None:
    """The C compiler the suite's kernels are built with (``$CC``, default ``cc``), if this machine has
    one on its PATH."""
    return shutil.which(os.environ.get("CC", "cc"))


#: a test of one of the suite's C kernels: skipped only where no C compiler exists. Where one does, a
#: kernel that does not build fails the test instead (``tests/test_kernels_build.py`` says why).
needs_c_compiler = pytest.mark.skipif(
    c_compiler() is None, reason="no C compiler here ($CC, or cc on the PATH)"
)
