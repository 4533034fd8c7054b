"""The transformers backend (integrations/transformers_backend.py) against a real client as the oracle:
transformers' own eager attention, in tiny random-weight models built offline (no downloads), fp32.

Cases for every exact variant runnable on the CPU (and local_window with a window covering the whole
sequence): logits of (a) an unpadded batch, (b) a left-padded batch (real tokens only), (c) a prefill
of 16 tokens onto a 48-token DynamicCache (left-padded) within 1e-4 of eager, and (d) greedy
``generate(max_new_tokens=8)`` with the cache gives eager's tokens. local_window with a small window
is compared with eager's sliding-window attention (Mistral = Llama + a sliding window). Weights are
drawn with std 0.1 so attention is peaked (at transformers' 0.02 the scores are near zero and a wrong
scale would go unnoticed); each case checks first that what it tests (padding, scale) moves eager's
logits by far more than the tolerance.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import variants

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    DynamicCache,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
)
from transformers.masking_utils import (  # noqa: E402
    bidirectional_mask_function,
    causal_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)

from integrations import transformers_backend as hf  # noqa: E402

TOL = 1e-4
CPU_KNOBS = {"flex": {"compile": False}}  # compiled flex compiles per shape: decoding recompiles
# exact variants that run on the CPU, from the registry (a new one is tested for free)
EXACT = [
    n
    for n in variants.available()
    if variants.get(n).exact and not variants.get(n).has_params and "cpu" in variants.get(n).devices
]
LLAMA = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    initializer_range=0.1,
)
N, PAD, PAST, NEW, GEN = 24, 5, 48, 16, 8  # prompt, left padding of row 1, cache, prefill onto it, generated
CASES = ["unpadded", "left_padded", "prefill_onto_cache", "generate"]


def _model(cfg, impl, state=None):
    """A model of ``cfg`` on ``impl`` (config copied: from_config writes into it), eval, with ``state``."""
    m = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl).eval()
    if state is not None:
        m.load_state_dict(state)
    return m


def _inputs():
    """``ids (2, PAST + NEW)`` and a left-padded mask: row 1 starts with PAD pad tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA["vocab_size"], (2, PAST + NEW), generator=g)  # (B, 64)
    mask = torch.ones_like(ids)  # (B, 64), 1 = real token
    mask[1, :PAD] = 0
    return ids, mask


@torch.inference_mode()
def run_case(model, case):
    """What ``case`` compares: ``(logits, which positions count)`` or generated tokens."""
    ids, mask = _inputs()
    if case == "unpadded":
        return model(ids[:, :N]).logits, None  # (B, N, vocab)
    if case == "left_padded":
        return model(ids[:, :N], attention_mask=mask[:, :N]).logits, mask[:, :N].bool()
    if case == "prefill_onto_cache":
        cache = DynamicCache(config=model.config)
        model(
            ids[:, :PAST], attention_mask=mask[:, :PAST], **{hf.cache_keyword(model): cache}, use_cache=True
        )
        out = model(ids[:, PAST:], attention_mask=mask, **{hf.cache_keyword(model): cache}, use_cache=True)
        return out.logits, None  # (B, NEW, vocab): all real tokens
    assert case == "generate"
    out = model.generate(
        ids[:, :N], attention_mask=mask[:, :N], max_new_tokens=GEN, do_sample=False, pad_token_id=0
    )
    return out[:, N:], None  # (B, GEN)


def assert_same(got, ref, case):
    (g, where), (r, _) = got, ref
    if case == "generate":
        assert torch.equal(g, r), f"generated {g.tolist()} != eager's {r.tolist()}"
        return
    diff = (g - r).abs()
    if where is not None:
        diff = diff[where]  # real tokens only: rows of padded queries see no key (zeros here)
    assert diff.max().item() < TOL, f"{case}: max |logits - eager| = {diff.max().item():.2e}"


_cache: dict = {}


def memo(key, fn):
    if key not in _cache:
        _cache[key] = fn()
    return _cache[key]


def llama_eager():
    """The eager Llama model and its results per case (computed once)."""

    def make():
        torch.manual_seed(0)
        m = _model(LlamaConfig(**LLAMA), "eager")
        return m, {c: run_case(m, c) for c in CASES}

    return memo("llama_eager", make)


# ---------------------------------------------------------------- registration and masks


