"""The checks a job's config gets before anything is measured, shared by the runner (inside each job)
and the command line's preflight (before Hydra launches any job)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hydra.utils import get_class

from variants.registry import check_knobs, registered_name

from .schema import BenchConfig, validate


def variant_label(cls: type) -> str:
    """The registered name of ``cls``, or its import path when it is not itself registered (a
    subclass of a registered variant is not that variant)."""
    return registered_name(cls) or f"{cls.__module__}.{cls.__qualname__}"


def check_job(cfg: dict[str, Any]) -> tuple[BenchConfig, type, str, Any]:
    """Every check a job's config gets before anything is measured: the schema's value ranges, the
    variant's knobs, and building the variant (a bad knob value, ``window=-1``, raises there).
    Returns the config, the variant's class, its name and the built variant; fills in ``cfg["batch"]``
    from a token budget. Raises on the first problem (:func:`one_line` words it)."""
    from ..measure.common import build_variant

    conf = BenchConfig.from_config(cfg)
    validate(conf)
    conf.kind  # noqa: B018  (a config that selects two kinds, task= and model=, is refused here)
    if conf.tokens:  # a fixed token budget: the batch follows the length (and is hashed)
        cfg["batch"] = max(1, conf.tokens // conf.seq_len)
        conf = replace(conf, batch=cfg["batch"])
    cls = get_class(conf.variant["_target_"])
    name = variant_label(cls)
    check_knobs(cls, conf.variant, name)
    return conf, cls, name, build_variant(conf.variant)


def one_line(exc: BaseException) -> str:
    """The first line of what a failed check raised (its cause's, when it has one), with the type's
    name unless it is a ValueError."""
    cause = exc.__cause__ or exc
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return ("" if isinstance(cause, ValueError) else f"{type(cause).__name__}: ") + text
