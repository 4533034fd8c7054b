"""The gated and delta-rule recurrences against dense SDPA and flash-linear-attention's pure-PyTorch
references (issue 32's speed goals), on the CPU.

Causal forward at each ``--sizes`` N (B=1, H=8, D=64, fp32, one thread), timed interleaved round by
round in one process as ``scripts/linear_vs_peers.py`` does (its timing, GEMM ceiling, load and
allocator machinery): dense ``sdpa``, our ``ssd``, ``gla``, ``deltanet``, ``gated_deltanet`` (default
knobs, chunk 64), and, up to ``--fla-max``, fla's references fed our own gates (so the outputs must
agree): ``naive_chunk_simple_gla`` beside ``ssd``, ``naive_recurrent_gla`` beside ``gla`` (fla has no
pure-PyTorch chunked GLA), ``delta_rule_chunkwise`` beside ``deltanet`` (its chunk of 32, its ``q``
scaling: ours is ``1/sqrt(D)`` too) and ``naive_chunk_gated_delta_rule`` beside ``gated_deltanet``.

Both sides of each pair time the same work, gates included: ours compute their gates (and the delta
rules' unit keys) inside the forward, so each fla call computes the same gates inside its timed call
too (our module's ``_gates`` of the keys, put into fla's layout) and normalizes its keys there. Only
q, k and v are put into fla's (B, N, H, D) layout once, outside the timed calls (ours take them as
given). Without fla installed, a line says so and ours are timed against dense SDPA alone.

    python scripts/gated_vs_peers.py --out results/cpu/gated_peers/RESULTS.md --json /tmp/gated.json
    python scripts/gated_vs_peers.py --sizes 256 512 --rounds 2    # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as fn
from arg_types import non_negative_int
from linear_vs_peers import (
    GEMM_N,
    B,
    Bench,
    Contender,
    D,
    H,
    cell,
    comparison_parser,
    fmt_ratio,
    qkv,
    ratio,
    record,
    rel_diff,
    run_under_job_allocator,
)

import variants
from experiments.records.environment import cpu_model
from experiments.sweep.allocator import JOB_ALLOCATOR_ENV

OURS = ("ssd", "gla", "deltanet", "gated_deltanet")


def _bthd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).contiguous()  # (B, H, N, D) -> fla's (B, N, H, D)


def fla_references() -> tuple[dict[str, tuple[str, Callable]] | None, str]:
    """fla's references by the name of ours each is beside (its name, its function), or None and why
    fla could not be imported."""
    try:
        from fla.ops.delta_rule.naive import delta_rule_chunkwise
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
        from fla.ops.gla.naive import naive_recurrent_gla
        from fla.ops.simple_gla.naive import naive_chunk_simple_gla
    except ImportError as e:
        return None, f"{type(e).__name__}: {e}"
    refs = (naive_chunk_simple_gla, naive_recurrent_gla, delta_rule_chunkwise, naive_chunk_gated_delta_rule)
    return {name: (f"fla {f.__name__}", f) for name, f in zip(OURS, refs, strict=True)}, ""


def contenders(
    n: int, fla_max: int, refs: dict[str, tuple[str, Callable]] | None
) -> tuple[list[Contender], dict[str, str]]:
    """The contenders at ``n`` and, for each of ours, the fla reference of ``refs`` beside it (none
    above ``fla_max`` or without ``refs``). Each call, ours or fla's, computes its gates from the keys."""
    q, k, v = qkv(n)
    sdpa = variants.build("sdpa")
    cs = [Contender("sdpa (dense)", lambda: sdpa(q, k, v, causal=True), sdpa, causal=True)]
    ours = {}
    for name in OURS:
        torch.manual_seed(0)
        ours[name] = variants.build(name, heads=H, head_dim=D)
        cs.append(Contender(name, lambda m=ours[name]: m(q, k, v, causal=True), ours[name], causal=True))
    peers: dict[str, str] = {}
    if n > fla_max or refs is None:
        return cs, peers
    qt, kt, vt = (_bthd(x) for x in (q, k, v))  # fla's layout, once: ours take q, k, v as they are

    # inside each timed call, as in ours: our gates of the keys, in the reference's layout, and the
    # delta rules' unit keys
    def ssd() -> torch.Tensor:
        g = ours["ssd"]._gates(k)[0].transpose(1, 2).contiguous()  # (B, N, H)
        return refs["ssd"][1](qt, kt, vt, g)[0]

    def gla() -> torch.Tensor:
        return refs["gla"][1](qt, kt, vt, _bthd(ours["gla"]._gates(k)[0]))[0]  # g (B, N, H, D)

    def deltanet() -> torch.Tensor:  # delta_rule_chunkwise takes (B, H, N, D), beta (B, H, N)
        beta = ours["deltanet"]._gates(k)[1]
        return refs["deltanet"][1](q, fn.normalize(k, dim=-1, eps=1e-6), v, beta)[0]

    def gated_deltanet() -> torch.Tensor:
        g, beta = (x.transpose(1, 2).contiguous() for x in ours["gated_deltanet"]._gates(k))  # (B, N, H)
        return refs["gated_deltanet"][1](qt, fn.normalize(kt, dim=-1, eps=1e-6), vt, g, beta)[0]

    for run in (ssd, gla, deltanet, gated_deltanet):
        peer = refs[run.__name__][0]
        cs.append(Contender(peer, run, causal=True))
        peers[run.__name__] = peer
    return cs, peers