def test_variants_import_without_transformers():
    """``import variants`` does not import the backend or transformers; the backend module imports
    without transformers and only register() needs it (one-line ImportError)."""
    code = (
        "import sys\n"
        "import variants\n"
        "assert 'transformers' not in sys.modules\n"
        "assert 'integrations.transformers_backend' not in sys.modules\n"
        "sys.modules['transformers'] = None\n"
        "from integrations import transformers_backend as hf\n"
        "try:\n"
        "    hf.register(['sdpa'])\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_register_adds_attention_and_mask_function():
    names = hf.register(knobs=CPU_KNOBS)
    assert names == [hf.implementation(n) for n in variants.available()]
    assert "sdpa" not in hf.implementation("sdpa")  # transformers would read it as its own SDPA path
    for impl in names:  # without the mask function transformers passes no mask: padding ignored
        assert impl in AttentionInterface() and AttentionMaskInterface()[impl] is hf.mask_function
    with pytest.raises(ValueError, match="unknown knob 'windw' for local_window"):
        hf.register(["local_window"], {"local_window": {"windw": 3}})
    with pytest.raises(variants.UnknownVariant, match="unknown attention variant 'nope'"):
        hf.register(["nope"])
    with pytest.raises(ValueError, match="not being registered: sparse"):
        hf.register(["sdpa"], {"sparse": {"block": 4}})


def test_registering_every_variant_again_keeps_what_was_registered():
    """docs/models.md's snippet registers every variant with flex's compile=False; a second call with
    other knobs (or none) re-registered flex with its defaults and failed naming flex, even for a
    misspelt local_window knob."""
    names = hf.register(knobs=CPU_KNOBS)
    assert hf.register() == names  # every variant again: each keeps its knobs
    assert hf.shared(hf.implementation("flex")).knobs()["compile"] is False
    with pytest.raises(ValueError, match="unknown knob 'windw' for local_window"):
        hf.register(knobs={"local_window": {"windw": 64}})
    with pytest.raises(ValueError, match=r"register_as\('flex@default', 'flex', \.\.\.\)"):
        hf.register(["flex"])  # naming it with no knobs asks for the defaults: a clash, said with a name


def test_mask_function_gives_causal_and_padding_or_a_full_mask():
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[1, :3] = False
    # decoding one token onto 9 cached ones (DynamicCache): causal + the padding of those 10 keys
    spec = hf.mask_function(
        2, 1, 10, q_offset=9, kv_offset=0, mask_function=causal_mask_function, attention_mask=pad
    )
    assert spec.causal and spec.attn_mask is None and torch.equal(spec.key_padding_mask, pad)
    # no padding at all: no padding mask to apply per layer
    spec = hf.mask_function(
        2, 10, 10, mask_function=causal_mask_function, attention_mask=torch.ones_like(pad)
    )
    assert spec.causal and spec.key_padding_mask is None
    # bidirectional (encoders, cross-attention): not causal
    spec = hf.mask_function(2, 4, 10, mask_function=bidirectional_mask_function, attention_mask=pad)
    assert not spec.causal and torch.equal(spec.key_padding_mask, pad)
    # a static cache of 10 slots, 4 queries at positions 3-6: slots 7-9 are never read, so the layer
    # passes the first 7 keys (bottom-right causal is then right) with their padding
    spec = hf.mask_function(
        2, 4, 10, q_offset=torch.tensor(3), mask_function=causal_mask_function, attention_mask=pad
    )
    assert spec.causal and spec.keys_used == 7 and torch.equal(spec.key_padding_mask, pad[:, :7])
    # a predicate other than plain causal (sliding window): transformers' own mask
    sw = sliding_window_causal_mask_function(3)
    spec = hf.mask_function(2, 10, 10, mask_function=sw, attention_mask=pad)
    ref = sdpa_mask(2, 10, 10, mask_function=sw, attention_mask=pad, allow_is_causal_skip=False)
    assert torch.equal(spec.attn_mask, ref)
    assert hf.mask_function(2, 10, 10, attention_mask=spec) is spec  # pre-built by generate(): as is


def test_grouped_kv_reach_the_variant_from_the_cache_without_a_copy():
    """The variant gets the cache's own K/V tensors with 2 heads (not repeated to 8) and layout
    (B, H, N, D); transformers gets (B, N, H, D) back."""
    hf.register(["naive"])
    m = _model(LlamaConfig(**LLAMA), "attnbench_naive")
    seen = []
    shared = hf._SHARED["naive"]
    orig = type(shared).forward

    def spy(self, q, k, v, **kw):
        seen.append((q.shape, k, kw))
        return orig(self, q, k, v, **kw)

    ids, mask = _inputs()
    cache = DynamicCache(config=m.config)
    try:
        type(shared).forward = spy
        with torch.inference_mode():
            m(ids[:, :PAST], attention_mask=mask[:, :PAST], **{hf.cache_keyword(m): cache}, use_cache=True)
            seen.clear()
            m(ids[:, PAST : PAST + 1], attention_mask=mask[:, : PAST + 1], **{hf.cache_keyword(m): cache})
    finally:
        type(shared).forward = orig
    assert len(seen) == 2  # one call per layer
    for layer, (qshape, k, kw) in enumerate(seen):
        assert tuple(qshape) == (2, 8, 1, 16) and tuple(k.shape) == (2, 2, PAST + 1, 16)
        assert k.data_ptr() == cache.layers[layer].keys.data_ptr()
        assert kw["causal"] and tuple(kw["key_padding_mask"].shape) == (2, PAST + 1)
        assert "scale" not in kw  # Llama's scaling is the default 1/sqrt(D)


# ---------------------------------------------------------------- exact variants = eager


def test_output_attentions_is_refused_not_answered_with_no_weights():
    """The weights were an empty tuple, without a word: a caller plotting them got nothing."""
    model = _attnbench_model("sdpa")
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), pytest.raises(variants.Unsupported, match="return no attention weights"):
        model(ids, output_attentions=True)
    with torch.inference_mode():
        assert model(ids, output_attentions=False)[0].shape[:2] == (1, 8)
    # asked through the config, transformers gathers the weights without telling the attention
    # function: the answer was an empty tuple; the keyword, where given, still decides
    model = _model(LlamaConfig(**LLAMA, output_attentions=True), hf.implementation_for("sdpa", {}))
    with torch.inference_mode(), pytest.raises(variants.Unsupported, match="return no attention weights"):
        model(ids)
    with torch.inference_mode():
        assert model(ids, output_attentions=False)[0].shape[:2] == (1, 8)


