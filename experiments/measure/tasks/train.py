"""Train a small Transformer with one attention variant on one synthetic task, then test it.

:func:`measure_task` is the measurer of a task job (:mod:`experiments.measure.kinds`), which
:func:`experiments.measure.kernel.measure` runs. It fills ``result`` with the variant's description
and these figures: ``train_s``, ``steps``,
``final_loss``, ``test_accuracy`` (exact match per answer token on the held-out split),
``test_exact_match`` (whole answer right), ``params``, ``params_baseline``, ``seed``,
``acc_by_distance`` (recall), and one trained attention map (``attention``) for the report's heatmaps.

Cost: ``steps`` optimiser steps of ``batch_size`` examples (forward + backward of
:class:`~experiments.measure.tasks.model.TaskTransformer`), then one pass over ``test_size`` test
examples (``N + 1`` decoder passes for sequence-to-sequence tasks, which decode greedily).

Parameter budget (as LRA does): a variant with learned parameters in its core (``has_params``, e.g.
additive) may have at most ``1 + param_budget`` times the parameters of the same model with a
parameter-free exact core; the FFN width is shrunk until it fits (down to ``d_model``), then the
core's own size knob (its class's ``size_knob``: additive's ``hidden``, linformer's ``proj_len``).
Both counts, the FFN width and the core's knobs used are recorded.
"""

from __future__ import annotations

import inspect
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

import variants
from variants import AttentionVariant, Unsupported, Workload
from variants.registry import config_knobs

from ..common import build_variant, check_device, job_threads
from ..memory import peak_bytes
from ..spec import DType, JobSpec
from .data import IGNORE, Batch, Task, context_floor, draw, held_out_set, make_task
from .model import TaskTransformer, VariantSpec, attention_cores, count_params, recorded_attention

# training and model settings in conf/task/*.yaml; every other key there is a knob of the task
_DTYPES = {DType.float32: torch.float32, DType.float64: torch.float64}


@dataclass
class Settings:
    """Model and training settings of a task job, with their defaults (written here only; a task's
    file in ``conf/task/`` sets what it needs otherwise)."""

    # --- training (AdamW, linear warm-up then cosine decay); fresh examples every step
    steps: int = 600  # optimiser steps
    batch_size: int = 32  # examples per step
    lr: float = 3e-3  # peak learning rate
    warmup: int = 50  # warm-up steps
    weight_decay: float = 0.0  # AdamW weight decay
    clip: float = 1.0  # gradient-norm clip (0: off)
    # --- the model (a Transformer; the attention core is the variant)
    d_model: int = 64  # model width = heads x head size
    heads: int = 4  # attention heads (head size = d_model / heads)
    layers: int = 2  # encoder blocks
    ffn: int = 128  # feed-forward width (shrunk for variants with learned cores, see param_budget)
    decoder_layers: int = 2  # decoder blocks (0: an encoder only)
    norm_first: bool = True  # pre-LN trains small models without a long warm-up; false: the paper's post-LN
    param_budget: float = 0.10  # learned cores (additive) may add at most this share of the exact model's
    # parameters
    causal: bool = False  # the encoder's self-attention causal (a decoder-only model, as a language
    # model reads): copy and recall can be solved so, and causal-only cores (retention) need it
    # --- testing
    test_size: int = 512  # held-out test examples (disjoint from training by a hash of the example)
    eval_batch: int = 128  # examples per evaluation pass
    distance_bins: int = 8  # bins of key-to-query distance in the recall task's accuracy
    heatmap_size: int = 64  # side of the attention map stored in the record (0: none)
    max_train_s: float | None = None  # wall-clock cap on training (None: none), so one slow variant
    # cannot hold up a sweep; a capped run records stopped_early and the steps it did
    peak_memory: bool = False  # after training, measure one more training step's peak memory
    # (step_peak_mib: the allocator's bytes above those held before it; experiment=lra_efficiency)

    def __post_init__(self) -> None:
        """One ``ValueError`` line, naming ``task.<setting>``, for a value out of range: a run of 0 steps
        would record an untrained model's accuracy as a result."""
        at_least = {"steps": 1, "batch_size": 1, "d_model": 1, "heads": 1, "layers": 1, "ffn": 1}
        at_least |= {"test_size": 1, "eval_batch": 1, "distance_bins": 1}
        at_least |= {"warmup": 0, "decoder_layers": 0, "heatmap_size": 0}
        for name, low in at_least.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"task.{name} must be an integer >= {low}, got {value!r}")
        for name in ("lr", "weight_decay", "clip", "param_budget"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 <= value < math.inf  # (NaN fails it)
                or (name == "lr" and not value)
            ):
                raise ValueError(
                    f"task.{name} must be a finite number {'>' if name == 'lr' else '>='} 0, got {value!r}"
                )
        for f in fields(self):  # a switch given as text ('maybe') would be read as true
            if isinstance(f.default, bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"task.{f.name} must be true or false, got {getattr(self, f.name)!r}")
        if self.d_model % self.heads:
            raise ValueError(
                f"task.heads must divide task.d_model, got d_model={self.d_model}, heads={self.heads}"
            )
        if self.max_train_s is not None and not self.max_train_s > 0:
            raise ValueError(f"task.max_train_s must be > 0 (or null: no cap), got {self.max_train_s!r}")

    @classmethod
    def split(cls, task_cfg: dict[str, Any]) -> tuple[str, Settings, dict[str, Any]]:
        """``(name, settings, task knobs)`` from a ``conf/task`` dict."""
        cfg = dict(task_cfg)
        if "name" not in cfg:
            raise ValueError("task config needs a 'name' (recall, copy, reverse)")
        name = cfg.pop("name")
        own = {f.name for f in fields(cls)}
        settings = cls(**{k: v for k, v in cfg.items() if k in own})
        return name, settings, {k: v for k, v in cfg.items() if k not in own}


