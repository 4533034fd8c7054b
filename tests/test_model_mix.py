"""experiment=llama_mix's models (issue 33): a Gemma-style local/global layer mix and a StreamingLLM
sinks model, each against an oracle written apart from the code under test.

- The mix (MinistralForCausalLM with ``layer_types``, local_window on the sliding layers, sdpa on the
  full ones): transformers' own eager attention on the same random-weight model, which applies each
  layer's sliding window itself; forward hooks on the two variant instances count which layers call
  which.
- The sinks model (local_window with ``sink_tokens`` on every layer): transformers' eager attention
  on the same model with an explicit additive mask (0 where ``|p - j| <= window`` or ``j <
  sink_tokens``, and ``j <= p``; ``-inf`` elsewhere) over the whole sequence, against which every
  prefill and decoding step is compared, with transformers' growing cache and with the rolling one.
- The K/V figures: byte counts written out by hand from the shapes.

Tiny models (width 64, 2-4 layers, fp32), weights drawn with std 0.1 so attention is peaked; each
case first checks that what it tests moves the logits by far more than the tolerance.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import variants

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

from experiments.measure import llama_e2e  # noqa: E402
from experiments.measure.kernel import measure  # noqa: E402
from experiments.measure.llama_e2e import kv_figures, layer_variants, measure_llama, model_config  # noqa: E402
from experiments.records import store  # noqa: E402
from experiments.sweep.schema import BenchConfig, validate  # noqa: E402
from integrations import transformers_backend as hf  # noqa: E402
from integrations.streaming_cache import SinkWindowLayer, streaming_cache  # noqa: E402

from .test_runner import job_spec  # noqa: E402

TOL = 1e-4
SHAPE = dict(layers=4, hidden=64, heads=4, kv_heads=2, vocab=128)  # head size 16, GQA 2:1
D, HKV = 16, 2


def _config(layers: int = 4, **mix):
    cfg = model_config(**{**SHAPE, "layers": layers}, **{"sliding_window": None, "full_every": None, **mix})
    cfg.initializer_range = 0.1  # peaked attention: a wrong mask or window moves the logits visibly
    return cfg


def _models(cfg, impl):
    """The eager model of ``cfg`` and the same weights on ``impl``."""
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl).eval()
    model.load_state_dict(eager.state_dict())
    return eager, model


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab"], (2, n), generator=torch.Generator().manual_seed(seed))  # (B, n)


# ---------------------------------------------------------------------------------- the layer mix
def test_the_mix_runs_each_variant_on_its_layers_and_matches_eager():
    w = 6  # 6 keys per query on the sliding layers: radius 5
    cfg = _config(sliding_window=w, full_every=2)  # layers 0 and 2 sliding, 1 and 3 full
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    impl = hf.implementation_for_roles(("local_window", {"window": 64}), "sdpa")  # wider: the model's band
    eager, model = _models(cfg, impl)
    assert type(model).__name__ == "MinistralForCausalLM"
    roles = hf.layer_roles(impl)
    calls = {"sliding": 0, "full": 0}
    for role, inst in roles.items():
        inst.register_forward_hook(lambda *_, role=role: calls.__setitem__(role, calls[role] + 1))
    ids = _ids(20)  # longer than the window: the sliding layers drop keys
    with torch.inference_mode():
        ref, got = eager(ids).logits, model(ids).logits
        assert calls == {"sliding": 2, "full": 2}  # one forward: two layers of each kind
        assert (got - ref).abs().max() < TOL
        # the window matters here: the same model with every layer full is far from it
        everything = AutoModelForCausalLM.from_config(copy.deepcopy(_config()), attn_implementation="eager")
        everything.load_state_dict(eager.state_dict())
        assert (everything.eval()(ids).logits - ref).abs().max() > 100 * TOL
        gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **gen), eager.generate(ids, **gen))  # sliding cache, decoding
    assert [v.name for v in layer_variants(model, "sdpa")] == ["local_window", "sdpa"] * 2
    # each variant ran where it was put: a window of 1 on either kind of layer moves the logits
    for sliding, full in [
        (("local_window", {"window": 1}), "sdpa"),
        ("sdpa", ("local_window", {"window": 1})),
    ]:
        _, wrong = _models(cfg, hf.implementation_for_roles(sliding, full))
        with torch.inference_mode():
            assert (wrong(ids).logits - ref).abs().max() > 100 * TOL


@pytest.mark.parametrize("n", [4, 12])
def test_a_full_layer_runs_the_full_variant_even_where_its_mask_looks_like_the_window(n):
    """A bidirectional Gemma3 (EmbeddingGemma's setting): a full layer's mask over n <= radius + 1
    keys equals the sliding layers' band, and the mix sent that layer to the sliding variant (0.97 off
    eager). The model names each layer's kind; eager gets the two masks the mix means."""
    from transformers import AutoModel, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16,
        use_bidirectional_attention=True, initializer_range=0.1,
    )  # fmt: skip
    impl = hf.implementation_for_roles(("local_window", {"window": 1}), "sdpa")
    calls = {"sliding": 0, "full": 0}
    for role, inst in hf.layer_roles(impl).items():
        inst.register_forward_hook(lambda *_, role=role: calls.__setitem__(role, calls[role] + 1))
    torch.manual_seed(0)
    eager = AutoModel.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    model = AutoModel.from_config(copy.deepcopy(cfg), attn_implementation=impl).eval()
    model.load_state_dict(eager.state_dict())
    ids = torch.randint(1, 64, (1, n), generator=torch.Generator().manual_seed(1))  # (1, n)
    i = torch.arange(n)

    def additive(keep: torch.Tensor) -> torch.Tensor:  # (n, n) bool -> (1, 1, n, n) float
        return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))[None, None]

    masks = {
        "sliding_attention": additive((i[:, None] - i[None, :]).abs() <= 1),  # local_window's radius 1
        "full_attention": additive(torch.ones(n, n, dtype=torch.bool)),
    }
    with torch.inference_mode():
        ref = eager(ids, attention_mask=masks).last_hidden_state
        got = model(ids).last_hidden_state
    assert calls == {"sliding": 1, "full": 1}
    assert (got - ref).abs().max() < TOL


