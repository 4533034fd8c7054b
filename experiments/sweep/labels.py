"""What the terminal shows of a job: its label (``sdpa N=1024 fwd float32 cpu``) and the one line
that sums up its record."""

from __future__ import annotations

from typing import Any

from variants.registry import config_knobs, knob_label

from ..measure.kinds import rules
from ..measure.spec import JobSpec, Kind


def job_label(spec: JobSpec, name: str) -> str:
    """Short human label of a job, e.g. ``naive N=1024 fwd float32 cpu`` or
    ``task=recall local_window(window=16, block=None) N=128 seed=0 float32 cpu``."""
    # the knobs in brackets: a variant's own seed (sparse) is not the job's seed
    parts = [knob_label(name, config_knobs(spec.variant)), f"N={spec.seq_len}"]
    if head := rules(spec.kind).label(spec):
        parts.insert(0, head)
    if spec.kv_len:
        parts.append(f"Nk={spec.kv_len}")
    if spec.kv_heads:
        parts.append(f"Hkv={spec.kv_heads}")
    if spec.scale is not None:
        parts.append(f"scale={spec.scale:g}")
    if spec.bias:
        parts.append(f"bias={spec.bias}")
    if spec.tokens:
        parts.append(f"B={spec.batch}")  # from the token budget
    # a task job trains (mode does not apply) and its seed is what tells its runs apart
    parts += [f"seed={spec.seed}" if spec.kind is Kind.task else spec.mode.value]
    parts += [spec.dtype.value, spec.device.value]
    if spec.causal:
        parts.append("causal")
    if spec.padding:
        parts.append(f"pad={spec.padding}")
    if spec.documents > 1:
        parts.append(f"docs={spec.documents}")
    return " ".join(str(p) for p in parts)


def summary_line(rec: dict[str, Any]) -> str:
    """One line per finished job for the terminal: its label, status, and for an ok job what its
    kind's summary (:mod:`experiments.measure.kinds`) says of its figures."""
    head = f"[{rec['label']}] {rec['status']}"
    if rec["status"] != "ok":
        return f"{head}: {rec['reason']}"
    return f"{head}: " + rules(rec["kind"]).load("summary")(rec["figures"], rec["config"])