def variant_for_training(
    cfg_variant: dict[str, Any], device: str, seq2seq: bool, causal: bool = False
) -> tuple[str, VariantSpec, dict[str, Any]]:
    """``(name, spec, knobs)`` to build per-layer cores, or :class:`Unsupported` before any work.

    The ``_target_`` config is instantiated once (so a bad knob fails here, as in timing jobs). The
    layers are built through the registry by the class's registered name with the config's
    structural knobs; shape hints (``heads``, ``head_dim``) come from the model, not the config. A
    class that its name does not lead back to (a subclass inheriting its parent's name, e.g. the
    test suite's faulty variants) is built from its ``_target_`` config per layer instead.
    """
    probe = build_variant(cfg_variant)
    cls = type(probe)
    name = getattr(cls, "name", "") or cls.__name__
    if device not in cls.devices:
        raise Unsupported(f"{name} does not run on device '{device}'")
    if device not in cls.backward_devices:
        raise Unsupported(f"{name} has no backward pass on device '{device}': it cannot be trained there")
    if seq2seq and not cls.supports_cross:
        raise Unsupported(f"{name} does not support cross-attention, which the decoder needs")
    if not cls.supports_noncausal and not causal:
        raise Unsupported(
            f"{name} is causal only and the task's encoder reads both ways (task.causal=false): "
            "set task.causal=true for a decoder-only model"
        )
    knobs = config_knobs(cfg_variant)
    if name in variants.available() and variants.get(name) is cls:
        return name, name, knobs
    takes = inspect.signature(cls.__init__).parameters

    def factory(heads: int, head_dim: int) -> AttentionVariant:
        shape = {k: v for k, v in (("heads", heads), ("head_dim", head_dim)) if k in takes}
        return build_variant({**cfg_variant, **shape})

    return name, factory, knobs


#: how far apart the random draws of two task seeds are: a variant's own ``seed`` knob plus this times
#: the task seed, so that variant.seed=0,1 and seed=0,1 give four different draws
SEED_STRIDE = 1000


def seeded_draw(knobs: dict[str, Any], seed: int) -> dict[str, Any]:
    """``knobs`` with a random draw's ``seed`` knob (sparse's random blocks, performer's features)
    moved by the task ``seed`` (:data:`SEED_STRIDE`): the spread over task seeds then covers the draw,
    which one fixed draw for every seed hid (sparse copy 30.1 ± 0.0% was one layout; another gave
    20%). The seed used is in the record's ``core_knobs``."""
    if isinstance(knobs.get("seed"), int) and not isinstance(knobs["seed"], bool):
        return {**knobs, "seed": knobs["seed"] + SEED_STRIDE * seed}
    return knobs


@dataclass
class Built:
    """A model built at the parameter budget, with what was changed to get there."""

    model: TaskTransformer
    params: int
    params_baseline: int
    ffn: int  # the FFN width used (the configured one unless shrunk)
    knobs: dict[str, Any]  # the core's knobs used (its ``size_knob`` shrunk if needed)


