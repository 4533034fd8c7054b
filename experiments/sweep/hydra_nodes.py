"""What Hydra needs from the suite before it composes a config: the schema, a config node per
registered variant (built from its constructor), and the ``${sweep_uid:}`` resolver."""

from __future__ import annotations

import inspect
import os
import uuid
from typing import Any

from omegaconf import OmegaConf

from variants.registry import SHAPE_HINTS, knob_defaults

from .schema import register_schema


def register_variant_configs() -> None:
    """A ``variant/<name>`` config node for every registered variant, built-in or a third party's:
    ``_target_`` and the constructor's knobs with their defaults (``???`` where there is none), so
    ``variant=<name>``, ``variant.<knob>=...`` and ``'variant=glob(*)'`` include it. The constructor is
    where a knob's default is written, and only there; ``conf/variant/`` keeps presets (a variant with
    chosen knobs, ``variant=pretrained/sparse_b16``)."""
    from hydra.core.config_store import ConfigStore

    import variants

    for name in variants.available():
        cls = variants.get(name)
        node: dict[str, Any] = {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
        for knob, default in knob_defaults(cls).items():
            if knob in SHAPE_HINTS:
                node[knob] = "${" + knob + "}"  # a learned variant follows the workload's sizes
            elif default is inspect.Parameter.empty:
                node[knob] = "???"
            elif default is None or isinstance(default, (bool, int, float, str)):
                node[knob] = default
        ConfigStore.instance().store(group="variant", name=name, node=node)


def register_kind_defaults() -> None:
    """The defaults of the task, model and pretrained config groups, as nodes their YAML files start
    from (``defaults: [/task_defaults/recall@_here_, _self_]``): each task's from its training
    :class:`~experiments.measure.tasks.train.Settings` and its constructor's knobs, the model's from
    :class:`~experiments.measure.model_job.ModelSettings`, the encoder's from
    :class:`~experiments.measure.pretrained.job.PretrainedSettings`. The YAML files keep what a preset
    sets otherwise, and their comments."""
    from dataclasses import asdict

    from hydra.core.config_store import ConfigStore

    from ..measure.model_job import ModelSettings
    from ..measure.pretrained.job import PretrainedSettings
    from ..measure.tasks.data import TASKS, task_knobs
    from ..measure.tasks.train import Settings

    store = ConfigStore.instance().store
    for name in TASKS:
        store(group="task_defaults", name=name, node={"name": name, **asdict(Settings()), **task_knobs(name)})
    store(group="model_defaults", name="llama", node=asdict(ModelSettings()))
    store(group="pretrained_defaults", name="encoder", node=asdict(PretrainedSettings()))


def register_hydra_pieces() -> None:
    """Schema, variant configs and the job kinds' defaults in the ConfigStore, and the
    ``${sweep_uid:}`` resolver (idempotent)."""
    register_schema()
    register_variant_configs()
    register_kind_defaults()
    if not OmegaConf.has_resolver("sweep_uid"):
        # one id per sweep, shared with launcher workers through the environment
        OmegaConf.register_new_resolver(
            "sweep_uid", lambda: os.environ.setdefault("ATTNBENCH_SWEEP_UID", uuid.uuid4().hex[:6])
        )