def _attnbench_model(name, knobs=None, key=None):
    """eager's Llama weights on ``attnbench_<name>`` (computed once per ``key``): shared instance
    registered with the CPU knobs when ``knobs`` is None (the from_config path), else this model's own
    instances built by attach() with ``knobs`` (knobs per model, not per name)."""

    def make():
        eager, _ = llama_eager()
        if knobs is None:
            impl = hf.implementation_for(name, CPU_KNOBS.get(name, {}))
            return _model(eager.config, impl, eager.state_dict())
        model = _model(eager.config, "eager", eager.state_dict())
        hf.attach(model, name, **knobs)
        return model

    return memo(key or name, make)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", EXACT)
def test_exact_variant_matches_eager(name, case):
    _, ref = llama_eager()
    model = _attnbench_model(name)
    assert_same(run_case(model, case), ref[case], case)


def test_the_padding_cases_depend_on_the_mask():
    """Sanity of the oracle: ignoring the padding moves eager's logits far beyond the tolerance, so the
    padded cases above do test the mask."""
    eager, ref = llama_eager()
    ids, mask = _inputs()
    with torch.inference_mode():
        unmasked = eager(ids[:, :N]).logits
    where = mask[:, :N].bool()
    assert (unmasked - ref["left_padded"][0])[where].abs().max() > 100 * TOL


@pytest.mark.parametrize("case", CASES)
def test_local_window_covering_the_sequence_matches_eager(case):
    _, ref = llama_eager()
    model = _attnbench_model("local_window", {"window": PAST + NEW + GEN}, key="local_window_full")
    assert_same(run_case(model, case), ref[case], case)


@pytest.mark.parametrize("case", CASES)
def test_local_window_matches_eager_sliding_window(case):
    """local_window(window=w) causal is transformers' sliding window of w + 1 tokens (a query sees
    itself and the w before it): Mistral (Llama with a sliding window) in eager is the oracle."""
    w = 3

    def make_ref():
        eager, _ = llama_eager()
        cfg = MistralConfig(**{**LLAMA, "sliding_window": w + 1})
        m = _model(cfg, "eager", eager.state_dict())
        return {c: run_case(m, c) for c in CASES}

    ref = memo("mistral_eager", make_ref)
    model = _attnbench_model("local_window", {"window": w}, key=f"local_window_{ {'window': w} }")
    assert_same(run_case(model, case), ref[case], case)


# ---------------------------------------------------------------- pattern and learned variants


@pytest.mark.parametrize("name, knobs", [("local_window", {"window": 3}), ("additive", {"hidden": 8})])
def test_pattern_variants_generate(name, knobs):
    model = _attnbench_model(name, knobs, key=f"{name}_{knobs}")
    tokens, _ = run_case(model, "generate")
    assert tokens.shape == (2, GEN) and bool(((tokens >= 0) & (tokens < LLAMA["vocab_size"])).all())


@torch.inference_mode()
def test_sparse_generates_with_the_cache_what_whole_forwards_give():
    """sparse's blocks move with left padding (refused: tests/test_padding_pattern.py), so an unpadded
    batch: greedy tokens with the K/V cache are those of a whole forward per step, without a cache."""
    model = _attnbench_model("sparse", {"block": 4}, key="sparse_{'block': 4}")
    prompt = _inputs()[0][:, :N]  # (2, N)
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=GEN, do_sample=False, pad_token_id=0
    )
    seq = prompt
    for _ in range(GEN):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)  # (2, N + step)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("name, knobs", [("naive", None), ("local_window", {"window": 3})])
def test_static_cache_generate_gives_the_dynamic_cache_tokens(name, knobs):
    """generate() with a static cache (masks built before the forward, empty slots past the queries)
    gives the tokens of the DynamicCache runs above (eager's, for an exact variant)."""
    model = _attnbench_model(name, knobs, key=f"{name}_{knobs}")
    ids, mask = _inputs()
    with torch.inference_mode():
        static = model.generate(
            ids[:, :N],
            attention_mask=mask[:, :N],
            max_new_tokens=GEN,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
        )
    assert torch.equal(static[:, N:], run_case(model, "generate")[0])


