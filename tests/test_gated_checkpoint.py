"""The float64 recurrence's gradients, taken a checkpointed segment at a time
(``variants.gated_reference.gated_loop_reference`` under autograd): checked against finite
differences of the same function (``torch.autograd.gradcheck``), which never runs the segments'
backward, with segments and blocks small enough that every path is crossed."""

from __future__ import annotations

import pytest
import torch

import variants
from variants.gated_reference import checkpoint_width, gated_loop_reference

N = 11  # keys: segments of 4 (ceil(sqrt(11))), the last of 3


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q on 2 query heads, k and v on 1 K/V head, float64, requiring gradients."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, N, 3, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, N, 3, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, N, 2, generator=g, dtype=torch.float64)
    return tuple(t.requires_grad_(True) for t in (q, k, v))


def _strength(keys: torch.Tensor) -> torch.Tensor:
    """A delta rule's write strength from a block of keys ``(B, H, kb, D)``: ``(B, H, kb)``."""
    return torch.sigmoid(keys.sum(-1))


_g = torch.Generator().manual_seed(3)
VECTOR_DECAY = -torch.rand(1, 2, N, 3, generator=_g, dtype=torch.float64)
SCALAR_DECAY = -torch.rand(1, 2, N, generator=_g, dtype=torch.float64) * 3
PADDING = torch.rand(1, N, generator=_g) > 0.25
FORMS = {  # log_decay, beta, key_padding_mask, scale, normalize_keys
    "gated-vector-padded": (VECTOR_DECAY, None, PADDING, 0.4, False),
    "delta-padded": (None, _strength, PADDING, None, True),
    "gated-delta": (SCALAR_DECAY, _strength, None, None, True),
    "decay-from-keys": (lambda keys: -torch.nn.functional.softplus(keys[..., 0]), None, None, None, False),
}


def test_segments_are_the_square_root_of_the_keys():
    assert [checkpoint_width(n) for n in (1, 2, 4, 5, 23, 25, 26, 32768)] == [1, 2, 2, 3, 5, 5, 6, 182]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("block_bytes", [300, 2**25], ids=["blocks-of-2-keys", "segments"])
def test_the_checkpointed_gradients_are_the_functions(form, block_bytes):
    """dq, dk and dv of every row equal finite differences of the output to 1e-6 (gradcheck's
    tolerance), with a block of keys smaller than a segment and with segments alone."""

    def f(q, k, v):
        return gated_loop_reference(q, k, v, *FORMS[form], block_bytes=block_bytes)

    assert torch.autograd.gradcheck(f, _inputs())


@pytest.mark.parametrize("form", FORMS)
def test_rows_in_any_order_and_repeated_are_those_rows_of_all(form):
    """The rows come back in the order asked, a repeated row twice, the same numbers as those rows
    of the whole output, and their gradients are the functions' (the last 8 queries of the 11 keys)."""
    q, k, v = _inputs(1)
    rows = torch.tensor([7, 3, 0, 3, 5])
    with torch.no_grad():
        everything = gated_loop_reference(q[:, :, -8:], k, v, *FORMS[form])
        picked = gated_loop_reference(q[:, :, -8:], k, v, *FORMS[form], rows=rows)
    assert torch.equal(picked, everything[:, :, rows])
    with_graph = gated_loop_reference(q[:, :, -8:], k, v, *FORMS[form], rows=rows)
    assert torch.equal(with_graph.detach(), picked)

    def f(q, k, v):
        return gated_loop_reference(q[:, :, -8:], k, v, *FORMS[form], rows=rows)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_a_whole_gate_gets_its_gradient():
    q, k, v = _inputs(2)
    g = VECTOR_DECAY.clone().requires_grad_(True)

    def f(g):
        return gated_loop_reference(q, k, v, g, None, PADDING, None, False)

    assert torch.autograd.gradcheck(f, (g,))


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_the_gates_parameters_get_their_gradients_through_the_segments(name):
    """A variant's oracle hands its parameters to the loop (the gates read them): their gradients
    through the segments are finite differences' (the registry-wide tests compare the variant's with
    these). Left out, they got none: a checkpoint's backward reaches only its inputs."""
    torch.manual_seed(0)
    attn = variants.build(name, heads=2, head_dim=3).double()
    q, k, v = (t.detach() for t in _inputs(3))
    params = tuple(attn.parameters())

    def f(*_params):  # gradcheck moves the parameters themselves, which the oracle reads
        return variants.oracle(attn, q, k, v, causal=True)

    assert torch.autograd.gradcheck(f, params)


@pytest.mark.parametrize("form", ["delta-padded"])
def test_a_second_derivative_runs_through_the_segments(form):
    """A second derivative (the registry-wide tests take one through the oracle) reaches the inputs
    through each segment run again: gradgradcheck against finite differences of the gradients."""

    q, k, v = _inputs(4)

    def f(k, v):  # the output is linear in q: its second derivative there is zero
        return gated_loop_reference(q.detach(), k, v, *FORMS[form], block_bytes=300)

    assert torch.autograd.gradgradcheck(f, (k, v))