def parser() -> argparse.ArgumentParser:
    fla_max = dict(type=non_negative_int, default=8192, help="largest N for fla's references")
    return comparison_parser(
        __doc__,
        "sequence lengths N (multiples of 64 up to --fla-max)",
        5,
        after_rounds=[("--fla-max", fla_max)],
    )


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    for n in args.sizes:  # refused here, not by an assert inside fla
        if n <= args.fla_max and n % 64:
            ap.error(
                f"--sizes {n}: fla's chunked references (run up to --fla-max {args.fla_max}) need N a "
                "multiple of 64"
            )
    run_under_job_allocator()
    torch.set_num_threads(1)
    refs, why = fla_references()
    if refs is None:
        print(f"fla (flash-linear-attention) not importable ({why}): its references left out", flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_start = os.getloadavg()[0]
    bench = Bench(args.rounds, args.gemm_min_run_time)
    for n in args.sizes:
        cs, peers = contenders(n, args.fla_max, refs)
        print(f"causal forward, N={n}:", flush=True)
        outs = bench.time("gated", cs)
        by = {c.name: c for c in cs}
        for c in cs:
            extra: dict = {"dense_over_this": ratio(by["sdpa (dense)"], c)}
            if c.name in peers:
                peer = peers[c.name]
                theirs = outs[peer] if outs[peer].shape == outs[c.name].shape else outs[peer].transpose(1, 2)
                diff, bad = rel_diff(outs[c.name], theirs)
                extra.update(
                    peer=peer, peer_over_this=ratio(by[peer], c), max_rel_diff=diff, peer_nonfinite=bad
                )
                print(
                    f"  {peer} / {c.name}: {extra['peer_over_this']['ratio']:.2f}x; max rel diff {diff:.2e}"
                )
            bench.rows.append(record("gated", n, c, **extra))
    gemm = statistics.median(bench.gemm) / 1e9
    lines = [
        "# Gated and delta-rule recurrences against dense SDPA and fla's references (issue 32)",
        "",
        f"Written by `scripts/gated_vs_peers.py` ({when}); {cpu_model()}, torch {torch.__version__}, "
        f"1 thread, fp32, B={B} H={H} D={D}, causal, {args.rounds} interleaved rounds; each time the median "
        "over the rounds [min-max], ms; a ratio `x / this` of the medians [range of the per-round ratios]. "
        + (
            "fla's references get our gates, so their outputs must equal ours; every timed call includes "
            "its gates (ours in the forward, fla's computed by our modules inside its call, with the delta "
            "rules' unit keys), only q, k, v's layout for fla is made outside."
            if refs is not None
            else f"fla's references not run: fla not importable ({why})."
        ),
        "",
        f"GEMM ceiling (fp32 {GEMM_N}x{GEMM_N}, one thread, once per round): median {gemm:.1f} GFLOP/s "
        f"[{min(bench.gemm) / 1e9:.1f}-{max(bench.gemm) / 1e9:.1f}]. Load: cores other processes kept busy "
        f"per N: {', '.join(f'{x:.2f}' for x in bench.load.get('gated', []))}; 1-minute load average "
        f"{load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end. Allocator: "
        + ", ".join(f"`{k}={v}`" for k, v in JOB_ALLOCATOR_ENV.items())
        + ".",
        "",
        "| N | contender | ms | GFLOP/s | % GEMM | dense sdpa / this | fla / this | max rel diff vs fla |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in bench.rows:
        g = f"{r['gflops']:.2f}" if r["gflops"] is not None else ""
        p = f"{100 * r['gflops'] / gemm:.1f}%" if r["gflops"] is not None else ""
        diff = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else ""
        lines.append(
            f"| {r['N']} | {r['name']} | {cell(r)} | {g} | {p} | {fmt_ratio(r['dense_over_this'])} "
            f"| {fmt_ratio(r.get('peer_over_this'))} | {diff} |"
        )
    lines += ["", "## Goals", ""]
    big, mid = max(args.sizes), 8192
    for name in OURS:
        at = {r["N"]: r for r in bench.rows if r["name"] == name}
        if big in at:
            x = at[big]["dense_over_this"]
            lines.append(f"- `{name}` faster than dense sdpa at N={big}: {fmt_ratio(x)}: {x['ratio'] > 1}")
        if mid in at and "peer_over_this" in at[mid]:
            x, diff = at[mid]["peer_over_this"], at[mid]["max_rel_diff"]
            lines.append(
                f"- `{name}` >= 2x faster than `{at[mid]['peer']}` at N={mid}: {fmt_ratio(x)}: "
                f"{x['ratio'] >= 2}; equal within 1e-4 relative: {diff:.1e}: {diff <= 1e-4}"
            )
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "gemm_flops_per_s": bench.gemm, "rows": bench.rows}, f, indent=1)


if __name__ == "__main__":
    main()
