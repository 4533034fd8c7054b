"""The config schema: :class:`BenchConfig` in Hydra's ConfigStore, so a wrong type or an unknown
choice is rejected while composing (naming the field), and :func:`validate` for value ranges.

A config is the job's spec (:class:`experiments.measure.spec.JobSpec`: what is measured) plus how the
sweep runs it (isolation, resume, records folder, report)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import ListConfig, OmegaConf

from ..measure.spec import JobSpec, Kind, Mode


@dataclass(frozen=True)
class BenchConfig(JobSpec):
    """A :class:`JobSpec` and the sweep's settings for it."""

    roofline: bool = True  # measure the device's GEMM FLOP/s and copy bandwidth once per sweep, device, dtype
    isolate: bool = True  # each job in its own child process with a timeout (false: quicker, a crash ends
    # the sweep)
    timeout_s: float = 600.0  # per job, with isolation
    settle_s: float = 10.0  # before each job, wait up to this long for the machine to go quiet (other
    # processes under 0.5 cores, no memory reclaim); 0: do not wait
    retry_unstable: int = 1  # a job whose timing figure ends unstable (IQR > 10% of the median), or whose
    # canary ran > 1.15x the sweep's fastest, is measured again from the start in a fresh process, up to
    # this many times; the record keeps the last attempt and the earlier ones' figures (earlier_attempts)
    round: int = 0  # repetition index: round=0,1,2 measures each job at 3 moments; tables show the median
    resume: bool = True  # skip configs with a record from the same code on the same host
    records_dir: str = "outputs/records"  # where records are written (and read, to resume)
    report: bool = True  # print tables and write plots at the end of a multirun
    objective: str | None = None  # the record figure run.py returns, for optimising sweepers
    # (hydra/sweeper=optuna): e.g. fwd_median_s, peak_mib, cosine_mean; None: the kind's default
    # (experiments/measure/kinds.py; a kernel job: its time in its mode); NaN when the job did not run
    # or failed its check
    extra: dict[str, Any] = field(default_factory=dict)  # free-form tags copied into each record


def register_schema() -> None:
    """Register :class:`BenchConfig` as ``bench_schema`` (config.yaml lists it in its defaults)."""
    node = OmegaConf.structured(BenchConfig)
    # OmegaConf makes a frozen dataclass's config read-only, and Hydra merges config.yaml and the
    # overrides into this node: writable here, frozen as a spec
    OmegaConf.set_readonly(node, False)
    ConfigStore.instance().store(name="bench_schema", node=node)


_POSITIVE = ("batch", "heads", "seq_len", "head_dim", "min_run_time", "timeout_s", "accuracy_rows",
             "grad_check_scores")  # fmt: skip
_POSITIVE_OR_NONE = ("kv_len", "kv_heads", "v_head_dim", "threads", "tokens", "scale")
BIASES = (None, "alibi")


def validate(conf: BenchConfig) -> None:
    """Raise ``ValueError('<field>: ...')`` for the first out-of-range value."""
    if conf.kind is Kind.model:  # first: experiment=llama ties seq_len to model.prefill_len, the one typed
        _validate_model(conf)
    for name in (*_POSITIVE, *_POSITIVE_OR_NONE):
        value = getattr(conf, name)
        if (value is not None or name in _POSITIVE) and not 0 < value < math.inf:  # (NaN fails both)
            what = "a finite number > 0" if isinstance(value, float) else "> 0"
            raise ValueError(
                f"{name} must be {what}{' (or null)' if name in _POSITIVE_OR_NONE else ''}, got {value}"
            )
    if not str(conf.records_dir).strip():
        raise ValueError("records_dir is empty: name a folder for the records (default outputs/records)")
    if not 0.0 <= conf.padding < 1.0:
        raise ValueError(f"padding must be in [0, 1), got {conf.padding}")
    if not 1 <= conf.documents <= (conf.kv_len or conf.seq_len):
        raise ValueError(
            f"documents must be between 1 and the keys' {conf.kv_len or conf.seq_len} tokens "
            f"(1: one sequence, no packing); got {conf.documents}"
        )
    if conf.documents > 1 and conf.cross:
        raise ValueError(
            "documents > 1 with cross=true: packed documents cut one sequence into pieces, and "
            "cross-attention's queries are another sequence than the keys' (set one of them back)"
        )
    if conf.causal and conf.kv_len is not None and conf.kv_len < conf.seq_len:
        raise ValueError(
            f"causal=true needs kv_len >= seq_len (or null): the queries are the last seq_len positions; "
            f"got seq_len={conf.seq_len}, kv_len={conf.kv_len}"
        )
    if conf.cross and conf.causal:
        raise ValueError(
            "cross=true with causal=true: cross-attention's queries are another sequence than the keys', "
            "so no key comes after a query (set causal=false)"
        )
    if conf.kv_heads is not None and conf.heads % conf.kv_heads:
        raise ValueError(f"kv_heads must divide heads, got heads={conf.heads}, kv_heads={conf.kv_heads}")
    if not 0 <= conf.settle_s < math.inf:
        raise ValueError(f"settle_s must be a finite number >= 0 (0: do not wait), got {conf.settle_s}")
    if conf.retry_unstable < 0:
        raise ValueError(f"retry_unstable must be >= 0 (0: measure once), got {conf.retry_unstable}")
    if conf.round < 0:
        raise ValueError(f"round must be >= 0, got {conf.round}")
    if conf.bias not in BIASES:
        raise ValueError(f"bias must be one of null, alibi; got {conf.bias!r}")
    if conf.kind is not Kind.kernel:
        _refuse_kernel_knobs(conf)
    elif conf.mode is not Mode.fwd_bwd and conf.grad_check_scores != BenchConfig.grad_check_scores:
        raise ValueError(
            f"grad_check_scores={conf.grad_check_scores} applies to mode=fwd_bwd only: a forward has "
            "no gradients to check (sweep the two modes in two runs to set it on fwd_bwd alone)"
        )
    if conf.kind is Kind.pretrained:
        _validate_pretrained(conf)
    if conf.kind is Kind.task:
        _validate_task(conf)
    if not isinstance(conf.variant, dict) or "_target_" not in conf.variant:
        raise ValueError("variant must be chosen: variant=<name> (docs/variants.md lists them)")


