"""What kernel, task, model and pretrained measurements need before they start: the device check,
the variant built from its config (or, for model-level jobs, its registered name and knobs), the
thread count. Below all of them, so none imports another for it."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from variants import AttentionVariant, Unavailable

from .spec import JobSpec


def build_variant(variant_cfg: dict[str, Any]) -> AttentionVariant:
    """Instantiate the variant from its ``_target_`` config (the Hydra way, so third parties plug in)."""
    from hydra.utils import instantiate

    obj = instantiate(variant_cfg, _convert_="all")
    if not isinstance(obj, AttentionVariant):
        raise TypeError(f"variant._target_ {variant_cfg.get('_target_')} is not an AttentionVariant")
    return obj


def registered_variant(spec: JobSpec, kind: str) -> tuple[type[AttentionVariant], str, dict[str, Any]]:
    """For jobs that run a variant inside a transformers model (``kind``: "model", "pretrained"),
    which reaches it by its registered name: the variant's class, that name and its knobs (the
    config without ``_target_`` and the shape hints, which the model's layers set)."""
    from hydra.utils import get_class

    from variants.registry import SHAPE_HINTS, registered_name

    cls = get_class(spec.variant["_target_"])
    name = registered_name(cls)
    if name is None:
        raise ValueError(f"{kind} jobs need a registered variant; {spec.variant['_target_']} is not one")
    knobs = {k: v for k, v in spec.variant.items() if k != "_target_" and k not in SHAPE_HINTS}
    return cls, name, knobs


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (the machine, or a Slurm allocation), else every
    CPU the OS reports."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS
        return os.cpu_count() or 1


def job_threads(spec: JobSpec) -> int:
    """The job's torch thread count, always set explicitly: ``spec.threads``, or every CPU this
    process may run on (:func:`usable_cpus`), never a launcher worker's limit (joblib's workers run
    with one)."""
    return int(spec.threads) if spec.threads else usable_cpus()


def check_threads(spec: JobSpec) -> None:
    """Raise :class:`Unavailable` when a CPU job asks for more threads than this process may run on:
    the extra threads would wait for a CPU, and the time would measure the scheduler. Checked where
    the job runs (a Slurm node's allocation, not the login node's CPUs)."""
    cpus = usable_cpus()
    if spec.device.value == "cpu" and spec.threads and spec.threads > cpus:
        raise Unavailable(
            f"threads={spec.threads} but this job may run on {cpus} CPU(s): more threads than CPUs "
            f"time the scheduler, not the kernel (threads=null uses all {cpus})"
        )


def forget_compiled_code() -> None:
    """Reset Dynamo, so that code compiled for an earlier job of this process (``isolate=false``) does
    not count against its recompile limit (8), past which compiled FlexAttention silently runs
    eagerly with the whole N x N score matrix (seen on an H100: sparse at N=16384 fwd+bwd 180 ms and
    53 GB, not 3 ms). Only where Dynamo was imported: nothing was compiled otherwise, and importing it
    to reset it took 1.7-2.9 s of every forked job on this project's 2-core VM."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


def check_device(device: str) -> None:
    """Raise :class:`Unavailable` unless this process can run on ``device``."""
    if device == "cuda" and not torch.cuda.is_available():
        raise Unavailable("device=cuda but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    if device not in ("cpu", "cuda"):
        raise Unavailable(f"device '{device}' is not supported by this suite (use cpu or cuda)")
