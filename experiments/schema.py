"""The config schema: a dataclass in Hydra's ConfigStore, so a wrong type or an unknown choice is
rejected while composing (naming the field), and :func:`validate` for value ranges."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


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


@dataclass
class BenchConfig:
    """Workload knobs at the top level; the variant (``_target_`` + knobs) under ``variant``."""

    variant: Any = MISSING
    device: Device = Device.cpu
    dtype: DType = DType.float32
    batch: int = 1
    tokens: int | None = None  # tokens per batch: batch = max(1, tokens // seq_len), overriding batch
    heads: int = 8
    seq_len: int = 1024
    kv_len: int | None = None  # keys/values length for cross-attention (None: = seq_len)
    head_dim: int = 64
    v_head_dim: int | None = None  # None: = head_dim
    causal: bool = False
    padding: float = 0.0  # fraction of keys that are padding, in [0, 1)
    mode: Mode = Mode.fwd
    seed: int = 0
    threads: int | None = None  # None: every CPU the job may run on (its affinity)
    min_run_time: float = 1.0  # seconds of timed runs per figure
    accuracy_rows: int = 256  # query rows checked against the float64 oracle
    cuda_graph: bool = True  # also time a CUDA-graph replay of the forward (CUDA only)
    roofline: bool = True  # measure the device's GEMM FLOP/s and copy bandwidth once per sweep
    isolate: bool = True  # run each job in its own child process
    timeout_s: float = 600.0  # per job, with isolation
    resume: bool = True  # skip configs whose record (same code, same host) exists
    records_dir: str = "outputs/records"
    report: bool = True  # print tables and write plots at the end of a multirun
    extra: dict[str, Any] = field(default_factory=dict)  # free-form tags copied into the record
    task: Any = None  # a task from conf/task/: train a small model instead of timing the kernel


def register_schema() -> None:
    """Register :class:`BenchConfig` as ``bench_schema`` (config.yaml lists it in its defaults)."""
    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)


_POSITIVE = ("batch", "heads", "seq_len", "head_dim", "min_run_time", "timeout_s", "accuracy_rows")


def validate(cfg: dict[str, Any]) -> None:
    """Raise ``ValueError('<field>: ...')`` for the first out-of-range value."""
    for name in _POSITIVE:
        if cfg[name] <= 0:
            raise ValueError(f"{name} must be > 0, got {cfg[name]}")
    for name in ("kv_len", "v_head_dim", "threads", "tokens"):
        if cfg.get(name) is not None and cfg[name] <= 0:
            raise ValueError(f"{name} must be > 0 (or null), got {cfg[name]}")
    if not 0.0 <= cfg["padding"] < 1.0:
        raise ValueError(f"padding must be in [0, 1), got {cfg['padding']}")
    if cfg["causal"] and cfg.get("kv_len") not in (None, cfg["seq_len"]):
        raise ValueError(
            f"causal=true needs kv_len = seq_len (or null): causal masking is defined for Nq == Nk; "
            f"got seq_len={cfg['seq_len']}, kv_len={cfg['kv_len']}"
        )
    if not isinstance(cfg.get("variant"), dict) or "_target_" not in cfg["variant"]:
        raise ValueError("variant must be chosen: variant=<name> (see conf/variant/)")
