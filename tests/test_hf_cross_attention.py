"""Cross-attention through the transformers backend, on three encoder-decoders transformers ships (BART,
T5, Whisper; tiny random weights, no download), every stateless variant that runs on the CPU.

A decoder's cross-attention reads the encoder's keys: no decoder position stands among them. A variant
that read the decoder's queries as the last positions of the encoder's sequence (as when decoding
against a cache) would give a decoder position logits that depend on how many decoder tokens share
the call, and ``generate`` (one token a call) would disagree with one teacher-forced forward. So, for
every variant that runs: (a) position 2's logits are the same in a 3-token and a 6-token call, (b)
greedy ``generate`` gives, step by step, the logits of one teacher-forced forward of the tokens it
generated, both within 1e-5; exact variants also match eager within 1e-4. A variant that cannot run
refuses in one line, and one whose pattern relates positions (``supports_cross`` False) names
cross-attention as the reason.
"""

from __future__ import annotations

import copy

import pytest
import torch

import variants
from variants import Unsupported

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForSeq2SeqLM,
    BartConfig,
    T5Config,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

from integrations import transformers_backend as hf  # noqa: E402

VOCAB, ENC, DEC, GEN = 64, 12, 6, 5  # vocabulary, encoder tokens, decoder tokens, generated tokens
KNOBS = {"flex": {"compile": False}, "local_window": {"window": 2}}
# stateless variants that run on the CPU (learned ones need attach(): one instance per layer)
NAMES = [
    n for n in variants.available() if not variants.get(n).has_params and "cpu" in variants.get(n).devices
]


def _configs():
    """Tiny configs, weights drawn wide enough that attention is not uniform."""
    return {
        "bart": BartConfig(
            vocab_size=VOCAB,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            init_std=0.1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
            forced_eos_token_id=None,
        ),  # fmt: skip
        "t5": T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        ),  # fmt: skip
        "whisper": WhisperConfig(
            vocab_size=VOCAB,
            num_mel_bins=8,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=16,
            max_target_positions=32,
            decoder_start_token_id=1,
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=1,
            init_std=0.1,
            begin_suppress_tokens=None,
            suppress_tokens=None,
        ),  # fmt: skip
    }


def _model(kind: str, impl: str, state=None):
    cfg = copy.deepcopy(_configs()[kind])
    cls = WhisperForConditionalGeneration if kind == "whisper" else None
    if cls is None:
        model = AutoModelForSeq2SeqLM.from_config(cfg, attn_implementation=impl)
    else:
        model = cls._from_config(cfg, attn_implementation=impl)
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def _encoder_inputs(kind: str) -> dict[str, torch.Tensor]:
    """The encoder's input: audio features (Whisper) or token ids with the second row right-padded."""
    g = torch.Generator().manual_seed(0)
    if kind == "whisper":
        return {"input_features": torch.randn(2, 8, 32, generator=g)}  # (B, mel bins, 2 x 16 frames)
    ids = torch.randint(3, VOCAB, (2, ENC), generator=g)
    mask = torch.ones_like(ids)
    mask[1, ENC - 3 :] = 0  # 3 padded encoder tokens
    return {"input_ids": ids, "attention_mask": mask}