@pytest.mark.parametrize("lengths", [[[3, 5], [4, 4]], [[5, 6, 5], [8, 8]]], ids=["row=W", "row=2W"])
def test_packed_documents_shorter_than_the_window_run_each_layer_on_its_variant(lengths):
    """Packed sequences (position_ids restarting) whose every document fits in the window W=8: the
    sliding layers' mask shows no window. They went to the full layers' variant (2.5 off each
    sequence run alone), or, with rows longer than W, were refused as 'plain causal'."""
    cfg = _config(sliding_window=8, full_every=2)  # layers 0 and 2 sliding, 1 and 3 full
    impl = hf.implementation_for_roles(("local_window", {"window": 64}), "sdpa")  # wider: the model's W
    eager, model = _models(cfg, impl)
    calls = {"sliding": 0, "full": 0}
    for role, inst in hf.layer_roles(impl).items():
        inst.register_forward_hook(lambda *_, role=role: calls.__setitem__(role, calls[role] + 1))
    n = sum(lengths[0])
    ids = _ids(n, seed=3)
    pos = torch.stack([torch.cat([torch.arange(k) for k in row]) for row in lengths])  # (B, n)
    with torch.inference_mode():
        got = model(ids, position_ids=pos, use_cache=False).logits
        assert calls == {"sliding": 2, "full": 2}
        for b, row in enumerate(lengths):  # each document alone through the eager model
            starts = [sum(row[:i]) for i in range(len(row))]
            for a, k in zip(starts, row, strict=True):
                alone = eager(ids[b : b + 1, a : a + k], use_cache=False).logits
                assert (got[b : b + 1, a : a + k] - alone).abs().max() < TOL


def test_sinks_on_a_left_padded_row_are_refused_not_silently_pads():
    """A left-padded row's first keys are pads, which the mask hides: its sinks were no keys at all
    (the padded row's logits 2.9 off the same row alone); now refused by row."""
    cfg = _config()
    _, model = _models(cfg, hf.implementation_for("local_window", {"window": 3, "sink_tokens": 2}))
    ids = _ids(12)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # row 1 left-padded by 5
    with torch.inference_mode(), pytest.raises(hf.Unsupported, match=r"rows \[1\] begin with padding"):
        model(ids, attention_mask=mask)
    mask[1, :5], mask[1, -5:] = 1, 0  # padded on the right instead: its sinks are its first tokens
    with torch.inference_mode():
        padded = model(ids, attention_mask=mask).logits
        assert (padded[1:, :7] - model(ids[1:, :7]).logits).abs().max() < TOL


