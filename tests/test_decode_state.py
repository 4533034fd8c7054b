"""Registry-wide tests of the decoding state (``supports_state``, ``prefill``, ``step``, ``state_bytes``).

Every registered variant that claims ``supports_state`` decodes token by token through ``step`` and
must give the rows of its causal forward, checked against the float64 oracle; its state must stay
the size ``state_bytes`` says, whatever the context. A variant without the fact refuses ``prefill``
and ``step`` with the reason, and its ``state_bytes`` is the K/V cache, linear in the context.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import variants
from variants import Unsupported, Workload, oracle

from .helpers import DEVICES, Case, make_inputs, oracle_hint, param_id, rel_err, variant_params

STATEFUL = [p for p in variant_params() if variants.get(p[0]).supports_state]
STATELESS = [p for p in variant_params() if not variants.get(p[0]).supports_state]

# grouped heads, a head size other than the values', a scale of its own, and a prefix of 10 tokens
CASE = Case("decode_state", b=2, h=4, hkv=2, nq=24, nk=24, d=8, dv=6, causal=True)
PREFIX = 10
SCALE = 0.4


def _left_padded(case: Case, device: str) -> torch.Tensor:
    """``(B, N)``: the second sequence starts with 3 padded keys (decode batches pad on the left)."""
    kpm = torch.ones(case.b, case.nk, dtype=torch.bool)
    kpm[1, :3] = False
    return kpm.to(device)


def _state_tensors(state: object) -> list[torch.Tensor]:
    """The tensors a state holds (a dataclass's fields or a tuple's items)."""
    # fields read as they are: astuple deep-copies, which a state carrying autograd history (a learned
    # gate's) refuses
    if dataclasses.is_dataclass(state):
        items = tuple(getattr(state, f.name) for f in dataclasses.fields(state))
    else:
        items = tuple(state)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _bytes_per_sequence(state: object) -> int:
    """One sequence's share of the state: each tensor's first (batch, or shared: 1) slice."""
    return sum(t[:1].nbytes for t in _state_tensors(state))


def _workload(nk: int, dtype: torch.dtype = torch.float32) -> Workload:
    return Workload(
        batch=1, heads=8, nq=1, nk=nk, head_dim=64, v_head_dim=64, dtype=dtype, causal=True, kv_heads=2
    )


def _build(name: str, knobs: dict, device: str) -> variants.AttentionVariant:
    torch.manual_seed(1)
    return variants.build(name, heads=CASE.h, head_dim=CASE.d, **knobs).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vp", STATEFUL, ids=param_id)
def test_decoding_token_by_token_gives_the_causal_rows(vp, device):
    name, knobs = vp
    attn = _build(name, knobs, device)
    q, k, v, _ = make_inputs(CASE, device=device)
    kpm = _left_padded(CASE, device)
    scale = SCALE if attn.supports_scale else None  # normalised linear: a scale cancels, it has none
    state = attn.prefill(
        k[:, :, :PREFIX], v[:, :, :PREFIX], key_padding_mask=kpm[:, :PREFIX], heads=CASE.h, scale=scale
    )
    first = _bytes_per_sequence(state)
    outs = []
    for t in range(PREFIX, CASE.nk):
        out, state = attn.step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        outs.append(out)
    got = torch.cat(outs, 2)  # (B, H, N - PREFIX, Dv)
    kw = dict(causal=True, key_padding_mask=kpm, scale=scale)
    want = oracle(attn, q, k, v, **kw)[:, :, PREFIX:]
    err = rel_err(got, want)
    assert err <= 1e-5, "decoding through step: " + oracle_hint(name, err, 1e-5)
    assert rel_err(got, attn(q, k, v, **kw)[:, :, PREFIX:]) <= 1e-5
    assert _bytes_per_sequence(state) == first  # 14 tokens later, not one byte more


@pytest.mark.parametrize("vp", STATEFUL, ids=param_id)
def test_decoding_from_no_context_and_several_tokens_a_step(vp):
    name, knobs = vp
    attn = _build(name, knobs, "cpu")
    q, k, v, _ = make_inputs(CASE)
    want = oracle(attn, q, k, v, causal=True)
    state, outs = None, []
    for s, e in [(0, 1), (1, 2), (2, 9), (9, 24)]:  # one token, one more, then 7 and 15 at once
        out, state = attn.step(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], state)
        outs.append(out)
    err = rel_err(torch.cat(outs, 2), want)
    assert err <= 1e-5, "decoding through step: " + oracle_hint(name, err, 1e-5)


@pytest.mark.parametrize("vp", STATEFUL, ids=param_id)
def test_state_bytes_is_the_state_and_constant_in_the_context(vp):
    name, knobs = vp
    attn = _build(name, knobs, "cpu")
    _, k, v, _ = make_inputs(CASE)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        state = attn.prefill(k.to(dtype), v.to(dtype), heads=CASE.h)
        w = Workload(
            batch=CASE.b, heads=CASE.h, nq=1, nk=CASE.nk, head_dim=CASE.d, v_head_dim=CASE.dv, dtype=dtype,
            causal=True, kv_heads=CASE.hkv,
        )  # fmt: skip
        assert attn.state_bytes(w) == _bytes_per_sequence(state), dtype
    sizes = {attn.state_bytes(_workload(n)) for n in (1024, 8192, 131072)}
    assert len(sizes) == 1


@pytest.mark.parametrize("vp", STATELESS, ids=param_id)
def test_without_the_fact_prefill_and_step_refuse_and_the_cache_grows(vp):
    name, knobs = vp
    attn = _build(name, knobs, "cpu")
    _, k, v, _ = make_inputs(CASE)
    with pytest.raises(Unsupported, match="K/V cache"):
        attn.prefill(k, v, heads=CASE.h)
    with pytest.raises(Unsupported, match="K/V cache"):
        attn.step(k[:, :, :1], k[:, :, :1], v[:, :, :1], None)
    # Hkv * (the cached keys a step reads) * (D + Dv) elements of fp32: every key, unless the reach
    # is bounded (then test_a_bounded_reach_keeps_only_what_decoding_reads checks the bound)
    for n in (1024, 131072):
        assert 1 <= attn.cache_len(n) <= n
        assert attn.state_bytes(_workload(n)) == 2 * attn.cache_len(n) * 128 * 4
    if type(attn).cache_len is variants.AttentionVariant.cache_len:
        assert attn.state_bytes(_workload(131072)) == 128 * attn.state_bytes(_workload(1024))


@pytest.mark.parametrize(
    "vp",
    [p for p in STATELESS if variants.get(p[0]).cache_len is not variants.AttentionVariant.cache_len],
    ids=param_id,
)
def test_a_bounded_reach_keeps_only_what_decoding_reads(vp):
    """A variant that says a step reads only ``cache_len`` cached keys (the last ones, and the first
    ``sink_tokens`` where it keeps attention sinks: StreamingLLM's cache) gives the same decoding rows
    from that much of the cache as from all of it (against the float64 oracle on the whole cache)."""
    name, knobs = vp
    attn = _build(name, knobs, "cpu")
    q, k, v, _ = make_inputs(CASE)
    nq = 3  # the last three positions, decoded against the cache before them
    keep = attn.cache_len(CASE.nk - nq) + nq
    assert keep < CASE.nk, "the case must be long enough for the bound to cut the cache"
    head = getattr(attn, "sink_tokens", 0)  # the first keys, kept with the last keep - head
    idx = torch.cat([torch.arange(head), torch.arange(CASE.nk - keep + head, CASE.nk)])  # (keep,)
    want = oracle(attn, q[:, :, -nq:], k, v, causal=True)
    got = attn(q[:, :, -nq:], k[:, :, idx], v[:, :, idx], causal=True)
    assert rel_err(got, want) <= 1e-5, oracle_hint(name, rel_err(got, want), 1e-5)