@torch.inference_mode()
def _outputs(model, kind: str) -> dict[str, torch.Tensor]:
    """What the checks compare: teacher-forced logits of 3 and of 6 decoder tokens, and generate's
    per-step logits beside one forward over the tokens it generated."""
    enc = _encoder_inputs(kind)
    dec = torch.randint(3, VOCAB, (2, DEC), generator=torch.Generator().manual_seed(3))
    dec[:, 0] = model.config.decoder_start_token_id
    gen = model.generate(
        **enc, max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    forced = model(**enc, decoder_input_ids=gen.sequences[:, :-1]).logits  # (B, GEN, vocab)
    return {
        "three": model(**enc, decoder_input_ids=dec[:, :3]).logits,  # (B, 3, vocab)
        "six": model(**enc, decoder_input_ids=dec).logits,  # (B, 6, vocab)
        "generated": torch.stack(gen.logits, 1),  # (B, GEN, vocab): one token a call
        "forced": forced[:, -GEN:],
    }


_eager: dict[str, tuple] = {}


def _eager_run(kind: str):
    """Eager's weights and outputs, once per model."""
    if kind not in _eager:
        torch.manual_seed(0)
        model = _model(kind, "eager")
        _eager[kind] = (model.state_dict(), _outputs(model, kind))
    return _eager[kind]


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["bart", "t5", "whisper"])
def test_cross_attention_decodes_consistently_or_refuses(kind, name):
    impl = hf.implementation_for(name, KNOBS.get(name))
    state, eager = _eager_run(kind)
    model = _model(kind, impl, state)
    try:
        got = _outputs(model, kind)
    except Unsupported as exc:
        message = str(exc)
        assert "\n" not in message and impl in message, message
        cls = variants.get(name)
        # one that could read the queries as the last positions of the keys' sequence says why not
        # (an encoder layer is refused first by a causal-only core, T5's bias by some)
        if (
            not cls.supports_cross
            and cls.supports_decode
            and cls.supports_noncausal
            and "bias" not in message
        ):
            assert "cross-attention" in message, message
        return
    assert variants.get(name).supports_cross, f"{name} ran cross-attention without supporting it"
    assert _gap(got["three"], got["six"][:, :3]) < 1e-5, "position 0-2 moved with the later tokens"
    assert _gap(got["generated"], got["forced"]) < 1e-5, "generate disagrees with teacher forcing"
    if variants.get(name).exact:
        assert _gap(got["six"], eager["six"]) < 1e-4
        assert _gap(got["generated"], eager["generated"]) < 1e-4


def test_the_checks_can_fail():
    """What the test above compares moves by far more than its tolerance when it should: the
    encoder's padding and the decoder's tokens change the logits (so neither is ignored)."""
    _, eager = _eager_run("bart")
    assert _gap(eager["three"][:, 2], eager["six"][:, 2]) < 1e-5  # causal: position 2 sees only 0-2
    assert _gap(eager["six"][:, 2], eager["six"][:, 3]) > 1e-2  # but the positions differ
    state, _ = _eager_run("bart")
    model = _model("bart", "eager", state)
    enc = _encoder_inputs("bart")
    dec = torch.full((2, 1), model.config.decoder_start_token_id)
    with torch.inference_mode():
        padded = model(**enc, decoder_input_ids=dec).logits
        unpadded = model(input_ids=enc["input_ids"], decoder_input_ids=dec).logits
    assert _gap(padded[1], unpadded[1]) > 1e-3  # the encoder's padding reaches the cross-attention


@pytest.mark.parametrize(
    "is_decoder, is_causal, causal, nq, nk, want",
    [
        (True, False, False, 3, 3, True),  # a decoder's cross-attention module
        (True, True, False, 3, 3, False),  # the decoder's self-attention module
        (False, False, False, 5, 5, False),  # the encoder's
        (False, False, False, 3, 5, True),  # fewer queries than keys, not causal: no encoder keeps a cache
        (True, False, True, 3, 5, False),  # a causal call is never cross-attention
    ],
)
# (a decoder-only model's general mask, decoding against a cache: not cross-attention)
@pytest.mark.parametrize("masked", [False, True])
def test_the_backend_tells_cross_attention_from_the_module(
    is_decoder, is_causal, causal, nq, nk, want, masked
):
    from transformers.models.bart.modeling_bart import BartAttention

    cfg = _configs()["bart"]
    layer = BartAttention(32, 4, is_decoder=is_decoder, is_causal=is_causal, config=cfg, layer_idx=0)
    if masked and not is_decoder and nq != nk:
        want = False  # a sliding-window or indexed mask decoding against a cache
    assert hf.is_cross_attention(layer, causal, nq, nk, masked) is want
