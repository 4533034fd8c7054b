"""What ``AttentionVariant.forward`` holds every variant to, and what the facts a variant states must
mean, checked for every registered variant: it leaves its inputs as it found them and answers in
their dtype on their device; a claimed bias is read per batch row; an ``exact`` variant's oracle is
full attention. Each check is shown to fail on a variant built here to break it."""

from __future__ import annotations

import pytest
import torch

import variants
from variants import AttentionVariant, full_attention_reference, oracle

from .helpers import (
    DEVICES,
    Case,
    build,
    flags_allow,
    make_inputs,
    param_id,
    rel_err,
    variant_params,
    workload,
)

PARAMS = variant_params()
NaiveAttention = variants.get("naive")


# ------------------------------------------------------------------------------ forward's contract
@pytest.mark.parametrize("arg", ["q", "v", "key_padding_mask", "bias", "sinks"])
def test_a_variant_that_changes_an_input_in_place_is_an_error(arg):
    """A variant that doubled v in place got a valid record: the accuracy check ran on the doubled v."""

    class Mutates(NaiveAttention):
        def _attend(self, q, k, v, **kw):
            given = {"q": q, "v": v, **kw}
            if arg == "sinks":  # forward hands naive the sinks as one more key: the caller's are gone
                given["sinks"] = self.caller_sinks
            given[arg].mul_(2) if given[arg].is_floating_point() else given[arg][0, 0].fill_(False)
            return super()._attend(q, k, v, **kw)

    case = Case("all_inputs", causal=True, padding=True, bias=True, sinks="head")
    q, k, v, kw = make_inputs(case)
    attn = Mutates()
    attn.caller_sinks = kw["sinks"]
    with pytest.raises(RuntimeError, match=rf"Mutates._attend modified its input {arg} in place: [^\n]*$"):
        attn(q, k, v, **kw)
    # tensors made under inference_mode have no version counter: no edit can be seen, and none is
    # imagined (reading their _version would raise)
    with torch.inference_mode():
        q, k, v, kw = make_inputs(case)
        out = NaiveAttention()(q, k, v, **kw)
    assert rel_err(out, oracle(NaiveAttention(), q, k, v, **kw)) <= 1e-5


def test_an_output_of_another_dtype_or_device_is_an_error():
    """A float64 answer to a float32 call passed the float64 oracle check, and its record was valid."""

    class Float64(NaiveAttention):
        def _attend(self, q, k, v, **kw):
            return super()._attend(q.double(), k.double(), v.double(), **kw)

    class Elsewhere(NaiveAttention):
        def _attend(self, q, k, v, **kw):
            return super()._attend(q, k, v, **kw).to("meta")

    q, k, v, kw = make_inputs(Case("causal", causal=True))
    with pytest.raises(
        TypeError, match=r"Float64._attend returned float64 on cpu; expected the inputs' float32"
    ):
        Float64()(q, k, v, **kw)
    with pytest.raises(
        TypeError, match=r"Elsewhere._attend returned float32 on meta; expected [^\n]* on cpu$"
    ):
        Elsewhere()(q, k, v, **kw)


# ------------------------------------------------------------------------------ a batched bias
#: biases with a batch dimension, as models hand them: per row (transformers' 4-D additive masks) and
#: per key of each row (a padding bias); the registry-wide cases pass only per-head (H, Nq, Nk) ones
BATCHED_BIAS = [(2, 1, 24, 24), (2, 1, 1, 24)]
BIAS_CASE = Case("batched_bias", h=4, hkv=2, causal=True, padding=True)


def _batched_bias_error(attn: AttentionVariant, shape: tuple[int, ...], device: str = "cpu") -> float:
    """The relative error of ``attn`` against the float64 oracle on :data:`BIAS_CASE` with a random
    bias of ``shape``."""
    q, k, v, kw = make_inputs(BIAS_CASE, device=device)
    kw["bias"] = (2 * torch.randn(shape, generator=torch.Generator().manual_seed(7))).to(device)
    return rel_err(attn(q, k, v, **kw), oracle(attn, q, k, v, **kw))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", BATCHED_BIAS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("vp", [p for p in PARAMS if variants.get(p[0]).supports_bias], ids=param_id)
def test_a_bias_with_a_batch_dimension_matches_the_oracle(vp, shape, device):
    name, knobs = vp
    attn = build(name, knobs, BIAS_CASE, device)
    if not flags_allow(attn, workload(BIAS_CASE, device=device)):
        pytest.skip(f"{name} does not take this call (the registry-wide tests check its refusal)")
    assert _batched_bias_error(attn, shape, device) <= 1e-5


def test_the_batched_bias_check_catches_a_variant_that_reads_one_row():
    """Batch row 0's bias for every row: right on a per-head bias, the only kind checked before."""

    class FirstRowBias(NaiveAttention):
        def _attend(self, q, k, v, *, bias=None, **kw):
            if bias is not None and bias.dim() == 4:
                bias = bias[:1]
            return super()._attend(q, k, v, bias=bias, **kw)

    assert _batched_bias_error(FirstRowBias(), (4, 24, 24)) <= 1e-5  # what the old checks passed
    for shape in BATCHED_BIAS:
        assert _batched_bias_error(FirstRowBias(), shape) > 1e-2


# ------------------------------------------------------------------------------ what exact means
#: small calls on which an exact variant's oracle must be full attention: plain, causal, key padding,
#: and the last queries of a sequence (decoding against a cache)
EXACT_CASES = [
    Case("plain", b=2, h=2, nq=12, nk=12, d=4, dv=4),
    Case("causal_padding", b=2, h=2, nq=12, nk=12, d=4, dv=4, causal=True, padding=True),
    Case("prefill_onto_cache", b=2, h=2, nq=5, nk=12, d=4, dv=4, causal=True),
]


def _exact_deviation(attn: AttentionVariant) -> float:
    """The largest relative deviation of ``attn``'s oracle (what its outputs are checked against) from
    float64 full attention, over the :data:`EXACT_CASES` it takes."""
    worst = 0.0
    for case in EXACT_CASES:
        if flags_allow(type(attn), workload(case)):
            q, k, v, kw = make_inputs(case, dtype=torch.float64)
            worst = max(worst, rel_err(oracle(attn, q, k, v, **kw), full_attention_reference(q, k, v, **kw)))
    return worst


@pytest.mark.parametrize("vp", PARAMS, ids=param_id)
def test_an_exact_variant_s_oracle_is_full_attention(vp):
    """``exact`` says the output is full softmax attention; the registry-wide tests check the output
    against the variant's own oracle (its pattern and scores), so that oracle must be full attention."""
    name, knobs = vp
    attn = build(name, knobs, EXACT_CASES[0])
    if not attn.exact:
        pytest.skip(f"{name} is not exact: its oracle is its own pattern, scores or formula")
    assert _exact_deviation(attn) <= 1e-12, f"{name} says exact=True, but its oracle is not full attention"


def test_the_exact_check_catches_a_pattern_that_drops_a_key():
    """exact=True (the default) with a pattern() that leaves out key 0 for every query but the first:
    the variant agrees with its oracle, and the oracle is not full attention."""

    class DropsKeyZero(NaiveAttention):
        def pattern(self, nq, nk, causal=False):
            allowed = super().pattern(nq, nk, causal).clone()
            allowed[torch.arange(nq) + (nk - nq) > 0, 0] = False  # every position but 0 loses key 0
            return allowed

    assert DropsKeyZero.exact
    assert _exact_deviation(DropsKeyZero()) > 1e-2
