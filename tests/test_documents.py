"""Packed documents (``documents=K``): the lengths, the mask, the useful-pair count, the config checks
and a job end to end. Oracles: each document attended alone by a float64 formula written here, the
mask's pairs counted from the tensor, and what a config means by construction."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from experiments.measure.inputs import document_lengths, document_mask, make_inputs, pairs_kept
from experiments.measure.kernel import measure
from experiments.records.records import config_hash
from experiments.records.store import to_frame
from experiments.sweep.labels import job_label
from experiments.sweep.schema import validate
from variants import Workload, build
from variants.registry import available, get

from .test_decode_jobs import _conf
from .test_runner import job_cfg, job_spec


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Float64 softmax attention of one document's ``(H, n, D)`` queries, keys and values."""
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


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
@pytest.mark.parametrize("causal", [False, True])
def test_a_packed_call_attends_each_document_alone(name, knobs, causal):
    """The packed call's output rows of each document equal that document attended on its own."""
    inp = make_inputs(2, 2, 48, 48, 16, 16, dtype=torch.float32, device="cpu", documents=4, seed=1)
    out = build(name, **knobs)(inp.q, inp.k, inp.v, **inp.kwargs(causal)).double()
    for b, row in enumerate(inp.document_lengths):
        start = 0
        for n in row:
            sl = slice(start, start + n)
            want = _alone(inp.q[b, :, sl], inp.k[b, :, sl], inp.v[b, :, sl], causal)
            torch.testing.assert_close(out[b, :, sl], want, rtol=1e-4, atol=1e-5)
            start += n


@pytest.mark.parametrize("nq,nk,causal", [(40, 40, False), (40, 40, True), (9, 40, True), (9, 40, False)])
def test_pairs_kept_counts_the_masks_pairs(nq, nk, causal):
    """The share counted from the lengths equals the mask's own pairs (and causal's) over the call's."""
    lengths = document_lengths(3, nk, 5, seed=2)
    mask = document_mask(lengths, nq)  # (B, 1, Nq, Nk)
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


def test_a_variant_without_a_mask_refuses_packed_documents():
    res = measure(
        job_spec(variant="local_window", seq_len=64, heads=2, head_dim=16, min_run_time=0.02, documents=4)
    )
    assert res["status"] == "unsupported" and "attn_mask (packed documents are one)" in res["reason"]


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
