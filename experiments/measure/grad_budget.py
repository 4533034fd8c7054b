"""How a job's gradient check runs within the machine: in one float64 oracle call, in blocks of
query rows, or not at all (and why)."""

from __future__ import annotations

from variants import AttentionVariant, Workload
from variants.base import takes_rows

#: float64 bytes a gradient check may hold at its peak (``oracle_graph_bytes`` of every row at once,
#: else :func:`blocked_check_bytes` of a block of rows). Until 2026-11-28 it was 256 MiB of a count
#: that left the softmax's graph out (its peak was 3.9-5.3x the count), then 1 GiB of this count,
#: which kept sdpa's whole check at N=1024 (B=1, H=8, D=64). 2 GiB since checks run in blocks: at
#: N=32768 the inputs and their gradients alone are 0.8 GiB in float64; the output check's oracle
#: may hold as much (``FULL_ORACLE_BYTES``), and this project's VM has 24 GiB
GRAD_ORACLE_BYTES = 2 * 2**30
#: the fewest query rows an oracle call of a blocked check covers: below, the check is skipped
MIN_GRAD_ROWS = 16


def oracle_scores(variant: AttentionVariant, w: Workload) -> int:
    """Float64 scores a gradient check of ``w`` computes, in score-sized units: ``B * H`` times the
    pattern's pairs (the oracle computes only the keys a call's rows reach, :func:`variants.oracle`;
    a run of rows computes a little more, the keys any of its rows reaches) times
    :meth:`~variants.AttentionVariant.oracle_bytes_per_pair` over 8 (additive's hidden layer per
    pair). A variant's own formula (``oracle_forward``) costs every row against every key. sdpa's
    6.7e7 causal scores at N=4096, H=8 took 6.0 s in 3 calls on one core of this project's VM (2026-11-28).
    ``O(1)`` where the pattern's pairs are counted analytically."""
    if getattr(variant, "oracle_forward", None) is not None:
        pairs = w.nq * w.nk
    else:
        pairs = variant.num_pairs(w.nq, w.nk, w.causal) * variant.oracle_bytes_per_pair() // 8
    return w.batch * w.heads * pairs


def blocked_check_bytes(variant: AttentionVariant, w: Workload, rows: int) -> int:
    """Float64 bytes a gradient check in blocks of ``rows`` query rows holds at its peak: one block's
    oracle with its graph, q, k, v and their summed gradients (``oracle_graph_bytes``), the float64
    upstream gradient and a copy of the keys and values the block reaches. Not the ``(Nq, Nk)``
    pattern the blocks share (one byte a pair: 1 GiB at N=32768): the job's output check has built
    it already, as every call of the softmax oracle does. A third party's ``oracle_graph_bytes(w)``
    written before it took ``rows`` counts every row. ``O(1)``."""
    upstream = 8 * w.batch * w.heads * w.nq * w.v_head_dim
    reached = 8 * w.batch * w.hkv * w.nk * (w.head_dim + w.v_head_dim)
    count = variant.oracle_graph_bytes
    graph = count(w, rows=rows) if takes_rows(count) else count(w)
    return graph + upstream + reached


def gradient_block(variant: AttentionVariant, w: Workload, max_scores: int) -> int | str:
    """Query rows per oracle call of ``w``'s gradient check, or why there is no check.

    All of them (``w.nq``) while the oracle over every row with its graph fits
    :data:`GRAD_ORACLE_BYTES`, whatever its work, as before there were blocks. Beyond, ``w.nq`` halved
    until :func:`blocked_check_bytes` fits, while its work (:func:`oracle_scores`) is at most
    ``max_scores`` (the job's ``grad_check_scores``). No check below :data:`MIN_GRAD_ROWS` rows (a
    recurrence counts every row whatever the run), said before the work, which a
    larger budget would not mend. ``O(log Nq)``."""
    whole = variant.oracle_graph_bytes(w)
    if whole <= GRAD_ORACLE_BYTES:
        return w.nq
    at_once = f"float64 oracle {whole / 2**20:.0f} MiB > {GRAD_ORACLE_BYTES >> 20} MiB at once, and"
    rows = w.nq // 2
    while rows >= MIN_GRAD_ROWS and blocked_check_bytes(variant, w, rows) > GRAD_ORACLE_BYTES:
        rows //= 2
    if rows < MIN_GRAD_ROWS:  # memory first: a larger grad_check_scores would not help
        fewest = blocked_check_bytes(variant, w, MIN_GRAD_ROWS)
        return f"{at_once} {fewest / 2**20:.0f} MiB in blocks of {MIN_GRAD_ROWS} rows, the fewest"
    scores = oracle_scores(variant, w)
    if scores > max_scores:
        return f"{at_once} {scores:.3g} scores in blocks > grad_check_scores={max_scores:.3g}"
    return rows
