"""Pattern variants against compiled FlexAttention with the identical pattern (CPU, forward).

Issue 12's goal on the CPU: ``local_window`` and ``sparse`` forward no slower than compiled flex with
the same pattern (flex has no CPU backward, so these are the CPU's forward+backward option). Measured
at N=2048 (B=1, H=8, D=64, fp32, one thread, window 128, sparse block 64), interleaved with flex
round by round in CPU time (:func:`benchmarks.gates.interleaved_times`), the median of per-round
ratios against ``GOAL`` times ``MACHINE_TOL`` (another CPU moves the ratio; on this project's CPU it was
0.59 and 0.90). A ratio over the limit is measured once more with twice the rounds before it counts.
Compiling the two flex kernels takes about 20 s.
"""

from __future__ import annotations

import pytest
import torch

import variants
from benchmarks import gates

N, HEADS, HEAD_DIM = 2048, 8, 64
GOAL = 1.0  # no slower than flex
MACHINE_TOL = 1.15
ROUNDS = 15
PAIRS = {
    "local_window": ({"window": 128}, {"pattern": "window", "window": 128, "block": 128}),
    "sparse": ({"block": 64}, {"pattern": "sparse", "block": 64}),
}


def _ratio(fn, ref, rounds: int) -> dict:
    return gates.summarize_times(*gates.interleaved_times(fn, ref, rounds))


@pytest.mark.parametrize("name", list(PAIRS))
def test_pattern_variant_forward_is_no_slower_than_compiled_flex(name: str) -> None:
    knobs, flex_knobs = PAIRS[name]
    attn = variants.build(name, **knobs)
    flex = variants.build("flex", **flex_knobs)
    g = torch.Generator().manual_seed(gates.SEED)
    q, k, v = (torch.randn(1, HEADS, N, HEAD_DIM, generator=g) for _ in range(3))

    def fn() -> None:
        with torch.no_grad():
            attn(q, k, v)

    def ref() -> None:
        with torch.no_grad():
            flex(q, k, v)

    with gates.pinned_threads():
        torch._dynamo.reset()  # one compile for this shape, whatever ran before
        fn(), ref()  # compile flex, warm both
    limit = GOAL * MACHINE_TOL
    got = _ratio(fn, ref, ROUNDS)
    if got["time_ratio"] > limit:  # confirm: a real regression fails twice
        got = _ratio(fn, ref, 2 * ROUNDS)
    assert attn.describe()["impl_ran"] == "sdpa"
    assert got["time_ratio"] <= limit, (
        f"{name} forward at N={N} takes {got['time_ratio']:.2f}x compiled flex's time with the same "
        f"pattern (IQR {got['ratio_q1']:.2f}-{got['ratio_q3']:.2f}; {got['time_s'] * 1e3:.1f} ms vs "
        f"{got['ref_time_s'] * 1e3:.1f} ms CPU time per call); the goal is {GOAL:g}x, allowed {limit:.2f}x"
    )
