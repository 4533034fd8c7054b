"""What the attnbench transformers backend costs: a Llama-style forward through
``attn_implementation="attnbench_<name>"`` against transformers' own ``sdpa`` and ``eager`` (issue 16).

One random-weight Llama-style base model (``LlamaModel``, no LM head: attention is a larger share of
the time) per implementation, all with the same weights; each round runs one forward of every
implementation in turn (interleaved, so drift on a shared machine hits all alike), after warm-up
forwards. ``--mode forward`` (default) times one forward of ``input_ids (B, N)``; ``--mode decode``
times one decoding step, a token ``(B, 1)`` against a ``DynamicCache`` of ``N`` tokens (cut back to
``N`` after each step, so every step reads ``N + 1`` keys). ``--pad P`` left-pads the first ``P``
tokens of batch row 0 (mask zeros), which makes both sdpa paths use a mask. Prints, per
implementation: median ms over the rounds, the interquartile range (q1-q3, and as % of the median),
the median of the per-round ratios to native ``sdpa``, and the largest difference of the hidden
states from eager's (real tokens only).

    python scripts/hf_overhead.py                          # N=1024, B=1, hidden 512, 8 heads, 2 KV heads
    python scripts/hf_overhead.py --lengths 1024 4096 --rounds 21 --impls attnbench_SDPA sdpa
    python scripts/hf_overhead.py --mode decode --lengths 4096 --batch 4 --pad 100
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from arg_types import non_negative_int, positive_int, threads
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import variants
from experiments.records.environment import cpu_model
from integrations import transformers_backend as hf


def build_models(args: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """One ``LlamaModel`` per implementation in ``args.impls``, same random weights, eval mode, fp32."""
    from transformers import AutoModel, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.lengths),
    )
    torch.manual_seed(0)
    models: dict[str, torch.nn.Module] = {}
    state = None
    for impl in args.impls:
        # from_config writes attn_implementation into the config it is given: copy it
        try:
            m = AutoModel.from_config(copy.deepcopy(cfg), attn_implementation=impl).eval()
        except (ImportError, ValueError) as exc:  # transformers' own: a kernel not installed here
            print(f"# {impl} left out: {one_line(exc)}")
            continue
        if state is None:
            state = m.state_dict()
        else:
            m.load_state_dict(state)
        if impl.startswith(hf.PREFIX) and variants.get(hf.name_of(impl)).has_params:
            hf.attach(m, hf.name_of(impl))  # a learned variant: its own (random) weights in each layer
        models[impl] = m
    return models


def timed_call(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, mode: str
) -> Callable[[], torch.Tensor]:
    """The call one round times for ``model``, returning its hidden states.

    ``ids``/``mask`` are ``(B, N + 1)``. forward: the first ``N`` tokens, ``(B, N, hidden)`` out.
    decode: token ``N`` against a ``DynamicCache`` holding the first ``N`` (filled here, untimed),
    ``(B, 1, hidden)`` out; the cache is cut back to ``N`` after each call, so every call sees
    ``Nk = N + 1`` (the cut is inside the timed call: a view, no copy).
    """
    from transformers import DynamicCache

    n = ids.shape[1] - 1
    if mode == "forward":
        return lambda: model(input_ids=ids[:, :n], attention_mask=mask[:, :n]).last_hidden_state
    cache = DynamicCache(config=model.config)
    model(
        input_ids=ids[:, :n], attention_mask=mask[:, :n], **{hf.cache_keyword(model): cache}, use_cache=True
    )

    def step() -> torch.Tensor:
        out = model(
            input_ids=ids[:, n:], attention_mask=mask, **{hf.cache_keyword(model): cache}, use_cache=True
        )
        cache.crop(-1)  # transformers 5: a negative count of tokens to drop
        return out.last_hidden_state

    return step


def one_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, with its type."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of ``xs``."""
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def main() -> None:
    ap = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[1024], help="sequence lengths N")
    ap.add_argument("--batch", type=positive_int, default=1, help="batch size B")
    ap.add_argument("--layers", type=positive_int, default=4, help="decoder layers of the model")
    ap.add_argument("--hidden", type=positive_int, default=512, help="hidden size (a multiple of --heads)")
    ap.add_argument("--intermediate", type=positive_int, default=None, help="MLP width (None: 4 x hidden)")
    ap.add_argument("--heads", type=positive_int, default=8, help="query heads (a multiple of --kv-heads)")
    ap.add_argument("--kv-heads", type=positive_int, default=2, help="key/value heads (GQA when < --heads)")
    ap.add_argument("--pad", type=non_negative_int, default=0, help="left padding of batch row 0, in tokens")
    ap.add_argument(
        "--mode",
        choices=["forward", "decode"],
        default="forward",
        help="forward: N tokens at once; decode: one token against a cache of N",
    )
    ap.add_argument("--rounds", type=positive_int, default=15, help="at least 2 (the quartiles need two)")
    ap.add_argument("--warmup", type=positive_int, default=3, help="untimed calls, the first one compared")
    ap.add_argument("--threads", type=threads, default=None, help="torch threads (None: torch's)")
    ap.add_argument(
        "--impls",
        nargs="+",
        default=["sdpa", hf.implementation("sdpa"), "eager"],
        help=f"attention implementations: transformers' own (sdpa, eager, ...) or ours, spelled "
        f"{hf.PREFIX}<variant> with 'sdpa' and 'flash' in the variant's name upper-cased "
        f"(e.g. {hf.implementation('sdpa')}, {hf.implementation('chunked')})",
    )
    args = ap.parse_args()
    # what transformers or the statistics would otherwise refuse deep inside, or measure wrong
    if args.rounds < 2:
        ap.error(f"--rounds {args.rounds}: the interquartile range needs at least 2 rounds")
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.pad >= min(args.lengths):  # a row with no real token: nothing of it to compare
        ap.error(f"--pad {args.pad} leaves batch row 0 no real token at N={min(args.lengths)} (--lengths)")
    theirs = sorted(set(ALL_ATTENTION_FUNCTIONS.keys()) | {"eager"})
    for impl in args.impls:
        if impl.startswith(hf.PREFIX) and hf.name_of(impl) not in variants.available():
            known = ", ".join(variants.available())
            ap.error(f"--impls {impl}: no variant '{hf.name_of(impl)}'; known: {known}")
        if impl.startswith(hf.PREFIX) and impl != hf.implementation(hf.name_of(impl)):
            spelled = hf.implementation(hf.name_of(impl))
            ap.error(f"--impls {impl}: spell it {spelled} (transformers reads 'sdpa' or 'flash' as its own)")
        if not impl.startswith(hf.PREFIX) and impl not in theirs and "/" not in impl:  # "/": a Hub kernel
            ap.error(f"--impls {impl}: transformers knows {', '.join(theirs)}; ours are {hf.PREFIX}<variant>")
    if args.threads:
        torch.set_num_threads(args.threads)
    hf.register([hf.name_of(i) for i in args.impls if i.startswith(hf.PREFIX)])
    models = build_models(args)
    if not models:
        raise SystemExit("no implementation of --impls can be built here")
    print(
        f"# {cpu_model()}, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}; LlamaModel fp32: {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads, {args.kv_heads} KV heads, head_dim {args.hidden // args.heads}, "
        f"B={args.batch}, pad={args.pad}; {args.mode}; {args.rounds} interleaved rounds after "
        f"{args.warmup} warm-up"
    )
    print(
        "| N | implementation | median ms | IQR ms (q1-q3) | IQR % | ratio to sdpa | max abs diff vs eager |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    ours = [impl for impl in args.impls if impl.startswith(hf.PREFIX)]
    measured: set[str] = set()  # the implementations timed at some N
    for n in args.lengths:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, 1024, (args.batch, n + 1), generator=g)  # (B, N + 1)
        mask = torch.ones(args.batch, n + 1, dtype=torch.long)  # (B, N + 1), 1 = real token
        mask[0, : args.pad] = 0
        outs = {}
        with torch.no_grad():  # as generate() runs
            steps = {}
            for impl, m in models.items():
                try:  # the first call says whether it can run here (device, dtype, learned weights)
                    steps[impl] = timed_call(m, ids, mask, args.mode)
                    outs[impl] = steps[impl]()  # (B, N | 1, hidden)
                except Exception as exc:  # noqa: BLE001 - any failure leaves this one out, named
                    print(f"# N={n}: {impl} left out: {one_line(exc)}")
                    steps.pop(impl, None)
                    continue
                for _ in range(args.warmup - 1):
                    steps[impl]()
            if not steps:
                raise SystemExit(f"N={n}: no implementation of --impls could run here")
            times = {impl: [] for impl in steps}
            measured.update(steps)
            for _ in range(args.rounds):
                for impl, step in steps.items():
                    t0 = time.perf_counter()
                    step()
                    times[impl].append((time.perf_counter() - t0) * 1e3)
        # compare real tokens only (padded queries differ by convention)
        real = mask[:, :n].bool() if args.mode == "forward" else mask[:, n:].bool()
        ref = outs.get("eager")
        for impl, ts in times.items():
            q1, med, q3 = quartiles(ts)
            ratio = (
                statistics.median(t / s for t, s in zip(ts, times["sdpa"], strict=True))
                if "sdpa" in times
                else float("nan")
            )
            diff = (outs[impl] - ref)[real].abs().max().item() if ref is not None else float("nan")
            print(
                f"| {n} | {impl} | {med:.2f} | {q3 - q1:.2f} ({q1:.2f}-{q3:.2f}) "
                f"| {100 * (q3 - q1) / med:.0f} | {ratio:.3f} | {diff:.1e} |"
            )

    if ours and not measured.intersection(ours):  # only transformers' own measured: nothing of ours
        raise SystemExit(f"every attnbench implementation asked for ({', '.join(ours)}) was left out")


if __name__ == "__main__":
    main()