#: workload and timing settings only a kernel job reads: a task, model or pretrained job builds its own
#: model and calls, and times them its own way
KERNEL_ONLY = (
    "causal", "cross", "padding", "documents", "kv_len", "kv_heads", "bias", "scale",
    "batch", "tokens", "heads", "head_dim", "v_head_dim", "mode", "min_run_time", "accuracy_rows",
    "grad_check_scores", "cuda_graph",
)  # fmt: skip
#: where each kind of job takes what a kernel job's settings say
_OWN_SETTINGS = {
    Kind.task: "task.heads, task.d_model, task.batch_size, task.causal",
    Kind.model: "model.heads, model.kv_heads, model.hidden, model.batch, model.prefill_len",
    Kind.pretrained: "pretrained.batch; the encoder runs as it is: bidirectional, whole texts, its own heads",
}


def _refuse_kernel_knobs(conf: BenchConfig) -> None:
    """One line naming the kernel-only settings a task, model or pretrained job was given away from
    their defaults: it would ignore them, and its record would still carry them (and be stored apart
    from the same measurement without them)."""
    defaults = BenchConfig(variant=None)
    given = [n for n in KERNEL_ONLY if getattr(conf, n) != getattr(defaults, n)]
    given = [f"{n}={getattr(getattr(conf, n), 'value', getattr(conf, n))}" for n in given]  # enums by value
    if given:
        raise ValueError(
            f"{conf.kind.value} jobs build their own attention calls: {', '.join(given)} apply to kernel "
            f"jobs only; a {conf.kind.value} job's own: {_OWN_SETTINGS[conf.kind]}"
        )


def _refuse_unknown(group: str, given: dict[str, Any], known: dict[str, Any]) -> None:
    """One line naming a setting of ``group`` that is not one: Hydra's ``+group.key=value`` adds any key,
    and the job would run without it (a misspelt ``+model.sliding_windw=8`` ran a plain Llama)."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(
            f"{', '.join(f'{group}.{k}' for k in unknown)}: not a {group} setting; known: {', '.join(known)}"
        )


def _validate_model(conf: BenchConfig) -> None:
    """A model job's layer mix and cache settings (``ModelSettings``): a window of at least one key,
    full layers and their variant only with a window, a registered stateless variant there, a boolean
    rolling cache. What depends on the job's variant (a rolling cache needs local_window somewhere)
    is the job's to refuse, as ``unsupported``."""
    import variants

    from ..measure.llama_e2e import check_mix
    from ..measure.model_job import ModelSettings

    defaults = asdict(ModelSettings())
    _refuse_unknown("model", dict(conf.model), defaults)
    m = {**defaults, **dict(conf.model)}
    # new_tokens >= 2: the first comes out of the prefill, the others are the decode steps timed
    least = {
        "layers": 1,
        "hidden": 1,
        "heads": 1,
        "kv_heads": 1,
        "vocab": 1,
        "prefill_len": 1,
        "new_tokens": 2,
        "batch": 1,
    }
    for name, low in least.items():
        if isinstance(m[name], bool) or not isinstance(m[name], int) or m[name] < low:
            raise ValueError(f"model.{name} must be an integer >= {low}, got {m[name]!r}")
    if m["hidden"] % m["heads"]:
        raise ValueError(
            f"model.heads must divide model.hidden (head size), got hidden={m['hidden']}, heads={m['heads']}"
        )
    if m["heads"] % m["kv_heads"]:
        raise ValueError(
            f"model.kv_heads must divide model.heads, got heads={m['heads']}, kv_heads={m['kv_heads']}"
        )
    if conf.seq_len != m["prefill_len"]:
        raise ValueError(
            f"seq_len={conf.seq_len} but a model job prefills model.prefill_len={m['prefill_len']} tokens: "
            "its record would say the wrong N; set model.prefill_len instead (experiment=llama ties "
            "seq_len to it)"
        )
    window, every, full = m["sliding_window"], m["full_every"], m["full_variant"]
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(
            f"model.sliding_window must be an integer >= 2 (keys per query) or null, got {window!r}"
        )
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"model.full_every must be an integer >= 1 or null, got {every!r}")
    if full is not None:
        if full not in variants.available():
            raise ValueError(
                f"model.full_variant={full!r} is not a variant; known: {', '.join(variants.available())}"
            )
        if variants.get(full).has_params:
            raise ValueError(
                f"model.full_variant={full!r} has learned parameters: a mix takes stateless variants"
            )
    check_mix(m["layers"], window, every, full)
    if not isinstance(m["rolling_cache"], bool):
        raise ValueError(f"model.rolling_cache must be true or false, got {m['rolling_cache']!r}")