def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The largest ``x`` in ``[lo, hi]`` with ``fits(x)``, for ``fits`` true below some point; else None."""
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def build_model(task: Task, s: Settings, spec: VariantSpec, knobs: dict[str, Any], seed: int) -> Built:
    """The model, held to the parameter budget as LRA does.

    The baseline is the same architecture at the configured FFN width with a parameter-free core
    (what every exact variant trains). A variant whose cores have parameters may have at most
    ``(1 + param_budget) * baseline`` in all: first the FFN width is shrunk (down to ``d_model`` at
    least, so the network keeps its shape), then the core's ``size_knob`` (additive: ``hidden``).
    Each is the largest value that fits, found by bisection (parameters grow with both). The
    initial weights depend only on ``seed``.
    """

    def make(ffn: int, kn: dict[str, Any]) -> TaskTransformer:
        torch.manual_seed(seed)  # the same initial weights for a given seed, whatever was built before
        return TaskTransformer(
            task.vocab_size,
            d_model=s.d_model,
            heads=s.heads,
            layers=s.layers,
            ffn=ffn,
            variant=spec,
            knobs=kn,
            decoder_layers=s.decoder_layers if task.seq2seq else 0,
            norm_first=s.norm_first,
            causal=s.causal,
        )

    model = make(s.ffn, knobs)
    baseline = count_params(model, cores=False)
    limit = math.floor(baseline * (1 + s.param_budget))
    if count_params(model) <= limit:
        return Built(model, count_params(model), baseline, s.ffn, knobs)
    floor = min(s.ffn, s.d_model)
    ffn = _largest(floor, s.ffn, lambda w: count_params(make(w, knobs)) <= limit)
    kn = dict(knobs)
    key = variants.get(spec).size_knob if isinstance(spec, str) else None
    if ffn is None and key:
        size = knobs.get(key, _default_knob(spec, key))
        if isinstance(size, int):
            best = _largest(1, size, lambda h: count_params(make(floor, {**knobs, key: h})) <= limit)
            if best is not None:
                ffn, kn = floor, {**knobs, key: best}
    if ffn is None:
        raise Unsupported(
            f"the attention cores' parameters exceed the budget of {s.param_budget:.0%} over the exact "
            f"model's {baseline} even with FFN width {floor}" + (f" and {key}=1" if key else "")
        )
    model = make(ffn, kn)
    return Built(model, count_params(model), baseline, ffn, kn)


def _default_knob(name: str, knob: str) -> Any:
    """The default of constructor argument ``knob`` of variant ``name`` (None if it has none)."""
    p = inspect.signature(variants.get(name).__init__).parameters.get(knob)
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def _lr_factor(step: int, s: Settings) -> float:
    """Linear warm-up, then cosine decay to zero: high accuracy needs the late small steps."""
    if step < s.warmup:
        return (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def loss_of(model: TaskTransformer, b: Batch) -> torch.Tensor:
    """Mean cross-entropy over the positions of ``b`` with a target (scored answers and ``aux``)."""
    logits = model(b.src, b.dec_in)  # (B, T, vocab)
    target = b.target if b.aux is None else torch.where(b.aux != IGNORE, b.aux, b.target)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def predict(model: TaskTransformer, task: Task, b: Batch) -> torch.Tensor:
    """Predicted tokens ``(B, T)`` aligned with ``b.target``: argmax for encoder tasks, greedy
    decoding (no teacher forcing) for sequence-to-sequence tasks."""
    if b.dec_in is None:
        return model(b.src).argmax(dim=-1)
    return model.greedy(b.src, bos=int(b.dec_in[0, 0]), steps=b.target.shape[1])


def evaluate(model: TaskTransformer, task: Task, test: Batch, s: Settings) -> dict[str, Any]:
    """Exact-match accuracy on ``test``: per answer token, per example, and (recall) per distance."""
    model.eval()
    parts = [test.rows(slice(i, i + s.eval_batch)) for i in range(0, len(test), s.eval_batch)]
    t0 = time.perf_counter()
    preds = torch.cat([predict(model, task, p) for p in parts])  # (B, T)
    predict_s = time.perf_counter() - t0
    with torch.no_grad():  # teacher-forced loss, weighted by each part's size
        test_loss = sum(float(loss_of(model, p)) * len(p) for p in parts) / len(test)
    model.train()
    scored = test.target != IGNORE  # (B, T)
    right = (preds == test.target) & scored
    out: dict[str, Any] = {
        "test_accuracy": float(right.sum() / scored.sum()),
        "test_exact_match": float((right | ~scored).all(dim=1).float().mean()),
        "test_loss": test_loss,
        "test_size": len(test),
        "answers_per_example": float(scored.sum(dim=1).float().mean()),
        # the trained model's inference over the test set, per input token (greedy decoding included
        # for sequence-to-sequence tasks)
        "infer_us_per_token": 1e6 * predict_s / test.src.numel(),
    }
    if test.distance is not None:
        # equal-width bins up to seq_len, keyed by their upper edge; empty bins are left out
        width = math.ceil(task.seq_len / s.distance_bins)
        dist = test.distance[scored]
        hit = right[scored]
        acc, count = {}, {}
        for hi in range(width, task.seq_len + width, width):
            sel = (dist > hi - width) & (dist <= hi)
            if sel.any():
                acc[str(hi)] = float(hit[sel].float().mean())
                count[str(hi)] = int(sel.sum())
        out["acc_by_distance"], out["n_by_distance"] = acc, count
        out["distance_bin_width"] = width
    return out


def attention_heatmap(model: TaskTransformer, task: Task, example: Batch, size: int) -> dict[str, Any] | None:
    """Head-averaged attention weights of the most telling core on one test example, as a nested
    list of at most ``size x size`` (average-pooled), or None when the core has no weight matrix.

    Sequence-to-sequence: the last decoder layer's cross-attention (a reversal model should show an
    anti-diagonal); otherwise the last encoder layer's self-attention.
    """
    names = list(attention_cores(model))
    wanted = [n for n in names if ("cross_attn" in n if task.seq2seq else n.startswith("encoder."))]
    if not wanted:
        return None
    name = wanted[-1]
    model.eval()
    with torch.no_grad(), recorded_attention(model) as maps:
        model(example.src, example.dec_in)
    model.train()
    if name not in maps:
        return None
    w = maps[name][0].mean(dim=0)  # (Nq, Nk): first example, mean over heads
    stride = max(1, math.ceil(max(w.shape) / size))
    if stride > 1:
        # average-pool so a long map stays small in the record; ceil_mode keeps the edges
        w = F.avg_pool2d(w[None, None], stride, ceil_mode=True)[0, 0]
    return {
        "module": name,
        "stride": stride,
        "shape": [int(x) for x in maps[name].shape[-2:]],
        "weights": [[round(float(x), 4) for x in row] for row in w],
    }


def job_context_floor(task_cfg: dict[str, Any], seq_len: int, seed: int) -> float | None:
    """:func:`~.data.context_floor` on the test set of the task job ``task_cfg`` (a ``conf/task`` dict,
    settings included) at ``seq_len`` and ``seed``: the same examples the job evaluates on, so a
    record's task settings are enough to compute it afterwards (milliseconds at N=128)."""
    name, s, knobs = Settings.split(task_cfg)
    task = make_task(name, int(seq_len), **knobs)
    return context_floor(task, held_out_set(task, s.test_size, int(seed)))


