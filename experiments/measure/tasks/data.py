"""Synthetic tasks for the task-accuracy axis, generated from a seed (no downloads).

Each task draws ``n`` examples of length ``seq_len`` with vectorised torch ops: time and memory
``O(n * seq_len)``, no Python loop over examples. An example is scored only where ``target`` is not
:data:`IGNORE`; accuracy is exact match of the predicted token at those positions (per answer token)
and of the whole answer (per example).

- ``recall``: multi-query associative recall (after MQAR, Arora et al. 2023, "Zoology").
  ``num_pairs`` key-value pairs open the sequence, then keys are asked at random later positions;
  the answer at a query is the value bound to that key. The key-to-query distance of each query is
  recorded; ``gap`` filler tokens between the pairs and the first query set its minimum, so a local
  pattern of reach ``r`` is blind to queries farther than ``r`` from their key.
- ``copy``: copy a string of ``copy_len`` symbols after a separator (every answer is ``copy_len + 1``
  tokens from its source), or, with ``selective``, copy only the symbols scattered among filler
  tokens, in order (the selective-copying task of Gu & Dao 2023, "Mamba").
- ``reverse``: sequence to sequence through cross-attention. The source is ``seq_len`` symbols; the
  decoder reads ``[BOS] + y`` and predicts ``y + [EOS]`` with ``y`` the reversed (or sorted) source,
  so source and target lengths differ (``N`` and ``N + 1``).

Held-out test split: every example belongs to train or test by a fixed hash of its tokens
(:func:`is_test`), and each split keeps only its own examples, so no test example is ever trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

IGNORE = -100  # target at positions that are not scored (torch's cross_entropy ignore_index)
TEST_FRACTION = 8  # one example in this many (by hash) belongs to the test split
_HASH_PRIME = 1_000_003
_HASH_SEED = 20240601  # fixed forever: changing it reshuffles which examples are test examples


@dataclass
class Batch:
    """A batch of examples; every tensor is int64 with the batch first."""

    src: torch.Tensor  # (B, N) encoder input
    target: torch.Tensor  # (B, T) token to predict, IGNORE where nothing is scored (T = N without decoder)
    dec_in: torch.Tensor | None = None  # (B, T) decoder input (seq2seq tasks only)
    distance: torch.Tensor | None = None  # (B, T) key-to-query distance at scored positions, -1 elsewhere
    aux: torch.Tensor | None = None  # (B, T) extra training targets, never scored; IGNORE elsewhere

    def __len__(self) -> int:
        return self.src.shape[0]

    def rows(self, idx: torch.Tensor | slice) -> Batch:
        """The examples ``idx`` (a boolean mask, index tensor or slice) as a new batch."""
        return Batch(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                for f in fields(self)
            }
        )

    def to(self, device: str | torch.device) -> Batch:
        return Batch(
            **{
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                for f in fields(self)
            }
        )

    @staticmethod
    def cat(parts: list[Batch]) -> Batch:
        """Concatenate batches of the same task along the batch dimension."""
        out = {}
        for f in fields(Batch):
            vals = [getattr(p, f.name) for p in parts]
            out[f.name] = None if vals[0] is None else torch.cat(vals, dim=0)
        return Batch(**out)


class Task:
    """A task: its vocabulary, whether it needs a decoder, and a sampler of examples.

    Subclasses take their knobs as keyword arguments (those of ``conf/task/<name>.yaml`` that are not
    training settings) and validate them against ``seq_len`` at construction.
    """

    name: ClassVar[str] = ""
    seq2seq: ClassVar[bool] = False
    vocab_size: int

    def __init__(self, seq_len: int) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 for a task, got {seq_len}")
        self.seq_len = seq_len

    def sample(self, n: int, g: torch.Generator) -> Batch:
        """``n`` fresh examples drawn with ``g`` (both splits mixed; see :func:`draw`)."""
        raise NotImplementedError

    def knobs(self) -> dict[str, Any]:
        """The resolved knobs (defaults filled in), for records."""
        return {}


class Recall(Task):
    """Multi-query associative recall with a recorded key-to-query distance per query.

    Layout of one example (``P = num_pairs``; ``w = 1`` with ``pair_tokens``, else 2)::

        P key-value pairs (w*P tokens) | gap x filler | queries at random positions [among filler]
        0                    w*P - 1     w*P            w*P + gap ...                          N-1

    A query is a key token; its answer (scored at the query's position) is the value bound to that
    key. Keys are distinct within an example; values, and the key each query asks for, are drawn
    with replacement. The distance of a query is its position minus that of its key's pair.

    ``pair_tokens=True`` (default): each pair is one token (one per (key, value) combination), so
    retrieval is one content-based hop from the query to the pair. ``False``: MQAR as in Zoology
    (Arora et al. 2023), key then value as two tokens; then recall takes two hops (bind each value to
    its key, then find the key) and neither lowers the loss until the other exists: small models
    sit on a plateau (loss about ln(num_values)) for a random number of steps (here ~500 to ~2500
    at N=128), too long and too seed-dependent for a few-minute CPU budget. ``pair_loss`` shortens
    that: each key position also gets its value as a training target (``aux``, never scored; it is
    local, so it tells a pattern nothing about the long-range hop that is measured).

    Vocabulary: 0 filler, ``1..K`` keys, ``K+1..K+V`` values, then (``pair_tokens``) the ``K*V``
    pair tokens, ``K = num_keys``, ``V = num_values``.

    Knobs: ``num_pairs`` key-value pairs per example; ``num_keys`` the key vocabulary (keys are
    distinct within an example, so ``>= num_pairs``); ``num_values`` the value vocabulary (``1 /
    num_values`` is not the floor: every value is in the context, and a model that binds no key
    scores the modal pair value's accuracy, :func:`context_floor`); ``gap`` filler tokens between
    the pairs and the first possible query (distance ``> gap``); ``num_queries`` queries per example
    (None: every position after the gap); ``pair_tokens`` and ``pair_loss`` as above.
    """

    name = "recall"

    def __init__(
        self,
        seq_len: int,
        num_pairs: int = 16,
        num_keys: int = 16,
        num_values: int = 16,
        gap: int = 0,
        num_queries: int | None = 16,
        pair_tokens: bool = True,
        pair_loss: bool = True,
    ) -> None:
        super().__init__(seq_len)
        if num_pairs < 1 or num_keys < num_pairs or num_values < 1 or gap < 0:
            raise ValueError(
                "recall needs 1 <= num_pairs <= num_keys, num_values >= 1, gap >= 0; got "
                f"num_pairs={num_pairs}, num_keys={num_keys}, num_values={num_values}, gap={gap}"
            )
        self.width = 1 if pair_tokens else 2  # tokens per pair
        room = seq_len - self.width * num_pairs - gap  # positions left for queries
        if room < 1 or (num_queries is not None and not 1 <= num_queries <= room):
            raise ValueError(
                f"recall with num_pairs={num_pairs}, gap={gap}, num_queries={num_queries} needs seq_len >= "
                f"{self.width} * num_pairs + gap + num_queries (num_queries >= 1), got seq_len={seq_len}"
            )
        self.num_pairs, self.num_keys, self.num_values, self.gap = num_pairs, num_keys, num_values, gap
        self.num_queries = room if num_queries is None else num_queries
        self.pair_tokens, self.pair_loss = pair_tokens, pair_loss
        self.vocab_size = 1 + num_keys + num_values + (num_keys * num_values if pair_tokens else 0)

    def knobs(self) -> dict[str, Any]:
        return {
            "num_pairs": self.num_pairs,
            "num_keys": self.num_keys,
            "num_values": self.num_values,
            "gap": self.gap,
            "num_queries": self.num_queries,
            "pair_tokens": self.pair_tokens,
            "pair_loss": self.pair_loss and not self.pair_tokens,
        }

    def sample(self, n: int, g: torch.Generator) -> Batch:
        n_len, p, w, k_n = self.seq_len, self.num_pairs, self.width, self.num_keys
        # distinct keys per row: the first P of a random permutation of the key vocabulary
        keys = torch.rand(n, k_n, generator=g).argsort(dim=1)[:, :p]  # (n, P) in 0..K-1
        vals = torch.randint(self.num_values, (n, p), generator=g)  # (n, P) in 0..V-1
        src = torch.zeros(n, n_len, dtype=torch.long)
        if self.pair_tokens:
            src[:, :p] = 1 + k_n + self.num_values + keys * self.num_values + vals
        else:
            src[:, 0 : 2 * p : 2] = keys + 1
            src[:, 1 : 2 * p : 2] = vals + 1 + k_n
        start, nq = w * p + self.gap, self.num_queries
        qpos = torch.rand(n, n_len - start, generator=g).argsort(dim=1)[:, :nq] + start  # (n, Q) distinct
        which = torch.randint(p, (n, nq), generator=g)  # (n, Q): the pair each query asks for
        src.scatter_(1, qpos, keys.gather(1, which) + 1)
        target = torch.full_like(src, IGNORE).scatter_(1, qpos, vals.gather(1, which) + 1 + k_n)
        distance = torch.full_like(src, -1).scatter_(1, qpos, qpos - w * which)  # pair i starts at w*i
        aux = None
        if self.pair_loss and not self.pair_tokens:
            aux = torch.full_like(src, IGNORE)
            aux[:, 0 : 2 * p : 2] = vals + 1 + k_n  # at each key: the value it is bound to
        return Batch(src=src, target=target, distance=distance, aux=aux)

    def decode_pair(self, token: int) -> tuple[int, int]:
        """``(key token, value token)`` of a pair token (for solvers and plots)."""
        i = token - (1 + self.num_keys + self.num_values)
        return 1 + i // self.num_values, 1 + self.num_keys + i % self.num_values


class Copy(Task):
    """Copy ``copy_len`` symbols after a separator; ``selective``: only the symbols among filler.

    Plain layout: ``x1 .. xM SEP MARK x M filler..`` with the answer ``x_i`` at the i-th MARK
    (distance ``M + 1`` from its source). Selective layout: ``R = N - M - 1`` positions holding the
    ``M`` symbols at random places among filler, then ``SEP`` and ``M`` MARKs; the answers are the
    symbols in order of appearance. Vocabulary: 0 filler, 1 SEP, 2 MARK, then ``num_symbols`` symbols.

    Knobs: ``copy_len`` symbols to copy (None: ``(seq_len - 1) // 2``, or ``seq_len // 8`` when
    ``selective``); ``num_symbols`` the symbol vocabulary (the floor is the modal source symbol's
    accuracy, :func:`context_floor`, above ``1 / num_symbols``);
    ``selective`` scatter the symbols among filler instead of a contiguous prefix.
    """

    name = "copy"
    SEP, MARK, SYM0 = 1, 2, 3

    def __init__(
        self, seq_len: int, copy_len: int | None = None, num_symbols: int = 16, selective: bool = False
    ) -> None:
        super().__init__(seq_len)
        if copy_len is None:  # half the sequence for plain copy; an eighth for the harder selective copy
            copy_len = max(1, seq_len // 8) if selective else (seq_len - 1) // 2
        room = seq_len - copy_len - 1 if selective else (seq_len - 1) // 2
        if copy_len < 1 or copy_len > room or num_symbols < 1:
            raise ValueError(
                f"copy needs 1 <= copy_len <= {room} at seq_len={seq_len} and num_symbols >= 1; "
                f"got copy_len={copy_len}, num_symbols={num_symbols}"
            )
        self.copy_len, self.num_symbols, self.selective = copy_len, num_symbols, selective
        self.vocab_size = self.SYM0 + num_symbols

    def knobs(self) -> dict[str, Any]:
        return {"copy_len": self.copy_len, "num_symbols": self.num_symbols, "selective": self.selective}

    def sample(self, n: int, g: torch.Generator) -> Batch:
        n_len, m = self.seq_len, self.copy_len
        data = torch.randint(self.num_symbols, (n, m), generator=g) + self.SYM0  # (n, M)
        src = torch.zeros(n, n_len, dtype=torch.long)
        if self.selective:
            sep = n_len - m - 1
            pos = torch.rand(n, sep, generator=g).argsort(dim=1)[:, :m].sort(dim=1).values  # (n, M) ascending
            src[:, :sep].scatter_(1, pos, data)
        else:
            sep = m
            src[:, :m] = data
        src[:, sep] = self.SEP
        src[:, sep + 1 : sep + 1 + m] = self.MARK
        target = torch.full_like(src, IGNORE)
        target[:, sep + 1 : sep + 1 + m] = data
        return Batch(src=src, target=target)


class Reverse(Task):
    """Sequence to sequence: the decoder outputs the reversed (``op=sort``: sorted) source, then EOS.

    Source ``(B, N)`` of symbols; decoder input ``[BOS] + y`` and target ``y + [EOS]``, both
    ``(B, N + 1)``. Vocabulary: 0 unused, 1 BOS, 2 EOS, then ``num_symbols`` symbols.
    """

    name = "reverse"
    seq2seq = True
    BOS, EOS, SYM0 = 1, 2, 3

    def __init__(self, seq_len: int, num_symbols: int = 16, op: str = "reverse") -> None:
        super().__init__(seq_len)
        if op not in ("reverse", "sort"):
            raise ValueError(f"reverse: op must be 'reverse' or 'sort', got {op!r}")
        if num_symbols < 1:
            raise ValueError(f"reverse: num_symbols must be >= 1, got {num_symbols}")
        self.num_symbols, self.op = num_symbols, op
        self.vocab_size = self.SYM0 + num_symbols

    def knobs(self) -> dict[str, Any]:
        return {"num_symbols": self.num_symbols, "op": self.op}

    def sample(self, n: int, g: torch.Generator) -> Batch:
        src = torch.randint(self.num_symbols, (n, self.seq_len), generator=g) + self.SYM0  # (n, N)
        y = src.flip(1) if self.op == "reverse" else src.sort(dim=1).values  # (n, N)
        dec_in = torch.cat([torch.full((n, 1), self.BOS), y], dim=1)  # (n, N + 1)
        target = torch.cat([y, torch.full((n, 1), self.EOS)], dim=1)  # (n, N + 1)
        return Batch(src=src, target=target, dec_in=dec_in)


TASKS: dict[str, type[Task]] = {t.name: t for t in (Recall, Copy, Reverse)}


def task_knobs(name: str) -> dict[str, Any]:
    """The knobs of task ``name`` with their defaults (its constructor's, where they are written)."""
    import inspect

    params = inspect.signature(TASKS[name].__init__).parameters
    return {p: v.default for p, v in params.items() if p not in ("self", "seq_len")}


def make_task(name: str, seq_len: int, **knobs: Any) -> Task:
    """The task ``name`` at length ``seq_len`` with its knobs; unknown names or knobs are errors."""
    if name not in TASKS:
        raise ValueError(f"unknown task '{name}'; known tasks: {', '.join(sorted(TASKS))}")
    unknown = sorted(set(knobs) - set(task_knobs(name)))
    if unknown:
        raise ValueError(
            f"task '{name}' has no knob or training setting {', '.join(unknown)}; its knobs: "
            f"{', '.join(task_knobs(name))} (training settings: experiments/measure/tasks/train.py Settings)"
        )
    return TASKS[name](seq_len, **knobs)


def is_test(src: torch.Tensor) -> torch.Tensor:
    """``(B,)`` bool: which examples belong to the test split, by a fixed hash of ``src (B, N)``.

    The hash is a random linear form of the tokens mod a prime (coefficients from a fixed seed), so
    membership depends only on the example. For every task here the source determines the answer,
    so the hash of the source separates the splits. Time ``O(B * N)``.
    """
    coef = torch.randint(1, 2**20, (src.shape[1],), generator=torch.Generator().manual_seed(_HASH_SEED))
    h = (src.long() * coef).sum(dim=1) % _HASH_PRIME  # tokens < 2^20 and N < 2^20: no int64 overflow
    return h % TEST_FRACTION == 0


def draw(task: Task, n: int, g: torch.Generator, split: str) -> Batch:
    """``n`` examples of ``split`` ('train' or 'test'), drawn with ``g`` (deterministic given its state).

    Samples in rounds and keeps only the split's own examples. A task whose whole example space is
    tiny (e.g. reversal of 2 tokens over 2 symbols) may have no test example at all: then this raises
    rather than loop forever.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    want_test = split == "test"
    parts, have = [], 0
    for _ in range(1000):
        # ask for enough that one round usually suffices (a test example is one in TEST_FRACTION)
        need = n - have
        m = (
            need * TEST_FRACTION * 5 // 4 + 8
            if want_test
            else need * TEST_FRACTION // (TEST_FRACTION - 1) + 8
        )
        b = task.sample(m, g)
        keep = is_test(b.src) == want_test
        b = b.rows(keep)
        parts.append(b)
        have += len(b)
        if have >= n:
            return Batch.cat(parts).rows(slice(0, n))
    raise ValueError(
        f"task '{task.name}' at seq_len={task.seq_len} with {task.knobs()} yields too few {split} examples: "
        "its example space is too small (a longer seq_len or more symbols)"
    )


def held_out_set(task: Task, size: int, seed: int) -> Batch:
    """The held-out test set a task job with ``seed`` evaluates on: ``size`` test examples drawn with
    the generator seeded ``2 * seed + 1`` (training draws with ``2 * seed``, see ``train.measure_task``)."""
    return draw(task, size, torch.Generator().manual_seed(2 * seed + 1), "test")


def context_floor(task: Task, batch: Batch) -> float | None:
    """Accuracy per answer token of a model that binds nothing: at every scored position of ``batch``
    it predicts the example's most frequent candidate answer visible in its input (ties: the smallest
    token), plus the end-of-sequence token where the task scores one.

    The candidates are, for ``recall``, the values of the example's pairs (all of them are in the
    context, pair tokens or not); for ``copy`` (plain or selective), the symbols of the source; for
    ``reverse`` (reversal or sort), the source symbols at the ``N`` answer positions and EOS at the
    last one. A trained model at or below this figure has learnt no lookup, whatever ``1 /
    vocabulary`` is. None for a task kind without such a floor defined here. Time ``O(B * (N + V))``.
    """
    src, scored = batch.src, batch.target != IGNORE
    if isinstance(task, Recall):
        p, k_n, v_n = task.num_pairs, task.num_keys, task.num_values
        if task.pair_tokens:  # pair token = 1 + K + V + key * V + value
            cand = (src[:, :p] - (1 + k_n + v_n)) % v_n + 1 + k_n
        else:  # key, value, key, value, ...
            cand = src[:, 1 : 2 * p : 2]
        weight = torch.ones_like(cand)
    elif isinstance(task, Copy | Reverse):
        cand, weight = src, (src >= task.SYM0).long()  # filler, SEP and MARK are never answers
    else:
        return None
    counts = torch.zeros(src.shape[0], task.vocab_size, dtype=torch.long).scatter_add_(1, cand, weight)
    guess = counts.argmax(dim=1)  # (B,): the first of the most frequent tokens
    pred = guess[:, None].expand_as(batch.target).clone()
    if isinstance(task, Reverse):
        pred[:, -1] = task.EOS  # the target is y + [EOS]
    right = (pred == batch.target) & scored
    return int(right.sum()) / int(scored.sum())  # in float64: an exact count over an exact count