def test_the_mix_model_without_sliding_layers_is_the_llama():
    # MinistralForCausalLM with every layer full is the Llama of the same seed, weights and logits
    llama, mix = _config(), _config(sliding_window=8, full_every=1)
    torch.manual_seed(0)
    a = AutoModelForCausalLM.from_config(copy.deepcopy(llama), attn_implementation="eager").eval()
    torch.manual_seed(0)
    b = AutoModelForCausalLM.from_config(copy.deepcopy(mix), attn_implementation="eager").eval()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.inference_mode():
        assert (a(_ids(12)).logits - b(_ids(12)).logits).abs().max() < 1e-6


# ---------------------------------------------------------------------------------- the sinks model
def _streaming_mask(n: int, window: int, sinks: int) -> torch.Tensor:
    """Additive ``(1, 1, n, n)``: 0 where position ``p`` may see key ``j`` (``|p - j| <= window`` or ``j
    < sinks``, and ``j <= p``), ``-inf`` elsewhere; written from the definition, element by element."""
    m = torch.full((1, 1, n, n), float("-inf"))
    for p in range(n):
        for j in range(p + 1):
            if p - j <= window or j < sinks:
                m[0, 0, p, j] = 0.0
    return m


def _decode(model, ids, steps, cache):
    """Prefill ``ids`` into ``cache``, then ``steps`` greedy steps: ``(tokens (B, steps), logits (B,
    n + steps - 1, vocab))`` (the prefill's positions, then each step's)."""
    with torch.inference_mode():
        logits = [model(ids, **{hf.cache_keyword(model): cache}, use_cache=True).logits]  # (B, n, vocab)
        tokens = [logits[-1][:, -1:].argmax(-1)]  # (B, 1)
        for _ in range(steps - 1):
            logits.append(
                model(tokens[-1], **{hf.cache_keyword(model): cache}, use_cache=True).logits
            )  # (B, 1, vocab)
            tokens.append(logits[-1][:, -1:].argmax(-1))
    return torch.cat(tokens, 1), torch.cat(logits, 1)


@pytest.mark.parametrize("rolling", [False, True], ids=["dynamic_cache", "rolling_cache"])
def test_the_sinks_model_matches_eager_with_the_streaming_mask(rolling):
    window, sinks, n, steps = 4, 3, 16, 8
    cfg = _config(layers=2)
    knobs = {"window": window, "sink_tokens": sinks}
    eager, model = _models(cfg, hf.implementation_for("local_window", knobs))
    ids = _ids(n)
    cache = (
        streaming_cache(model.config, [(sinks, window)] * 2) if rolling else DynamicCache(config=model.config)
    )
    tokens, logits = _decode(model, ids, steps, cache)
    whole = torch.cat([ids, tokens[:, :-1]], 1)  # (B, n + steps - 1): every position that was computed
    with torch.inference_mode():
        ref = eager(whole, attention_mask=_streaming_mask(whole.shape[1], window, sinks)).logits
        plain = eager(whole, attention_mask=_streaming_mask(whole.shape[1], window, 0)).logits
    assert (plain - ref).abs().max() > 100 * TOL  # the sinks matter at these positions
    assert (logits - ref).abs().max() < TOL
    per_layer = [hf.shared(hf.implementation_for("local_window", knobs))] * 2
    kv = kv_figures(cache, per_layer, cfg, batch=2, dtype=torch.float32)
    seen = n + steps - 1
    assert cache.get_seq_length() == seen
    held = sinks + window if rolling else seen  # keys per layer
    assert kv["kv_cached_keys_layers"] == [held] * 2
    assert kv["kv_bytes_kept"] == 2 * HKV * held * 2 * D * 4  # layers, K/V heads, keys, K and V, fp32
    assert kv["kv_bytes_read_per_step"] == 2 * HKV * (sinks + window) * 2 * D * 4
    assert kv["kv_bytes_full"] == 2 * HKV * seen * 2 * D * 4
    assert kv["cache_layers"] == ["SinkWindowLayer" if rolling else "DynamicLayer"] * 2