def test_axial_cannot_decode_with_a_one_line_reason():
    hf.register(["axial"])
    eager, _ = llama_eager()
    model = _model(eager.config, "attnbench_axial", eager.state_dict())
    ids = _inputs()[0][:, :N]  # unpadded: axial refuses any padding (tests/test_padding_pattern.py)
    with pytest.raises(variants.Unsupported) as info, torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GEN, pad_token_id=0)
    msg = str(info.value)
    assert "\n" not in msg and info.value.__cause__ is None and info.value.__suppress_context__
    assert msg.startswith("attnbench_axial in LlamaAttention (layer 0) cannot run q (2, 8, 1, 16)")
    assert "axial cannot decode (Nq=1 < Nk=25)" in msg


def test_additive_has_one_instance_per_layer_in_the_state_dict():
    eager, _ = llama_eager()
    hf.register(["additive"])
    model = _model(eager.config, "attnbench_additive", eager.state_dict())
    with pytest.raises(
        variants.Unsupported, match=r"call integrations.transformers_backend.attach\(model, 'additive'\)"
    ):
        run_case(model, "unpadded")
    layers = hf.attach(model, "additive", hidden=8)
    assert layers == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert model.config._attn_implementation == "attnbench_additive"
    keys = [k for k in model.state_dict() if "attnbench_attention" in k]
    assert keys == [
        f"model.layers.{i}.self_attn.attnbench_attention.{p}" for i in (0, 1) for p in ("w_q", "w_k", "w")
    ]
    inst = list(hf.layer_variants(model).values())
    assert inst[0] is not inst[1] and not torch.equal(inst[0].w_q, inst[1].w_q)
    assert inst[0].knobs() == {"heads": 8, "head_dim": 16, "hidden": 8, "chunk": None}
    # the state dict carries the attention: a fresh attached model loading it gives the same logits
    other = _model(eager.config, "eager")
    hf.attach(other, "additive", hidden=8)
    other.load_state_dict(model.state_dict())
    got, ref = run_case(other, "left_padded"), run_case(model, "left_padded")
    assert torch.equal(got[0][ref[1]], ref[0][ref[1]])
    # attach's knobs are its model's: a later attach without them takes the variant's defaults
    third = _model(eager.config, "eager")
    hf.attach(third, "additive")
    assert list(hf.layer_variants(third).values())[0].knobs()["hidden"] == variants.get("additive")().hidden


# ---------------------------------------------------------------- GPT-2: its own scale


def test_gpt2_with_layer_scaled_attention_matches_eager():
    """GPT-2 scales layer l's scores by 1 / (sqrt(D) (l + 1)) (scale_attn_by_inverse_layer_idx): the
    scale reaches the variants; padded logits and generated tokens equal eager's."""
    cfg = GPT2Config(
        vocab_size=128,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        initializer_range=0.1,
        scale_attn_by_inverse_layer_idx=True,
    )
    torch.manual_seed(0)
    eager = _model(cfg, "eager")
    plain = _model(GPT2Config(**{**cfg.to_dict(), "scale_attn_by_inverse_layer_idx": False}), "eager")
    plain.load_state_dict(eager.state_dict())
    ids, mask = _inputs()
    ids, mask = ids[:, :N], mask[:, :N]
    where = mask.bool()
    with torch.inference_mode():
        ref = eager(ids, attention_mask=mask).logits
        assert (plain(ids, attention_mask=mask).logits - ref)[where].abs().max() > 100 * TOL
        ref_tokens = eager.generate(
            ids, attention_mask=mask, max_new_tokens=GEN, do_sample=False, pad_token_id=0
        )
    for name in ("naive", "sdpa"):
        model = _model(cfg, hf.implementation_for(name), eager.state_dict())
        with torch.inference_mode():
            got = model(ids, attention_mask=mask).logits
            tokens = model.generate(
                ids, attention_mask=mask, max_new_tokens=GEN, do_sample=False, pad_token_id=0
            )
        assert (got - ref)[where].abs().max() < TOL, name
        assert torch.equal(tokens, ref_tokens), name


# ---------------------------------------------------------------- the end-to-end measurement


def test_measure_llama_small_call():
    from experiments.measure.llama_e2e import measure_llama

    r = measure_llama(
        "sdpa",
        {},
        layers=1,
        hidden=64,
        heads=4,
        kv_heads=2,
        prefill_len=16,
        new_tokens=3,
        batch=2,
        device="cpu",
        dtype=torch.float32,
        seed=0,
        prefill_runs=2,
    )
    assert r["prefill_ms"] > 0 and len(r["prefill_ms_runs"]) == 2
    assert r["decode_ms_per_token"] > 0 and len(r["decode_ms_steps"]) == 2
    assert r["tokens_generated"] == 3 and len(r["generated_ids"]) == 2 and r["kv_length_final"] == 18
    assert r["peak_memory_bytes"] is None and "CPU" in r["peak_memory_note"]
    assert r["variant_describe"]["name"] == "sdpa" and r["head_dim"] == 16 and r["dtype"] == "float32"