def measure_task(spec: JobSpec, result: dict[str, Any]) -> None:
    """Train on ``spec.task`` at ``spec.seq_len`` with ``spec.variant``; fill ``result``.

    Raises :class:`variants.Unsupported` (the variant cannot be trained here or cannot do the
    task's attention), :class:`variants.Unavailable` (device), or any other exception
    (:func:`experiments.measure.kernel.measure` turns each into a status). A non-finite loss sets
    status ``nan``.
    """
    device = spec.device.value
    check_device(device)

    torch.set_num_threads(job_threads(spec))
    if spec.dtype not in _DTYPES:
        raise Unsupported(f"task training runs in float32 or float64, not {spec.dtype.value}")
    dtype = _DTYPES[spec.dtype]
    seed = int(spec.seed)
    task_name, s, task_knobs = Settings.split(spec.task)
    task = make_task(task_name, int(spec.seq_len), **task_knobs)
    name, cores, knobs = variant_for_training(spec.variant, device, task.seq2seq, s.causal)
    knobs = seeded_draw(knobs, seed)

    built = build_model(task, s, cores, knobs, seed)
    model = built.model.to(device=device, dtype=dtype)
    core = next(iter(attention_cores(model).values()))
    result["variant"] = core.describe()
    fig = result["figures"]
    fig.update(
        state_bytes=layer_state_bytes(core, s, task.seq_len, dtype),
        seed=seed,
        task_knobs=task.knobs(),
        params=built.params,
        params_baseline=built.params_baseline,
        params_ratio=built.params / built.params_baseline,
        ffn_width=built.ffn,
        core_knobs=built.knobs,
        d_model=s.d_model,
        model_heads=s.heads,
        layers=s.layers,
        decoder_layers=len(model.decoder),
        batch_size=s.batch_size,
    )

    # train and test examples come from separate generators and are kept apart by hash (data.draw)
    g_train = torch.Generator().manual_seed(2 * seed)
    test = held_out_set(task, s.test_size, seed).to(device)  # its generator is seeded 2 * seed + 1

    # one tiny step before the clock starts: Unsupported (and compile time, if any) show up here
    loss_of(model, test.rows(slice(0, 1))).backward()
    model.zero_grad(set_to_none=True)

    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, betas=(0.9, 0.98), weight_decay=s.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: _lr_factor(i, s))
    from tqdm import tqdm

    label = f"{task_name} {name} N={task.seq_len} seed={seed}"
    bar = tqdm(total=s.steps, desc=label, unit="step", leave=False, disable=not sys.stderr.isatty())
    losses: list[float] = []
    step_s: list[float] = []  # each step's time, data drawing included
    t0 = time.perf_counter()
    step = 0
    try:
        for step in range(s.steps):
            t_step = time.perf_counter()
            b = draw(task, s.batch_size, g_train, "train").to(device)
            loss = loss_of(model, b)
            if not torch.isfinite(loss):
                why = f"training loss is {float(loss.detach())} at step {step}"
                result["status"], result["reason"] = "nan", why
                fig["steps"] = step
                return
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if s.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            step_s.append(time.perf_counter() - t_step)
            if step % 10 == 0:
                bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
            bar.update(1)
            if s.max_train_s is not None and time.perf_counter() - t0 > s.max_train_s:
                break
    finally:
        bar.close()
    train_s = time.perf_counter() - t0
    done = len(losses)
    tail = max(1, done // 20)  # the last 5% of steps: one step's loss is noisy
    fig.update(
        train_s=train_s,
        steps=done,
        stopped_early=done < s.steps,
        step_ms=1e3 * train_s / max(1, done),
        # the median step after the first (which allocates the buffers the others reuse)
        step_ms_median=1e3 * statistics.median(step_s[1:] or step_s) if step_s else math.nan,
        first_loss=sum(losses[:tail]) / tail,
        final_loss=sum(losses[-tail:]) / tail,
        loss_curve=[round(sum(c) / len(c), 4) for c in _chunks(losses, 20)],
        threads=torch.get_num_threads(),
    )

    if s.peak_memory:
        b = draw(task, s.batch_size, g_train, "train").to(device)
        opt.zero_grad(set_to_none=True)
        fig["step_peak_mib"] = peak_bytes(lambda: loss_of(model, b).backward(), device) / 2**20
        opt.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    fig.update(evaluate(model, task, test, s))
    fig["eval_s"] = time.perf_counter() - t1
    result["variant"] = next(iter(attention_cores(model).values())).describe()  # now it knows what ran
    heat = attention_heatmap(model, task, test.rows(slice(0, 1)), s.heatmap_size) if s.heatmap_size else None
    if heat is not None:
        fig["attention"] = heat
    fig["settings"] = asdict(s)


def layer_state_bytes(core: AttentionVariant, s: Settings, seq_len: int, dtype: torch.dtype) -> int:
    """Bytes one sequence keeps per attention layer to decode after ``seq_len`` tokens with this
    model's heads and head size (``core.state_bytes``: the K/V cache, the window a bounded reach
    reads, or a fixed-size state): the x axis of the recall frontier."""
    d = s.d_model // s.heads
    w = Workload(
        batch=1, heads=s.heads, nq=1, nk=seq_len, head_dim=d, v_head_dim=d, dtype=dtype, causal=s.causal
    )
    return core.state_bytes(w)


def _chunks(xs: list[float], k: int) -> list[list[float]]:
    """``xs`` cut into at most ``k`` consecutive, nearly equal, non-empty pieces."""
    k = max(1, min(k, len(xs)))
    edges = [round(i * len(xs) / k) for i in range(k + 1)]
    return [xs[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]


def task_summary(figures: dict[str, Any], config: dict[str, Any]) -> str:
    """A task job's terminal text: test accuracy, final loss, steps, training time and parameters."""
    return (
        f"test accuracy {figures['test_accuracy']:.3f}"
        f", final loss {figures.get('final_loss', float('nan')):.3g}"
        f", {figures.get('steps')} steps in {figures.get('train_s', float('nan')):.1f} s"
        f", {figures.get('params')} params"
    )
