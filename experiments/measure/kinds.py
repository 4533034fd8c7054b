"""What each kind of job does, in one table: its measurer, its terminal summary, its label, and
whether the sweep measures the machine's ceilings for it and measures it again on a slow machine.

A job's kind (:class:`~experiments.measure.spec.Kind`) is decided once, from the config group it
selects (:func:`~experiments.measure.spec.kind_of`), and stored in its record; everything that treats
kinds differently reads this table instead of asking which config is set. The measurer and summary
are named ``"module:function"`` inside :mod:`experiments.measure` and imported on use: a task job
should not import transformers, nor a kernel job the training loop.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .spec import JobSpec, Kind


@dataclass(frozen=True)
class KindRules:
    """How the sweep treats one kind of job."""

    measurer: str  # "module:function(spec, result)" filling result's status, variant and figures
    summary: str  # "module:function(figures, config) -> str": the terminal's text for an ok job
    label: Callable[[JobSpec], str]  # what the job's label starts with ("" for a kernel job)
    roofline: bool  # the device's GEMM and copy ceilings give its figures their context
    timed: bool  # its headline figures are times: a slow canary makes the sweep measure it again
    objective: str | None  # the figure run.py returns by default (None: the job's time in its mode)
    checks_workload: bool  # the variant checks the spec's attention workload before any work (the
    # other kinds build their own workloads inside a model and check those)

    def load(self, which: str) -> Callable[..., Any]:
        """The function ``which`` (``"measurer"`` or ``"summary"``) names, imported now."""
        module, name = getattr(self, which).split(":")
        return getattr(importlib.import_module(f"experiments.measure.{module}"), name)


def _model_label(spec: JobSpec) -> str:
    m = spec.model
    bits = [f"L={m.get('layers')}", f"+{m.get('new_tokens')} tokens"]
    if m.get("sliding_window"):  # a local/global mix: which layers slide, what runs the full ones
        bits.append(f"sliding_window={m['sliding_window']}")
        bits += [f"{k}={m[k]}" for k in ("full_every", "full_variant") if m.get(k) is not None]
    if m.get("rolling_cache"):
        bits.append("rolling_cache")
    return f"model({', '.join(bits)})"


KINDS: dict[Kind, KindRules] = {
    Kind.kernel: KindRules(
        measurer="kernel:measure_kernel",
        summary="kernel:kernel_summary",
        label=lambda spec: "",
        roofline=True,
        timed=True,
        objective=None,
        checks_workload=True,
    ),
    Kind.task: KindRules(
        measurer="tasks.train:measure_task",
        summary="tasks.train:task_summary",
        label=lambda spec: f"task={spec.task.get('name', '?')}",
        roofline=False,
        timed=False,  # accuracy does not depend on the machine's speed
        objective="test_accuracy",
        checks_workload=False,
    ),
    Kind.model: KindRules(
        measurer="model_job:measure_model",
        summary="model_job:model_summary",
        label=_model_label,
        roofline=False,  # end to end through transformers: no FLOP count to set against a ceiling
        timed=True,
        objective="decode_ms_per_token",
        checks_workload=False,
    ),
    Kind.pretrained: KindRules(
        measurer="pretrained.job:measure_pretrained",
        summary="pretrained.job:pretrained_summary",
        label=lambda spec: f"pretrained={spec.pretrained.get('name', '?')}",
        roofline=False,
        timed=True,
        objective="cosine_mean",
        checks_workload=False,
    ),
}


def rules(kind: Kind | str) -> KindRules:
    """The rules of a kind (its enum or its stored value)."""
    return KINDS[Kind(kind)]