def test_registering_other_knobs_never_changes_a_model_already_built():
    """A registered name keeps its knobs: a model built on it gives the same logits after another
    configuration of the variant is registered (under a name of its own), and registering the name
    itself with other knobs is refused in one line."""
    eager, _ = llama_eager()
    ids, _ = _inputs()
    first_impl = hf.register_as("window_4", "local_window", window=4)
    first = _model(eager.config, first_impl, eager.state_dict())
    with torch.inference_mode():
        before = first(ids[:, :N]).logits
    with pytest.raises(ValueError, match=r"attnbench_window_4 is registered as local_window\(window=4\)"):
        hf.register_as("window_4", "local_window", window=64)
    assert hf.register_as("window_4", "local_window", window=4) == first_impl  # the same knobs: as is
    second = _model(eager.config, hf.implementation_for("local_window", {"window": 64}), eager.state_dict())
    with torch.inference_mode():
        after = first(ids[:, :N]).logits
        other = second(ids[:, :N]).logits
    assert torch.equal(before, after)
    assert (other - before).abs().max() > 100 * TOL  # the second model does use its own window
    assert hf.shared(first_impl).window == 4 and hf.shared("local_window@window=64").window == 64


# ------------------------------------------------------------------ attention sinks, unknown keywords


def _eager_on_a_padded_batch(cfg):
    """An eager model of ``cfg`` (seeded weights) and a left-padded batch of 20 tokens: ``(model, ids
    (2, 20), mask (2, 20), real (2, 20) bool)``."""
    torch.manual_seed(0)
    eager = _model(cfg, "eager")
    ids, mask = _inputs()
    ids, mask = ids[:, :20] % cfg.vocab_size, mask[:, :20]
    return eager, ids, mask, mask.bool()


SINK_VARIANTS = [n for n in EXACT if variants.get(n).supports_sinks]


def _sink_models():
    """gpt-oss (one learned sink logit per head, passed as ``s_aux``, sliding and full layers) and
    Inkling2 (a sink logit per head and token from a projection, passed as ``sinks``, with a relative
    position bias), tiny and random."""
    from transformers import GptOssConfig
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    small = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return {
        "gpt_oss": GptOssConfig(
            **small,
            **heads,
            num_local_experts=2,
            num_experts_per_tok=1,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            initializer_range=0.1,
        ),  # fmt: skip
        "inkling2": Inkling2TextConfig(
            **small, **heads, n_routed_experts=4, num_experts_per_tok=2, initializer_range=0.1
        ),
    }


@pytest.mark.parametrize("kind", ["gpt_oss", "inkling2"])
def test_sinks_reach_the_variant_and_match_eager(kind):
    cfg = _sink_models()[kind]
    eager, ids, mask, real = _eager_on_a_padded_batch(cfg)
    with torch.inference_mode():
        ref = eager(ids, attention_mask=mask).logits
    if kind == "gpt_oss":  # the sinks move eager's logits by far more than the tolerance
        sunk = _model(cfg, "eager", eager.state_dict())
        with torch.no_grad():
            for layer in sunk.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # e^-1e4: no sink
            assert (sunk(ids, attention_mask=mask).logits - ref)[real].abs().max() > 100 * TOL
    for name in SINK_VARIANTS:
        model = _model(cfg, hf.implementation_for(name, CPU_KNOBS.get(name, {})), eager.state_dict())
        with torch.inference_mode():
            got = model(ids, attention_mask=mask).logits
        assert (got - ref)[real].abs().max() < TOL, name


def test_a_keyword_the_backend_does_not_honour_is_refused_by_name():
    """MiniMax-M3-VL's block_indices, a keyword no model passes today: refused in one line naming
    them; keywords known to be harmless (position_ids) pass."""
    impl = hf.implementation_for("naive")
    attention = AttentionInterface()[impl]
    layer = torch.nn.Module()
    q = torch.randn(1, 2, 4, 8)
    spec = hf.mask_function(1, 4, 4, attention_mask=None)
    out, _ = attention(layer, q, q, q, spec, position_ids=torch.arange(4)[None])
    assert out.shape == (1, 4, 2, 8)
    for extra, named in [
        ({"block_indices": 3}, "block_indices"),
        ({"chunk_mask": torch.ones(4)}, "chunk_mask"),
    ]:
        with pytest.raises(variants.Unsupported, match=f"do not take {named}") as info:
            attention(layer, q, q, q, spec, **extra)
        assert "\n" not in str(info.value)


def test_gemma2_soft_capping_matches_eager_or_is_refused():
    """Gemma2 soft-caps its attention scores (``c tanh(s / c)``, here c = 1 so that it bites) on
    sliding and full layers: the variants that soft-cap give eager's logits; sdpa refuses by name."""
    from transformers import Gemma2Config

    cfg = Gemma2Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8,
        attn_logit_softcapping=1.0, query_pre_attn_scalar=16, initializer_range=0.1,
    )  # fmt: skip
    eager, ids, mask, real = _eager_on_a_padded_batch(cfg)
    uncapped = copy.deepcopy(cfg)
    uncapped.attn_logit_softcapping = None
    with torch.inference_mode():
        ref = eager(ids, attention_mask=mask).logits
        plain = _model(uncapped, "eager", eager.state_dict())(ids, attention_mask=mask).logits
    assert (plain - ref)[real].abs().max() > 100 * TOL  # the cap moves eager's logits
    for name in EXACT:
        model = _model(cfg, hf.implementation_for(name, CPU_KNOBS.get(name, {})), eager.state_dict())
        if not variants.get(name).supports_softcap:
            with pytest.raises(variants.Unsupported, match="does not soft-cap its scores"):
                model(ids, attention_mask=mask)
            continue
        with torch.inference_mode():
            got = model(ids, attention_mask=mask).logits
        assert (got - ref)[real].abs().max() < TOL, name