def test_sinks_on_a_mix_decode_with_a_rolling_cache_as_a_whole_forward_computes():
    # no eager oracle for sinks on sliding layers: the oracle is the same model without a cache, whose
    # forward over the whole sequence sees the true sinks and band at every position
    cfg = _config(sliding_window=6, full_every=2)
    impl = hf.implementation_for_roles(("local_window", {"window": 8, "sink_tokens": 2}), "sdpa")
    _, model = _models(cfg, impl)
    roll = [(2, 5), None, (2, 5), None]  # sliding layers: their sinks and the model's radius 5
    tokens, logits = _decode(model, _ids(14), 6, streaming_cache(model.config, roll))
    whole = torch.cat([_ids(14), tokens[:, :-1]], 1)
    with torch.inference_mode():
        assert (logits - model(whole).logits).abs().max() < TOL
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        SinkWindowLayer(2, 5).crop(-1)


def test_sinks_on_a_cache_that_dropped_them_are_refused_not_silently_wrong():
    # transformers' own sliding cache keeps the last 5 keys: past them, the first keys it hands over are
    # not the sequence's sinks. Without the refusal the decoded logits were 2.2 off the whole forward.
    cfg = _config(sliding_window=6, full_every=2)
    impl = hf.implementation_for_roles(("local_window", {"window": 8, "sink_tokens": 2}), "sdpa")
    _, model = _models(cfg, impl)
    cache = DynamicCache(config=model.config)
    assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"
    with pytest.raises(hf.Unsupported, match=r"first 2 keys .* starts at position 9 and dropped them"):
        _decode(model, _ids(14), 3, cache)
    # the prefill (every key still there) and a window without sinks on the same cache are fine
    with torch.inference_mode():
        prefill = model(
            _ids(14), **{hf.cache_keyword(model): DynamicCache(config=model.config)}, use_cache=True
        ).logits
        assert (prefill - model(_ids(14)).logits).abs().max() < TOL
    plain = hf.implementation_for_roles(("local_window", {"window": 8}), "sdpa")
    _, banded = _models(cfg, plain)
    tokens, logits = _decode(banded, _ids(14), 4, DynamicCache(config=banded.config))
    whole = torch.cat([_ids(14), tokens[:, :-1]], 1)
    with torch.inference_mode():
        assert (logits - banded(whole).logits).abs().max() < TOL


# ---------------------------------------------------------------------------------- the job
def test_measure_llama_records_what_each_layer_runs_and_keeps():
    small = dict(SHAPE, prefill_len=20, new_tokens=4, batch=1, device="cpu", dtype="float32", seed=0)
    small["prefill_runs"] = 1
    lw = {"window": 8}
    r = measure_llama("local_window", lw, **small, sliding_window=6, full_every=2, full_variant="sdpa")
    assert r["architecture"] == "MinistralForCausalLM"
    assert r["layer_variants"] == ["local_window(window=8)", "sdpa"] * 2
    assert r["cache_layers"] == ["DynamicSlidingWindowLayer", "DynamicLayer"] * 2
    seen = 20 + 3
    assert r["kv_length_final"] == seen and r["kv_cached_keys_layers"] == [5, seen] * 2
    per_key = HKV * 2 * D * 4  # bytes of one cached position in one layer, K and V
    # a sliding layer holds the last 5 keys as a slice of the 6-key tensor of its last update: 6 kept
    assert r["kv_bytes_kept_layers"] == [6 * per_key, seen * per_key] * 2
    assert r["kv_bytes_read_layers"] == [5 * per_key, seen * per_key] * 2
    assert r["prefill_ms_per_token"] == pytest.approx(r["prefill_ms"] / 20)
    rolled = measure_llama("local_window", {**lw, "sink_tokens": 2}, **small, rolling_cache=True)
    assert rolled["cache_layers"] == ["SinkWindowLayer"] * 4 and rolled["kv_cached_keys_layers"] == [10] * 4
    assert rolled["kv_bytes_kept"] == rolled["kv_bytes_read_per_step"] == 4 * 10 * per_key
    with pytest.raises(llama_e2e.Unsupported, match="no layer of this model runs local_window"):
        measure_llama("sdpa", {}, **small, rolling_cache=True)
    with pytest.raises(llama_e2e.Unsupported, match="sliding-window cache keeps only the last 5 keys"):
        measure_llama("local_window", {**lw, "sink_tokens": 2}, **small, sliding_window=6)


