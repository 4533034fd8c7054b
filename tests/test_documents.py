"""Packed documents (``documents=K``): the lengths, the mask, the useful-pair count, the config checks
and a job end to end. Oracles: each document attended alone by a float64 formula written here, the
mask's pairs counted from the tensor, and what a config means by construction."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from experiments.measure.inputs import document_ids, document_lengths, make_inputs, pairs_kept
from experiments.measure.kernel import measure
from experiments.records.records import config_hash
from experiments.records.store import to_frame
from experiments.sweep.labels import job_label
from experiments.sweep.schema import validate
from variants import Unsupported, Workload, build
from variants.flex_kernel import tiles_per_head
from variants.masks import document_mask
from variants.reference import oracle
from variants.registry import available, get

from .test_decode_jobs import _conf
from .test_runner import job_cfg, job_spec


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Float64 softmax attention of one document's ``(H, nq, D)`` queries (its last ``nq`` positions)
    against its ``(H, nk, D)`` keys and values; causal: bottom-right."""
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = q.shape[-2], k.shape[-2]
        s = s.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def _assert_each_document_alone(out: torch.Tensor, inp, causal: bool, alone=_alone, **tol: float) -> None:
    """``out (B, H, Nq, Dv)``, a packed call's output, row by row equal to each document attended alone
    (``alone(q, k, v, causal)`` of one document's ``(H, n, D)`` tensors: :func:`_alone` by default);
    its queries are the last ``Nq`` positions, so a document holds those of its positions among them."""
    nq, nk = inp.q.shape[2], inp.k.shape[2]
    first = nk - nq
    for b, row in enumerate(inp.document_lengths):
        start = 0
        for n in row:
            a, end = max(start, first), start + n
            if a < end:
                qd, kd, vd = (
                    inp.q[b, :, a - first : end - first],
                    inp.k[b, :, start:end],
                    inp.v[b, :, start:end],
                )
                torch.testing.assert_close(
                    out[b, :, a - first : end - first].double(), alone(qd, kd, vd, causal), **tol
                )
            start = end


