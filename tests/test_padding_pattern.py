"""Left padding and a variant's pattern: a batch prepared for generation pads its shorter sequences
in front, and a variant whose pattern is anchored at absolute positions (sparse's blocks, axial's
grid) would give their real tokens other keys than the sequence alone. ``left_padding_moves_pattern``
says so, and the transformers backend refuses such a batch in one line.

The oracle for the fact is the variant's own ``pattern()``, cut: a left-padded sequence's real tokens
see ``pattern(n)[s:, s:]``, against ``pattern(n - s)`` alone. Every registered variant and example
knob set is checked (a third party's included): a pattern that moves must be said, and a said one must
move. The backend's refusal is checked on a real transformers model, and right padding, which it lets
through, against each sequence run alone where the pattern keeps its prefix (causal sparse).
"""

from __future__ import annotations

import pytest
import torch

import variants
from variants import Unavailable

from .helpers import param_id, variant_params

N = 40  # long enough for several of the example knobs' blocks, grids and windows


def _pattern(attn, n: int, causal: bool) -> torch.Tensor | None:
    """``attn``'s ``(n, n)`` pattern, or None where it has none at that length (axial's grid)."""
    try:
        return attn.pattern(n, n, causal)
    except (variants.Unsupported, ValueError):
        return None


def _moves(attn, causal: bool) -> bool:
    """Whether left padding gives some real tokens another pattern than the sequence alone."""
    whole = _pattern(attn, N, causal)
    assert whole is not None
    for m in range(2, N):
        alone = _pattern(attn, m, causal)
        if alone is not None and not torch.equal(whole[N - m :, N - m :], alone):  # the real (m, m) pairs
            return True
    return False


@pytest.mark.parametrize("vp", variant_params(), ids=param_id)
def test_a_pattern_that_moves_with_left_padding_says_so(vp):
    name, knobs = vp
    try:
        attn = variants.get(name)(**knobs)
    except Unavailable as exc:
        pytest.skip(str(exc))
    cls = variants.get(name)
    said = attn.left_padding_moves_pattern()
    sinks = attn.sink_keys() > 0  # said by sink_keys, refused by their own check
    for causal in [c for c in (True, False) if (cls.supports_causal if c else cls.supports_noncausal)]:
        assert _moves(attn, causal) == bool(said or sinks), (
            f"{name} {knobs} causal={causal}: the pattern {'moves' if not said else 'does not move'} with "
            f"left padding, left_padding_moves_pattern says {said!r}"
        )
    assert said is None or ("\n" not in said and said.startswith(name)), said


def test_the_fact_is_checked_both_ways():
    """A sparse that says nothing, and a window that would claim to move, each fail the check above."""
    sparse = variants.get("sparse")(block=4, window_blocks=1, global_blocks=0, random_blocks=0)
    assert _moves(sparse, causal=True) and _moves(sparse, causal=False)
    window = variants.get("local_window")(window=3)
    assert not _moves(window, causal=True) and not _moves(window, causal=False)
    assert window.left_padding_moves_pattern() is None


transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from integrations import transformers_backend as hf  # noqa: E402

from .test_transformers_backend import LLAMA  # noqa: E402

KNOBS = {"sparse": {"block": 4}, "axial": {}}


def _llama(name: str):
    implementation = hf.implementation_for(name, KNOBS[name])  # registered under its knobs' own name
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA)  # the backend tests' tiny Llama: peaked attention (std 0.1)
    return AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()


def _batch(left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids (2, 24)`` and a mask whose row 1 has 7 pads on one side."""
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, slice(None, 7) if left else slice(17, None)] = 0
    return ids, mask


def _row_alone(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row 1's logits at its real tokens, batched and run alone: ``(17, vocab)`` each."""
    real = mask[1].bool()
    batched = model(ids, attention_mask=mask).logits[1, real]
    return batched, model(ids[1:, real]).logits[0]


@pytest.mark.parametrize("name", ["sparse", "axial"])
@torch.inference_mode()
def test_the_backend_refuses_a_left_padded_batch_a_pattern_moves_with(name):
    ids, mask = _batch(left=True)
    with pytest.raises(variants.Unsupported, match=rf"rows \[1\] are left-padded, but {name}"):
        _llama(name)(ids, attention_mask=mask)


@torch.inference_mode()
def test_right_padding_runs_and_causal_sparse_gives_the_row_alone():
    """Right padding lays the pattern over the padded length, pads masked: causal sparse keeps its
    prefix, so a right-padded row gives what it gives alone."""
    model = _llama("sparse")
    ids, mask = _batch(left=False)
    batched, alone = _row_alone(model, ids, mask)
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_without_the_refusal_a_left_padded_row_is_silently_other(monkeypatch):
    """What the refusal guards: sparse's blocks moved by left padding change the row's logits."""
    model = _llama("sparse")
    ids, mask = _batch(left=True)
    monkeypatch.setattr(variants.get("sparse"), "left_padding_moves_pattern", lambda self: None)
    batched, alone = _row_alone(model, ids, mask)
    assert (batched - alone).abs().max() > 1e-2