@pytest.mark.parametrize(
    "nq, nk, q_offset, predicate",
    [
        (1, 10, 9, causal_mask_function),  # decoding onto a cache
        (10, 10, 0, causal_mask_function),
        (4, 10, 3, causal_mask_function),  # a static cache: slots past the last query unused
        (4, 10, 0, bidirectional_mask_function),
    ],
)
def test_a_mask_spec_read_as_a_tensor_is_transformers_own_mask(nq, nk, q_offset, predicate):
    """A model that slices the mask it is handed (DeepSeek-V3.2's indexer) gets transformers' own
    boolean mask, not a crash."""
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[1, :3] = False
    off = torch.tensor(q_offset) if nq == 4 and predicate is causal_mask_function else q_offset
    spec = hf.mask_function(2, nq, nk, q_offset=off, mask_function=predicate, attention_mask=pad)
    ref = sdpa_mask(
        2, nq, nk, q_offset=q_offset, mask_function=predicate, attention_mask=pad, allow_is_causal_skip=False
    )  # (B, 1, Nq, Nk)
    assert torch.equal(spec.dense().expand_as(ref), ref)
    assert torch.equal(spec[:, 0], ref[:, 0])


def test_deepseek_v32_indexed_attention_matches_eager():
    """DeepSeek-V3.2's indexer picks top-k keys per query and hands them as ``indices``: exact
    variants that take an attn_mask attend over exactly those (eager's logits); the others refuse."""
    from transformers.models.deepseek_v32.configuration_deepseek_v32 import DeepseekV32Config

    small = dict(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32)
    cfg = DeepseekV32Config(
        **small, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, index_topk=6,
        index_head_dim=16, index_n_heads=2, first_k_dense_replace=1, max_position_embeddings=64,
        initializer_range=0.1, head_dim=8,
    )  # fmt: skip
    eager, ids, mask, real = _eager_on_a_padded_batch(cfg)
    every = copy.deepcopy(cfg)
    every.index_topk = 64  # top-64 of 20 keys: every key
    with torch.inference_mode():
        ref = eager(ids, attention_mask=mask).logits
        dense = _model(every, "eager", eager.state_dict())(ids, attention_mask=mask).logits
    assert (dense - ref)[real].abs().max() > 100 * TOL  # the indexer's choice moves the logits
    for name in EXACT:
        model = _model(cfg, hf.implementation_for(name, CPU_KNOBS.get(name, {})), eager.state_dict())
        with torch.inference_mode():
            got = model(ids, attention_mask=mask).logits
        assert (got - ref)[real].abs().max() < TOL, name
    model = _model(cfg, hf.implementation_for("local_window", {"window": 4}), eager.state_dict())
    with pytest.raises(variants.Unsupported, match="attn_mask"):
        model(ids, attention_mask=mask)


# ---------------------------------------------------------------- sliding-window layers as a window
def _sliding_models():
    """Mistral (every layer a window of 4 keys), Qwen2 and Gemma3 (a sliding layer, then a full one),
    ModernBERT (a bidirectional local layer of radius 4, then a global one)."""
    from transformers import Gemma3TextConfig, ModernBertConfig, Qwen2Config

    small = dict(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, initializer_range=0.1
    )
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    mixed = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    return {
        "mistral": MistralConfig(**small, **heads, sliding_window=4),
        "qwen2": Qwen2Config(**small, **heads, **mixed, use_sliding_window=True, max_window_layers=1),
        "gemma3": Gemma3TextConfig(**small, **heads, **mixed, query_pre_attn_scalar=16),
        "modernbert": ModernBertConfig(
            **small,
            num_attention_heads=4,
            max_position_embeddings=64,
            local_attention=8,
            global_attn_every_n_layers=2,
            pad_token_id=0,
        ),  # fmt: skip
    }