@pytest.mark.parametrize("seed", [0, 3])
def test_lengths_cut_each_row_into_that_many_documents(seed):
    rows = document_lengths(3, 100, 7, seed)
    assert len(rows) == 3 and all(len(r) == 7 and sum(r) == 100 and min(r) >= 1 for r in rows)
    assert len({tuple(r) for r in rows}) > 1  # each row is cut apart
    assert rows == document_lengths(3, 100, 7, seed)  # drawn from the seed
    assert document_lengths(1, 5, 5, seed) == [[1, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match="documents must be between 1 and"):
        document_lengths(1, 5, 6)


@pytest.mark.parametrize(
    "name,knobs",
    [
        ("sdpa", {}),
        ("naive", {}),
        ("chunked", {"query_chunk": 16, "key_chunk": 16}),
        ("flex", {"compile": False}),
    ],
)
@pytest.mark.parametrize("nq,causal", [(48, False), (48, True), (20, True), (20, False)])
def test_a_packed_call_attends_each_document_alone(name, knobs, nq, causal):
    """The packed call's output rows of each document equal that document attended on its own (with
    fewer queries than keys, each document's share of the last ``nq`` positions)."""
    inp = make_inputs(2, 2, nq, 48, 16, 16, dtype=torch.float32, device="cpu", documents=4, seed=1)
    out = build(name, **knobs)(inp.q, inp.k, inp.v, **inp.kwargs(causal)).double()
    _assert_each_document_alone(out, inp, causal, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_per_document_equals_its_mask_in_output_and_gradients(causal, monkeypatch):
    """sdpa's own path (one call per document) against the same call through the documents' mask, with
    grouped K/V heads, padded keys and fewer queries than keys: outputs and all three gradients."""
    inp = make_inputs(2, 4, 24, 40, 16, 16, dtype=torch.float64, device="cpu", documents=5, seed=3,
                      kv_heads=2, padding=0.1, requires_grad=True)  # fmt: skip
    attn = build("sdpa")
    grad = torch.randn(2, 4, 24, 16, dtype=torch.float64)
    w = Workload.of(inp.q, inp.k, inp.v, causal=causal, documents=inp.documents)
    assert attn.native_documents(w)
    own = attn(inp.q, inp.k, inp.v, **inp.kwargs(causal))
    own_g = torch.autograd.grad(own, [inp.q, inp.k, inp.v], grad)
    monkeypatch.setattr(type(attn), "native_documents", lambda self, w: False)
    masked = attn(inp.q, inp.k, inp.v, **inp.kwargs(causal))
    masked_g = torch.autograd.grad(masked, [inp.q, inp.k, inp.v], grad)
    torch.testing.assert_close(own, masked)
    for a, b in zip(own_g, masked_g, strict=True):
        torch.testing.assert_close(a, b)


def test_flex_reads_the_ids_into_one_cached_block_mask_that_skips_tiles():
    """flex keeps the documents as ids in its block mask (no dense mask), builds it once for the same
    ids tensor, and visits fewer tiles than plain causal attention (the tiles between documents)."""
    inp = make_inputs(1, 2, 1024, 1024, 16, 16, dtype=torch.float32, device="cpu", documents=8, seed=2)
    attn = build("flex", compile=False)
    for _ in range(2):
        attn(inp.q, inp.k, inp.v, **inp.kwargs(True))
    assert len(attn._flex._masks) == 1  # the second call reused the first one's block mask
    packed = next(iter(attn._flex._masks.values()))[0]
    causal = attn._flex.block_mask(inp.q, inp.k, True, None, None)
    assert tiles_per_head(packed) < 0.5 * tiles_per_head(causal)  # 8 documents in 8 tile rows


@pytest.mark.parametrize("causal,nq", [(True, 256), (False, 256), (True, 100)])
def test_chunked_skips_the_blocks_between_documents_and_keeps_its_gradients(causal, nq, monkeypatch):
    """chunked on the CPU reads the ids itself: its output and gradients equal those of the same call
    through the documents' dense mask, and it computes fewer blocks (those between documents skipped)."""
    import variants.chunked as chunked

    inp = make_inputs(2, 2, nq, 256, 16, 16, dtype=torch.float64, device="cpu", documents=6, seed=7,
                      padding=0.1, requires_grad=True)  # fmt: skip
    attn = build("chunked", query_chunk=32, key_chunk=32)
    assert attn.native_documents(Workload.of(inp.q, inp.k, inp.v, causal=causal, documents=inp.documents))
    blocks = []
    scores = chunked._scores
    monkeypatch.setattr(chunked, "_scores", lambda *a: blocks.append(a[2]) or scores(*a))
    grad = torch.randn(2, 2, nq, 16, dtype=torch.float64)

    def run():
        blocks.clear()
        out = attn(inp.q, inp.k, inp.v, **inp.kwargs(causal))
        return out, torch.autograd.grad(out, [inp.q, inp.k, inp.v], grad), len(blocks)

    own, own_g, own_blocks = run()
    monkeypatch.setattr(type(attn), "native_documents", lambda self, w: False)
    masked, masked_g, masked_blocks = run()
    torch.testing.assert_close(own, masked)
    for a, b in zip(own_g, masked_g, strict=True):
        torch.testing.assert_close(a, b)
    assert own_blocks < 0.7 * masked_blocks  # forward and backward both skip


def _feature(name: str, inp) -> dict:
    b, h, nq, nk = inp.q.shape[0], inp.q.shape[1], inp.q.shape[2], inp.k.shape[2]
    g = torch.Generator().manual_seed(9)
    return {
        "window": {"window": 3},
        "sinks": {"sinks": torch.randn(h, generator=g)},
        "attn_mask": {"attn_mask": torch.rand(b, 1, nq, nk, generator=g) > 0.3},
        "bias": {"bias": torch.randn(1, h, nq, nk, generator=g)},
        "padding": {"key_padding_mask": torch.arange(nk).expand(b, nk) < nk - 5},
    }[name]


@pytest.mark.parametrize("feature", ["window", "sinks", "attn_mask", "bias", "padding"])
@pytest.mark.parametrize(
    "name,knobs",
    [
        ("sdpa", {}),
        ("naive", {}),
        ("chunked", {"query_chunk": 8, "key_chunk": 8}),
        ("flex", {"compile": False}),
    ],
)
@pytest.mark.parametrize("nq", [32, 5])
def test_documents_beside_every_other_feature_give_the_oracles_output(feature, name, knobs, nq):
    """Packed documents with a window, sinks, a mask, a bias or padded keys (and fewer queries than
    keys): no variant drops either (sdpa's own per-document path must hand such calls to the mask)."""
    inp = make_inputs(2, 2, nq, 32, 16, 16, dtype=torch.float32, device="cpu", documents=3, seed=4)
    kw = {**inp.kwargs(True), **_feature(feature, inp)}
    attn = build(name, **knobs)
    try:
        out = attn(inp.q, inp.k, inp.v, **kw)
    except Unsupported:
        assert feature == "sinks" and not attn.supports_sinks
        return
    want = oracle(attn, inp.q, inp.k, inp.v, **kw)  # its documents checked alone in a test above
    torch.testing.assert_close(out.double(), want, rtol=2e-4, atol=2e-5)
    if nq == 32:  # every query: the documents change the output beside any of the features
        unpacked = oracle(attn, inp.q, inp.k, inp.v, **{k: v for k, v in kw.items() if k != "documents"})
        assert (want - unpacked).abs().max() > 1e-3


def test_documents_the_interface_cannot_mean_are_refused_in_one_line():
    q = torch.randn(1, 1, 6, 8)
    with pytest.raises(ValueError, match=r"documents must be integer ids"):
        build("naive")(q, q, q, documents=torch.zeros(1, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="not with cross-attention"):
        build("naive")(q, q, q, documents=torch.zeros(1, 6, dtype=torch.long), cross=True)
    with pytest.raises(ValueError, match="not with cross-attention"):
        build("naive")(q, q[:, :, :4], q[:, :, :4], documents=torch.zeros(1, 4, dtype=torch.long))


def test_ids_in_two_runs_are_refused_by_the_per_document_path():
    q = torch.randn(1, 1, 6, 8)
    ids = torch.tensor([[0, 0, 1, 1, 0, 0]])  # document 0 twice: the mask would join the runs
    with pytest.raises(ValueError, match="one id to two separate runs"):
        build("sdpa")(q, q, q, documents=ids)
    with pytest.raises(ValueError, match=r"documents must be integer ids \(B, Nk\)"):
        build("sdpa")(q, q, q, documents=torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize("name", available())
def test_every_variant_takes_packed_documents_or_says_why_not(name):
    """Registry-wide: a variant either refuses packed documents in one line, or its output is the
    float64 oracle's with the documents (whose per-document meaning the test above checks)."""
    cls = get(name)
    attn = build(name, heads=2, head_dim=16, **cls.example_knobs[0])
    inp = make_inputs(1, 2, 32, 32, 16, 16, dtype=torch.float32, device="cpu", documents=3, seed=5)
    w = Workload.of(inp.q, inp.k, inp.v, causal=True, documents=inp.documents)
    try:
        attn.check(w)
    except Unsupported as exc:
        plain = replace(w, documents=False)
        try:
            attn.check(plain)
        except Unsupported:
            return  # it cannot run this call at all (device, causal): nothing to say of documents
        assert "packed documents" in str(exc)
        return
    out = attn(inp.q, inp.k, inp.v, **inp.kwargs(True))
    want = oracle(attn, inp.q, inp.k, inp.v, **inp.kwargs(True))
    torch.testing.assert_close(out.double(), want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", available())
def test_a_document_whose_every_key_is_padding_gives_zeros(name, causal):
    """Registry-wide: a one-token document whose one key is padded leaves its query no key at all:
    zeros with finite gradients (the interface's rule), while the documents beside it keep the float64
    oracle's output (which attends each document alone, as the tests above check)."""
    cls = get(name)
    attn = build(name, heads=2, head_dim=16, **cls.example_knobs[0])
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g, requires_grad=True) for _ in range(3))
    ids = torch.tensor([[0] * 7 + [1] + [2] * 8])  # document 1 is the one token at position 7
    kpm = torch.ones(1, 16, dtype=torch.bool)
    kpm[0, 7] = False
    kw = {"causal": causal, "key_padding_mask": kpm, "documents": ids}
    try:
        attn.check(replace(Workload.of(q, k, v, **kw), backward=True))
    except Unsupported:
        return  # refused in one line before work (the test above checks the documents' reason)
    out = attn(q, k, v, **kw)
    assert torch.equal(out[0, :, 7], torch.zeros_like(out[0, :, 7]))
    want = oracle(attn, q.detach(), k.detach(), v.detach(), **kw)  # per document: checked above
    torch.testing.assert_close(out.detach().double(), want, rtol=2e-4, atol=2e-5)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(q.grad[0, :, 7], torch.zeros_like(q.grad[0, :, 7]))


@pytest.mark.parametrize("nq", [48, 20])
def test_the_oracle_attends_each_document_alone_in_every_row_it_checks(nq):
    """The float64 oracle the jobs check against, on all rows and on a subset (``rows``), against the
    per-document formula above."""
    inp = make_inputs(2, 2, nq, 48, 16, 16, dtype=torch.float64, device="cpu", documents=4, seed=6)
    naive, kw = build("naive"), inp.kwargs(True)
    rows = torch.tensor([0, nq // 2, nq - 1])
    whole, some = oracle(naive, *inp.tensors(), **kw), oracle(naive, *inp.tensors(), **kw, rows=rows)
    torch.testing.assert_close(some, whole[:, :, rows])
    _assert_each_document_alone(whole, inp, True)


@pytest.mark.parametrize("nq,nk,causal", [(40, 40, False), (40, 40, True), (9, 40, True), (9, 40, False)])
def test_pairs_kept_counts_the_masks_pairs(nq, nk, causal):
    """The share counted from the lengths equals the mask's own pairs (and causal's) over the call's."""
    lengths = document_lengths(3, nk, 5, seed=2)
    mask = document_mask(document_ids(lengths), nq)  # (B, 1, Nq, Nk)
    full = (
        torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq) if causal else torch.ones(nq, nk, dtype=torch.bool)
    )
    want = (mask & full).sum().item() / (3 * full.sum().item())
    assert pairs_kept(lengths, nq, causal) == pytest.approx(want, rel=1e-12)


def test_a_packed_job_counts_only_the_pairs_within_documents():
    spec = job_spec(
        variant="sdpa", seq_len=64, heads=2, head_dim=16, min_run_time=0.02, documents=4, causal=True
    )
    res = measure(spec)
    assert res["status"] == "ok", res
    f = res["figures"]
    assert f["valid"] is True and f["out_rel_err"] < 1e-5  # against the oracle, which got the same mask
    share = pairs_kept(document_lengths(1, 64, 4, spec.seed), 64, True)
    assert f["pairs_kept"] == pytest.approx(share) and share < 1
    causal_pairs = 64 * 65 // 2
    assert f["flops"] == pytest.approx(
        1 * 2 * causal_pairs * share * (2 * 16 + 2 * 16), abs=1
    )  # B*H*pairs*(2D+2Dv)
    assert "causal docs=4" in job_label(spec, "sdpa")


@pytest.mark.parametrize(
    "name,knobs",
    [
        ("sdpa", {}),
        ("local_window", {"window": 5}),
        ("local_window", {"window": 30}),
        ("window_linear", {"window": 5}),
    ],
)
@pytest.mark.parametrize("nq,causal", [(40, False), (40, True), (9, True)])
def test_a_packed_job_s_flops_count_its_pattern_within_each_document(name, knobs, nq, causal):
    """The useful pairs of a packed job are its pattern's pairs between a query and a key of the same
    document, counted here on the whole sequence's pattern matrix cut by the ids: a band's pairs
    across a document's edge are masked, not useful (window_linear: its window part's)."""
    spec = job_spec(
        variant=name, seq_len=nq, kv_len=40, heads=2, head_dim=16, documents=5, causal=causal, seed=3
    )
    w = spec.workload()
    variant = build(name, **knobs)
    near = variant.near if name == "window_linear" else variant  # its window part: the pairs it keeps
    ids = document_ids(document_lengths(1, 40, 5, spec.seed))  # (1, Nk)
    same = document_mask(ids, nq)[0, 0]  # (Nq, Nk): a query's own document's keys
    want = (near.pattern(nq, 40, causal) & same).sum().item()
    assert near.useful_pairs(w) == want
    unpacked = job_spec(variant=name, seq_len=nq, kv_len=40, heads=2, head_dim=16, causal=causal)
    assert want < near.num_pairs(nq, 40, causal) == near.useful_pairs(unpacked.workload())
    if name == "window_linear":  # the whole call: the window part's packed pairs, the linear part's work
        far = variant.flops(w) - near.flops(w)
        assert far == variant.flops(unpacked.workload()) - near.flops(unpacked.workload())


def test_a_variant_without_a_mask_refuses_packed_documents():
    res = measure(
        job_spec(variant="sparse", seq_len=64, heads=2, head_dim=16, min_run_time=0.02, documents=4)
    )
    assert res["status"] == "unsupported" and "takes no packed documents" in res["reason"]


@pytest.mark.parametrize("name", [n for n in available() if get(n).supports_attn_mask])
def test_every_variant_that_takes_a_mask_counts_only_the_kept_pairs(name):
    """A variant that takes packed documents (an attn_mask) must honour ``pair_share`` in its FLOPs."""
    w = Workload(batch=1, heads=2, nq=256, nk=256, head_dim=16, v_head_dim=16, attn_mask=True)
    variant = build(name)
    assert variant.flops(replace(w, pair_share=0.25)) < 0.3 * variant.flops(w)


@pytest.mark.parametrize(
    "over,msg",
    [
        (dict(documents=0), "documents must be between 1 and the keys' 1024 tokens"),
        (dict(documents=65, seq_len=64), "documents must be between 1 and the keys' 64 tokens"),
        (dict(documents=2, cross=True), "documents > 1 with cross=true"),
    ],
)
def test_bad_documents_are_one_line_errors(over, msg):
    with pytest.raises(ValueError, match=msg):
        validate(_conf(**over))


def test_one_document_is_the_unpacked_job():
    """documents=1 (the default) hashes as configs from before the setting, and old records read as 1."""
    cfg = job_cfg(variant="naive")
    assert cfg["documents"] == 1
    before = {k: v for k, v in cfg.items() if k != "documents"}
    assert config_hash(cfg) == config_hash(before)
    assert config_hash({**cfg, "documents": 4}) != config_hash(cfg)
    rec = {"config_hash": "x", "status": "ok", "_path": "r.json", "config": {**before, "seq_len": 64},
           "figures": {}, "env": {"host": "h"}}  # fmt: skip
    assert to_frame([rec])["documents"].tolist() == [1]


GATED = {"heads": 2, "head_dim": 16}
RECURRENCES = [
    ("ssd", GATED),
    ("gla", {**GATED, "gate_rank": 4}),
    ("deltanet", GATED),
    ("gated_deltanet", GATED),
    ("linear", {}),
    ("linear", {"normalize": False}),
    ("retention", {}),
    ("performer", {}),
]


def _own_formula(attn):
    """One document's ``(H, n, D)`` tensors through ``attn``'s float64 token-by-token recurrence
    (``oracle_forward``, written apart from its chunked form), from an empty state."""
    return lambda q, k, v, causal: attn.oracle_forward(q[None], k[None], v[None], causal=causal)[0]


@pytest.mark.parametrize("name,knobs", RECURRENCES)
@pytest.mark.parametrize("chunk", [64, 5, 1])
@pytest.mark.parametrize("nq", [48, 20])
def test_a_recurrence_starts_each_document_from_an_empty_state(name, knobs, chunk, nq):
    """A recurrence (gated, delta rule, kernelized) drops its state where a document begins: each
    document's rows equal its own recurrence from zero (chunks larger than a document, starts at every
    offset of a chunk, one position a chunk; fewer queries than keys, the earlier keys a state only)."""
    attn = build(name, chunk=chunk, **knobs)
    inp = make_inputs(2, 2, nq, 48, 16, 16, dtype=torch.float64, device="cpu", documents=4, seed=1)
    out = attn(inp.q, inp.k, inp.v, **inp.kwargs(True))
    _assert_each_document_alone(out, inp, True, alone=_own_formula(attn), rtol=1e-9, atol=1e-10)
    unpacked = attn(inp.q, inp.k, inp.v, causal=True)
    assert (out - unpacked).abs().max() > 1e-2  # the state did carry something across documents


@pytest.mark.parametrize("name,knobs", RECURRENCES)
def test_a_recurrence_s_gradients_stay_within_each_document(name, knobs):
    """Backward through the packed call equals backward through each document's own call: no gradient
    leaks across a boundary (q, k, v and the gate parameters, where there are any)."""
    attn = build(name, chunk=8, **knobs).double()
    inp = make_inputs(1, 2, 40, 40, 16, 16, dtype=torch.float64, device="cpu", documents=3, seed=2,
                      requires_grad=True)  # fmt: skip
    grad = torch.randn(1, 2, 40, 16, dtype=torch.float64)
    wrt = [inp.q, inp.k, inp.v, *attn.parameters()]
    packed = torch.autograd.grad(attn(inp.q, inp.k, inp.v, **inp.kwargs(True)), wrt, grad)
    parts, start = [], 0
    for n in inp.document_lengths[0]:
        sl = slice(start, start + n)
        parts.append(attn(inp.q[:, :, sl], inp.k[:, :, sl], inp.v[:, :, sl], causal=True))
        start += n
    alone = torch.autograd.grad(torch.cat(parts, 2), wrt, grad)
    for a, b in zip(packed, alone, strict=True):
        torch.testing.assert_close(a, b)


def test_a_long_context_carries_the_documents_across_its_segments(monkeypatch):
    """Keys before the queries are taken ``SEGMENT`` positions at a time: a document that spans two
    segments, and one that begins right at a segment's edge, still start from an empty state."""
    import variants.gated_core as gated_core

    monkeypatch.setattr(gated_core, "SEGMENT", 16)
    attn = build("gated_deltanet", heads=2, head_dim=16, chunk=4)
    inp = make_inputs(1, 2, 6, 64, 16, 16, dtype=torch.float64, device="cpu", documents=4, seed=3)
    inp.documents[0] = torch.arange(64).div(16, rounding_mode="floor").clamp(max=2)  # starts at 16, 32
    inp.document_lengths[0] = [16, 16, 32]
    out = attn(inp.q, inp.k, inp.v, **inp.kwargs(True))
    _assert_each_document_alone(out, inp, True, alone=_own_formula(attn), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["ssd", "linear"])
def test_a_recurrence_refuses_ids_it_cannot_follow(name):
    q = torch.randn(1, 8, 6, 64)
    with pytest.raises(ValueError, match="row 0 gives one id to two separate runs"):
        build(name)(q, q, q, causal=True, documents=torch.tensor([[0, 0, 1, 1, 0, 0]]))


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_a_kernelized_variant_refuses_documents_without_causal(name):
    """Its non-causal form is one state over the whole sequence: a document has no end there."""
    q = torch.randn(1, 8, 6, 64)
    with pytest.raises(Unsupported, match="takes packed documents causal only"):
        build(name)(q, q, q, documents=torch.tensor([[0, 0, 1, 1, 2, 2]]))
    build(name)(q, q, q)  # without the documents the call runs


# ---------------------------------------------------------------- the sliding window within documents


def _band_alone(window: int):
    """Float64 sliding-window attention of one document alone (the ``alone`` of
    :func:`_assert_each_document_alone`): the query at position ``p`` (bottom-right) sees keys ``j``
    with ``|p - j| <= window``, and ``j <= p`` when causal."""

    def alone(q, k, v, causal):
        nq, nk = q.shape[-2], k.shape[-2]
        p = torch.arange(nk - nq, nk)[:, None]  # (nq, 1): the queries' positions in the document
        j = torch.arange(nk)[None, :]  # (1, nk)
        seen = ((p - j).abs() <= window) & ((j <= p) | (not causal))  # (nq, nk)
        s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        return torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ v.double()

    return alone


LOCAL_IMPLS = [
    {"impl": "kernel"},
    {"impl": "sdpa"},
    {"impl": "blocked", "block": 8},
    {"impl": "flex", "block": 16},
]


@pytest.mark.parametrize("knobs", LOCAL_IMPLS, ids=lambda k: k["impl"])
@pytest.mark.parametrize("window", [3, 12])
@pytest.mark.parametrize("nq,causal", [(48, True), (48, False), (20, True), (1, True)])
def test_local_window_stops_its_band_at_each_document_s_edges(knobs, window, nq, causal):
    """Every implementation of local_window (the C kernel, fused SDPA, the blocked reference, compiled
    FlexAttention run eagerly) on a packed call gives, row by row, each document's own sliding window
    attended alone (a formula written here), decoding rows included; and the documents change it."""
    inp = make_inputs(
        2, 2, nq, 48, 16, 16, dtype=torch.float32, device="cpu", documents=4, seed=1, kv_heads=1
    )
    attn = build("local_window", window=window, **knobs)
    attn._flex.compile = False  # FlexAttention's eager path: the compiled one is checked on CUDA
    out = attn(inp.q, inp.k, inp.v, **inp.kwargs(causal))
    assert attn.impl_ran == knobs["impl"]
    _assert_each_document_alone(out, inp, causal, alone=_band_alone(window), rtol=1e-4, atol=1e-5)
    if nq > 1:  # (one decoded query's band may lie inside its document)
        unpacked = attn(inp.q, inp.k, inp.v, causal=causal)
        assert (out - unpacked).abs().max() > 1e-2  # some band crosses a document's edge


@pytest.mark.parametrize("impl", ["kernel", "sdpa", "blocked"])
@pytest.mark.parametrize("causal", [True, False])
def test_local_window_s_gradients_stay_within_each_document(impl, causal):
    """Gradients of q, k and v through the packed band, against float64 autograd of the oracle (the
    band and the documents' mask), with padded keys beside the documents."""
    inp = make_inputs(
        2, 4, 40, 40, 16, 16, dtype=torch.float32, device="cpu", documents=3, seed=2, kv_heads=2
    )
    kw = {**inp.kwargs(causal), "key_padding_mask": torch.arange(40).expand(2, 40) % 7 != 3}
    attn = build("local_window", window=6, impl=impl, block=8)
    got = [t.clone().requires_grad_() for t in inp.tensors()]
    want = [t.double().requires_grad_() for t in inp.tensors()]
    g = torch.randn(2, 4, 40, 16, dtype=torch.float64)
    (attn(*got, **kw).double() * g).sum().backward()
    (oracle(attn, *want, **kw) * g).sum().backward()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)


def test_local_window_with_sinks_refuses_packed_documents_by_name():
    inp = make_inputs(1, 2, 32, 32, 16, 16, dtype=torch.float32, device="cpu", documents=3, seed=5)
    with pytest.raises(Unsupported, match="sink_tokens=2 takes no packed documents"):
        build("local_window", window=4, sink_tokens=2)(inp.q, inp.k, inp.v, **inp.kwargs(True))


@pytest.mark.parametrize("window", [0, 3, 20])
@pytest.mark.parametrize("nq", [60, 17])
def test_window_linear_attends_each_document_alone_with_its_gradients(window, nq):
    """Based's window + linear hybrid on a packed call: its output and gradients are those of its own
    float64 formula run on each document alone (the window's edge and the far state's reset both at
    the document's start, the far part empty for a query whose document starts inside its window)."""
    inp = make_inputs(
        2, 4, nq, 60, 16, 16, dtype=torch.float32, device="cpu", documents=4, seed=3, kv_heads=2
    )
    kw = {**inp.kwargs(True), "key_padding_mask": torch.arange(60).expand(2, 60) % 9 != 4}
    attn = build("window_linear", window=window, chunk=8)
    got = [t.clone().requires_grad_() for t in inp.tensors()]
    want = [t.double().requires_grad_() for t in inp.tensors()]
    out, ref = attn(*got, **kw), oracle(attn, *want, **kw)  # the oracle: each document alone
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    unpacked = oracle(attn, *inp.tensors(), **{k: v for k, v in kw.items() if k != "documents"})
    assert (ref - unpacked).abs().max() > 1e-2
    g = torch.randn_like(ref)
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)