def _validate_task(conf: BenchConfig) -> None:
    """A task job's settings and knobs, checked before any job starts: its training settings in range,
    its knobs the task's own, and the task possible at ``seq_len``: it has both splits (one example of
    each is drawn: milliseconds)."""
    import torch

    from variants.registry import check_knobs

    from ..measure.tasks.data import TASKS, draw, make_task, task_knobs
    from ..measure.tasks.train import Settings

    name, _, knobs = Settings.split(dict(conf.task))  # Settings checks its ranges and switches
    if name in TASKS:  # the types of the knobs it takes (make_task names an unknown task or knob)
        check_knobs(TASKS[name], {k: v for k, v in knobs.items() if k in task_knobs(name)}, f"task '{name}'")
    task = make_task(name, conf.seq_len, **knobs)
    for split in ("test", "train"):  # a tiny example space may hold none of a split (cheap: one each)
        draw(task, 1, torch.Generator().manual_seed(0), split)


def _validate_pretrained(conf: BenchConfig) -> None:
    """A pretrained job's settings: the retrieval task needs its 5 neighbours, a batch, a band and
    distinct full layers (the workload knobs it ignores: :func:`_refuse_kernel_knobs`)."""
    from ..measure.pretrained.encoder import model_dir
    from ..measure.pretrained.job import DEFAULTS, TOP_K

    p = {**DEFAULTS, **dict(conf.pretrained)}
    _refuse_unknown("pretrained", dict(conf.pretrained), DEFAULTS)
    if not isinstance(p["texts"], int) or p["texts"] < TOP_K:
        raise ValueError(f"pretrained.texts must be an integer >= {TOP_K} (the retrieval task's neighbours)")
    if not isinstance(p["batch"], int) or p["batch"] < 1:
        raise ValueError(f"pretrained.batch must be a positive integer, got {p['batch']!r}")
    if p["batch"] > p["texts"]:  # a pass holds the texts there are: its time would be labelled wrong
        raise ValueError(f"pretrained.batch={p['batch']} is more than the {p['texts']} pretrained.texts")
    if not isinstance(p["band"], int) or p["band"] < 0:
        raise ValueError(f"pretrained.band must be an integer >= 0, got {p['band']!r}")
    if p["trained_len"] is not None and (not isinstance(p["trained_len"], int) or p["trained_len"] < 1):
        raise ValueError(
            f"pretrained.trained_len must be a positive integer or null (the model card's), got "
            f"{p['trained_len']!r}"
        )
    if not isinstance(p["full_layers"], list | tuple | ListConfig | None):
        raise ValueError(
            f"pretrained.full_layers must be a list of layer indices (e.g. [0,5]), got {p['full_layers']!r}"
        )
    full = list(p["full_layers"] or [])
    if not all(isinstance(i, int) and i >= 0 for i in full) or len(set(full)) != len(full):
        raise ValueError(
            f"pretrained.full_layers must be distinct layer indices >= 0 (e.g. [0,5]), got {full!r}"
        )
    try:  # the package and its layer count, read from its config.json (no weights loaded)
        layers = json.loads((model_dir(p["package"]) / "config.json").read_text())["num_hidden_layers"]
    except ImportError as exc:
        raise ValueError(f"pretrained.package={p['package']}: {exc}") from None
    if any(i >= layers for i in full):
        raise ValueError(
            f"pretrained.full_layers={full} names a layer past the encoder's {layers} (0-{layers - 1})"
        )
    if len(full) == layers:  # the record would say the variant's name of a run that never called it
        raise ValueError(
            f"pretrained.full_layers={full} names every one of the encoder's {layers} layers: no layer would "
            "run the variant"
        )