def test_a_sliding_window_mask_reaches_the_layer_as_a_window():
    """The mask function finds transformers' sliding window (W keys: radius W - 1) in the mask it
    builds and hands a window, not an (Nq, Nk) mask; a predicate that is no window stays a mask."""
    cfg = MistralConfig(**{**LLAMA, "sliding_window": 4})
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[1, :3] = False
    sw = sliding_window_causal_mask_function(4)
    spec = hf.mask_function(2, 10, 10, mask_function=sw, attention_mask=pad, config=cfg)
    assert spec.window == 3 and spec.causal and spec.attn_mask is None
    ref = sdpa_mask(2, 10, 10, mask_function=sw, attention_mask=pad, allow_is_causal_skip=False)
    assert torch.equal(spec.dense().expand_as(ref), ref)
    other = hf.mask_function(2, 10, 10, mask_function=sliding_window_causal_mask_function(5), config=cfg)
    assert other.window is None and other.attn_mask is not None  # not the config's window: a mask


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "gemma3", "modernbert"])
def test_sliding_window_models_run_window_variants_and_match_eager(kind):
    """Every exact variant, and local_window wider than the model's window (the sliding layers take
    the model's window, the full ones local_window's own), give eager's logits and, for the decoders,
    its greedy tokens; sparse, which takes no window, refuses by name."""
    from transformers import AutoModelForMaskedLM

    cfg = _sliding_models()[kind]
    cls = AutoModelForMaskedLM if kind == "modernbert" else AutoModelForCausalLM
    torch.manual_seed(0)
    eager = cls.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    real = mask.bool()

    def outputs(model):
        with torch.inference_mode():
            logits = model(ids, attention_mask=mask).logits
            if kind == "modernbert":
                return logits, None
            return logits, model.generate(
                ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0
            )

    ref, ref_tokens = outputs(eager)
    runs = [(n, CPU_KNOBS.get(n, {})) for n in EXACT] + [("local_window", {"window": 64})]
    for name, knobs in runs:
        model = cls.from_config(
            copy.deepcopy(cfg), attn_implementation=hf.implementation_for(name, knobs)
        ).eval()
        model.load_state_dict(eager.state_dict())
        got, tokens = outputs(model)
        assert (got - ref)[real].abs().max() < TOL, name
        assert tokens is None or torch.equal(tokens, ref_tokens), name
    model = cls.from_config(
        copy.deepcopy(cfg), attn_implementation=hf.implementation_for("sparse", {"block": 4})
    )
    model.load_state_dict(eager.state_dict())
    with pytest.raises(variants.Unsupported, match="takes no sliding window"), torch.inference_mode():
        model.eval()(ids[:1])  # unpadded row 0: ModernBERT's full layer 0 would refuse row 1's padding


def test_a_layer_map_runs_gemma_style_local_and_global_layers_with_any_pair():
    """register_layers: one variant on the sliding-window layers, another on the full ones. The right
    pair gives eager's logits on Gemma3 (sliding, then full); a window of 1 on either kind of layer
    moves them, so each variant ran where it was put."""
    cfg = _sliding_models()["gemma3"]
    eager, ids, mask, real = _eager_on_a_padded_batch(cfg)
    with torch.inference_mode():
        ref = eager(ids, attention_mask=mask).logits

    def gap(impl):
        model = _model(cfg, impl, eager.state_dict())
        with torch.inference_mode():
            return (model(ids, attention_mask=mask).logits - ref)[real].abs().max().item()

    assert gap(hf.register_layers("mix_window_sdpa", ("local_window", {"window": 64}), "sdpa")) < TOL
    assert gap(hf.register_layers("mix_naive_chunked", "naive", "chunked")) < TOL
    assert gap(hf.register_layers("mix_narrow_sliding", ("local_window", {"window": 1}), "sdpa")) > 100 * TOL
    assert gap(hf.register_layers("mix_narrow_full", "sdpa", ("local_window", {"window": 1}))) > 100 * TOL
    with pytest.raises(ValueError, match="would change every model already built"):
        hf.register_layers("mix_naive_chunked", "naive", "sdpa")


def test_registered_names_stay_what_they_were():
    """The same knobs again change nothing (the same instance keeps serving the models built on
    it); a name that would spell another's implementation string is refused; a dense mask is built
    on the model's device, not the CPU."""
    impl = hf.register_as("stays_w3", "local_window", window=3)
    first = hf.shared(impl)
    assert hf.register_as("stays_w3", "local_window", window=3) == impl and hf.shared(impl) is first
    hf.register(["sdpa"])
    with pytest.raises(ValueError, match="both spell attnbench_SDPA"):
        hf.register_as("SDPA", "naive")
    assert "flash" not in hf.implementation_for("sdpa", {"backend": "flash"})  # read as FlashAttention
    spec = hf.MaskSpec(True, None, None, 3, 5, 5, 2, torch.device("meta"))
    assert spec.dense().device.type == "meta"


def test_a_window_is_recognised_by_a_few_rows_first_and_checked_whole_once(monkeypatch):
    # the candidates that differ in the sampled rows never build their (Nq, Nk) mask; the one that
    # matches is compared whole (a band that differs only outside the sampled rows is not a window)
    from types import SimpleNamespace

    n, w = 64, 4
    pos = torch.arange(n)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - w)  # (Nq, Nk): causal, radius 4
    whole = []
    dense = hf.MaskSpec.dense

    def counting(self, rows=None):
        if rows is None:
            whole.append(self.window)
        return dense(self, rows)

    monkeypatch.setattr(hf.MaskSpec, "dense", counting)
    config = SimpleNamespace(sliding_window=w + 1)  # radii tried: 4 (causal W - 1) and 2 (W // 2)
    spec = hf._as_window(band[None, None], config, None, n, n, n, 0)
    assert spec is not None and spec.window == w and spec.causal and whole == [w]
    odd = band.clone()
    odd[5, 0] = True  # row 5 is not among the sampled rows: found only by the whole comparison
    whole.clear()
    assert hf._as_window(odd[None, None], config, None, n, n, n, 0) is None
    assert whole == [w]
    rows = torch.tensor([0, 7, 63])
    assert torch.equal(dense(spec, rows), dense(spec)[:, :, rows])  # a row's mask is the whole's row


