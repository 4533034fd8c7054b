"""The typed job spec: what one job measures, with every default in one place.

:class:`JobSpec` is the measurement's half of the config; Hydra's schema
(:class:`experiments.sweep.schema.BenchConfig`) extends it with how a sweep runs its jobs. Across
process boundaries and in records a job's config is a plain dict (the resolved Hydra config, enum
values as strings); :meth:`JobSpec.from_config` turns one into a spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from variants import Workload


class Device(Enum):
    cpu = "cpu"
    cuda = "cuda"


class DType(Enum):
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Mode(Enum):
    fwd = "fwd"
    fwd_bwd = "fwd_bwd"


class Kind(Enum):
    """What a job measures; chosen by the config group a sweep selects (``task=``, ``model=``,
    ``pretrained=``; none of them: a kernel). Stored in every record as ``kind``."""

    kernel = "kernel"  # the attention call alone: time, memory, FLOP/s, error against the oracle
    task = "task"  # train a small model with the variant and measure its accuracy (conf/task/)
    model = "model"  # a transformers model end to end with the variant as attention (conf/model/)
    pretrained = "pretrained"  # the variant inside a pretrained encoder: fidelity and cost (conf/pretrained/)


#: the config groups that make a job something other than a kernel job, each its own kind
KIND_GROUPS: tuple[Kind, ...] = (Kind.task, Kind.model, Kind.pretrained)


def kind_of(cfg: Mapping[str, Any]) -> Kind:
    """The kind of the job a config (dict or :class:`JobSpec`-like mapping) describes: the config group
    it selects, or ``kernel``. The one place that tells kinds apart by the config; records store the
    answer. Raises ValueError when a config selects more than one group."""
    chosen = [k for k in KIND_GROUPS if cfg.get(k.value)]
    if len(chosen) > 1:
        names = " and ".join(f"{k.value}=" for k in chosen)
        raise ValueError(f"a job is one kind: {names} were both given; sweep them in separate runs")
    return chosen[0] if chosen else Kind.kernel


#: the fields whose value is one of an enum's
CHOICES: dict[str, type[Enum]] = {"device": Device, "dtype": DType, "mode": Mode}
S = TypeVar("S", bound="JobSpec")


@dataclass(frozen=True)
class JobSpec:
    """Workload knobs, the variant (``_target_`` + knobs) and how long to time it.

    Frozen: a job never changes what it was asked to measure.
    """

    variant: Any  # the variant's config: ``{"_target_": ..., **knobs}``
    device: Device = Device.cpu  # cuda without a GPU: status 'unavailable'
    dtype: DType = DType.float32
    batch: int = 1
    tokens: int | None = None  # tokens per batch: batch = max(1, tokens // seq_len), overriding batch
    heads: int = 8
    seq_len: int = 1024  # query length N
    kv_len: int | None = None  # keys/values length (None: = seq_len); > seq_len: the queries are the last
    # seq_len positions of a kv_len sequence (decoding, prefill onto a cache), causal bottom-right
    kv_heads: int | None = None  # key/value heads, dividing heads (None: = heads; 1: multi-query)
    head_dim: int = 64
    v_head_dim: int | None = None  # None: = head_dim
    causal: bool = False
    cross: bool = False  # the queries are another sequence than the keys' (an encoder-decoder's
    # cross-attention): never causal; variants whose pattern relates positions refuse it
    padding: float = 0.0  # fraction of keys that are padding, in [0, 1)
    documents: int = 1  # > 1: each sequence packs this many documents (lengths drawn around N / documents),
    # a query seeing its own document's keys only (ids per key; FlexAttention's document mask)
    scale: float | None = None  # the softmax scale (None: 1/sqrt(head_dim))
    bias: str | None = None  # an additive bias on the scores: None or "alibi" (ALiBi's per-head slopes)
    mode: Mode = Mode.fwd  # fwd_bwd times forward, backward alone and both
    seed: int = 0
    threads: int | None = None  # torch threads, set in every job and recorded; None: every CPU the job
    # may run on (its affinity)
    min_run_time: float = 1.0  # seconds of timed runs per figure
    accuracy_rows: int = 256  # query rows checked against the float64 oracle
    grad_check_scores: int = 2**27  # fwd_bwd: the most float64 scores (batch x heads x the pattern's
    # pairs) the gradient check computes in blocks of rows when the whole oracle does not fit at once
    cuda_graph: bool = True  # also time a CUDA-graph replay of the forward (CUDA only; the record says
    # why when it cannot)
    task: Any = None  # a task from conf/task/: train a small model instead of timing the kernel
    model: Any = None  # a model from conf/model/: time a transformers model with the variant as attention
    # (extra [hf])
    pretrained: Any = None  # an encoder from conf/pretrained/: the variant inside a pretrained model
    # (extra [pretrained])

    @property
    def kind(self) -> Kind:
        """What this job measures (:func:`kind_of`)."""
        return kind_of({k.value: getattr(self, k.value) for k in KIND_GROUPS})

    def workload(self) -> Workload:
        """The attention call this job makes, as the variants see it (what ``check`` and ``flops``
        read); built here once for the runner, the regression gates and the tests."""
        import torch  # here: reading a config must not wait for torch and the variants

        from variants import Workload

        from .inputs import document_lengths, pairs_kept

        nk = self.kv_len or self.seq_len
        lengths = document_lengths(self.batch, nk, self.documents, self.seed) if self.documents > 1 else None
        return Workload(
            batch=self.batch,
            heads=self.heads,
            nq=self.seq_len,
            nk=nk,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim or self.head_dim,
            device=self.device.value,
            dtype=getattr(torch, self.dtype.value),
            causal=self.causal,
            key_padding=self.padding > 0,
            attn_mask=False,
            documents=self.documents > 1,
            backward=self.mode is Mode.fwd_bwd,
            kv_heads=self.kv_heads if self.kv_heads != self.heads else None,
            scale=self.scale,
            bias=self.bias is not None,
            cross=self.cross,
            pair_share=pairs_kept(lengths, self.seq_len, self.causal) if lengths else 1.0,
            document_lengths=tuple(map(tuple, lengths)) if lengths else None,
        )

    @classmethod
    def from_config(cls: type[S], cfg: Mapping[str, Any]) -> S:
        """The spec of a resolved config dict: the fields this class has (others, such as a sweep's
        settings, are left out), enum values from their names, absent fields at their defaults."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in cfg.items() if k in known}
        for name, enum in CHOICES.items():
            if name in values and not isinstance(values[name], enum):
                values[name] = enum(values[name])
        return cls(**values)