def test_a_fixed_state_variant_reads_the_cache_it_is_handed():
    """Through transformers a layer hands linear its whole cache (not a state): a step reads every key
    cached, counted here from the keys each call was handed (the record said the state's 576 bytes)."""
    small = dict(SHAPE, prefill_len=20, new_tokens=4, batch=1, device="cpu", dtype="float32", seed=0)
    handed = []
    linear = variants.get("linear")
    forward = linear.forward

    def spy(self, q, k, v, *args, **kwargs):
        handed.append(k.nbytes + v.nbytes)  # (1, HKV, keys, D) each, fp32
        return forward(self, q, k, v, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear, "forward", spy)
        r = measure_llama("linear", {}, **small, prefill_runs=1)
    seen = 20 + 3
    assert handed[-4:] == [seen * HKV * 2 * D * 4] * 4  # the last step's four layers, before its key
    assert r["kv_bytes_read_layers"] == handed[-4:]


def test_a_mix_job_records_its_figures_and_two_models_stay_two_rows():
    over = {"model.layers": 2, "model.hidden": 64, "model.prefill_len": 24, "model.new_tokens": 3}
    mix = job_spec(variant="llama/local_window_w512", experiment="llama_mix", model="llama_mix", **over)
    res = measure(mix)
    assert res["status"] == "ok", res
    f = res["figures"]
    assert f["layer_variants"] == ["local_window(window=512)", "local_window(window=512)"]  # no full layer
    assert f["kv_bytes_read_per_step"] <= f["kv_bytes_kept"] and f["prefill_ms_per_token"] > 0
    sinks = job_spec(
        variant="llama/local_window_w512_sinks4", experiment="llama_mix", model="llama_mix", **over
    )
    res = measure(sinks)
    assert res["status"] == "unsupported" and "drop the sinks" in res["reason"]
    # the same variant on two models: both rows are shown (the model is part of a row's identity)
    rows = []
    for i, m in enumerate(({"layers": 2}, {"layers": 2, "sliding_window": 9})):
        rows.append({
            "config": {"variant": {"_target_": "variants.sdpa.SDPAAttention"}, "model": m, "seq_len": 24},
            "status": "ok", "config_hash": f"h{i}", "_path": f"p{i}", "kind": "model",
            "started_at": "2026-01-01T00:00:00+00:00", "figures": {"decode_ms_per_token": 1.0},
        })  # fmt: skip
    df = store.to_frame(rows)
    assert df["newest"].tolist() == [True, True]
    assert {json.loads(m).get("sliding_window") for m in df["model"]} == {None, 9}


@pytest.mark.parametrize(
    "model,msg",
    [
        ({"full_every": 2}, "need model.sliding_window"),
        ({"sliding_window": 0}, "model.sliding_window must be at least 2"),
        # transformers' sliding cache keeps every key for W=1: each decode failed after the prefill
        ({"sliding_window": 1}, "model.sliding_window must be at least 2"),
        ({"sliding_window": "8"}, "model.sliding_window must be an integer"),
        # every layer full: the job's variant ran nowhere and the job failed after the whole run
        (
            {"sliding_window": 4, "full_every": 1, "full_variant": "sdpa"},
            "the job's variant would run on no layer",
        ),
        ({"sliding_window": 8, "full_every": 0}, "model.full_every must be an integer >= 1"),
        ({"sliding_window": 8, "full_every": True}, "model.full_every must be an integer >= 1"),
        ({"sliding_window": 8, "full_variant": "nope"}, "model.full_variant='nope' is not a variant"),
        ({"sliding_window": 8, "full_variant": "additive"}, "has learned parameters"),
        ({"rolling_cache": "yes"}, "model.rolling_cache must be true or false"),
        # Hydra's +model.key adds any key: a misspelt window ran a plain Llama
        ({"sliding_windw": 8}, "model.sliding_windw: not a model setting; known: layers, "),
        # seq_len is 1024 (the default): a record would say N=1024 of a 64-token prefill
        ({"prefill_len": 64}, r"seq_len=1024 but a model job prefills model.prefill_len=64 tokens"),
    ],
)
def test_bad_model_settings_are_one_line_errors(model, msg):
    with pytest.raises(ValueError, match=msg):
        validate(
            BenchConfig.from_config({"variant": {"_target_": "variants.sdpa.SDPAAttention"}, "model": model})
        )


def test_a_prompt_of_no_tokens_is_named_as_typed():
    """experiment=llama ties seq_len to model.prefill_len: prefill_len=0 said 'seq_len must be > 0'."""
    cfg = {"variant": {"_target_": "variants.sdpa.SDPAAttention"}, "model": {"prefill_len": 0}, "seq_len": 0}
    with pytest.raises(ValueError, match="model.prefill_len must be an integer >= 1, got 0"):
        validate(BenchConfig.from_config(cfg))