# ---------------------------------------------------------------- packed sequences (position_ids)

PACKED = [[10, 14], [5, 12, 7]]  # per row, the lengths of the sequences packed into its 24 tokens


def _packed_inputs():
    """``ids (2, 24)`` and ``position_ids`` that restart at each packed sequence (as transformers'
    ``DataCollatorWithFlattening`` gives them), and the ids per key the variant should get."""
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in PACKED])  # (2, 24)
    docs = torch.cat([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])[None] for row in PACKED])
    return ids, pos, docs


@torch.inference_mode()
def _each_sequence_alone(model, ids):
    """The logits of every packed sequence run through ``model`` on its own, joined: ``(2, 24, vocab)``,
    what a packed batch means."""
    rows = []
    for r, lengths in enumerate(PACKED):
        parts, start = [], 0
        for n in lengths:
            parts.append(model(ids[r : r + 1, start : start + n], use_cache=False).logits)
            start += n
        rows.append(torch.cat(parts, 1))
    return torch.cat(rows)


def test_packed_position_ids_reach_the_layer_as_documents():
    """transformers masks position_ids that restart as separate sequences; the mask function reads
    that mask as causal attention over packed documents (ids, no (Nq, Nk) mask), checked against it."""
    from transformers.masking_utils import and_masks, packed_sequence_mask_function

    _, _, docs = _packed_inputs()
    packed = and_masks(causal_mask_function, packed_sequence_mask_function(docs))
    spec = hf.mask_function(2, 24, 24, mask_function=packed, config=LlamaConfig(**LLAMA))
    assert spec.causal and spec.attn_mask is None and torch.equal(spec.documents, docs)
    ref = sdpa_mask(2, 24, 24, mask_function=packed, allow_is_causal_skip=False)
    assert torch.equal(spec.dense(), ref)
    # one sequence per row is no packing: plain causal; a predicate that is not packing stays a mask
    whole = hf.mask_function(
        2, 24, 24, mask_function=and_masks(causal_mask_function, lambda b, h, q, k: k != 3)
    )
    assert whole.documents is None and whole.attn_mask is not None


@pytest.mark.parametrize("name", EXACT)
def test_exact_variants_run_a_packed_batch_as_eager_does(name):
    """A packed batch (restarting position_ids, no attention_mask, no cache) gives eager's logits, which
    are each sequence run alone."""
    eager, _ = llama_eager()
    ids, pos, _ = _packed_inputs()
    with torch.inference_mode():
        ref = eager(ids, position_ids=pos, use_cache=False).logits
        got = _attnbench_model(name)(ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(ref, _each_sequence_alone(eager, ids), rtol=1e-4, atol=1e-4)
    assert (got - ref).abs().max() < TOL


@pytest.mark.parametrize("name", ["gated_deltanet", "linear", "window_linear"])
def test_a_recurrence_runs_a_packed_batch_as_each_sequence_alone(name):
    """A recurrence takes no (Nq, Nk) mask: it runs a packed batch only because the documents reach it
    as ids, and its logits are those of each sequence run alone through the same model."""
    eager, _ = llama_eager()
    knobs = {"heads": 8, "head_dim": 16} if variants.get(name).has_params else {}
    model = _attnbench_model(name, knobs, key=f"packed-{name}")
    ids, pos, _ = _packed_inputs()
    with torch.inference_mode():
        got = model(ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, _each_sequence_alone(model, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [2, 64])
def test_local_window_runs_a_packed_sliding_window_batch_as_eager_does(window):
    """Mistral (a window of 4 keys in every layer) on a packed batch: eager's logits are each sequence
    run alone, and local_window gives them, its band stopped at each sequence's start (the mask
    reaches it as documents and the model's window, the narrower of which it takes)."""
    eager, _ = llama_eager()
    ref_model = _model(MistralConfig(**{**LLAMA, "sliding_window": 4}), "eager", eager.state_dict())
    model = _model(ref_model.config, "eager", eager.state_dict())
    hf.attach(model, "local_window", window=window)
    ids, pos, _ = _packed_inputs()
    with torch.inference_mode():
        ref = ref_model(ids, position_ids=pos, use_cache=False).logits
        got = model(ids, position_ids=pos, use_cache=False).logits
        unpacked = ref_model(ids, use_cache=False).logits
    torch.testing.assert_close(ref, _each_sequence_alone(ref_model, ids), rtol=1e-4, atol=1e-4)
    assert (unpacked - ref).abs().max() > 100 * TOL  # the packing changes the logits
    if window >= 3:
        assert (got - ref).abs().max() < TOL
    else:  # narrower than the model's window: its own band, still within each sequence
        want = _each_sequence_alone(model, ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
