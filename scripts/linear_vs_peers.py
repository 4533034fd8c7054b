"""The linear-time variants against dense SDPA and against their peers outside this repository (issue 31).

Three parts, each timed interleaved, round by round, in one process on the CPU (forward only, one
wall-clock call per contender per round; each cell is the median over the rounds and their min-max),
as ``scripts/pattern_vs_flex.py`` times its contenders:

1. ``causal``: causal forward at each ``--sizes`` N of dense ``sdpa``, ``linear`` (default knobs),
   ``retention``, flash-linear-attention's pure-PyTorch references ``naive_chunk_linear_attn`` (beside
   our ``linear(feature_map=identity, normalize=False)``, the same formula) and ``naive_retention``
   (beside our ``retention``), with the max relative difference of each pair.
2. ``performer``: our ``performer`` against performer-pytorch's FAVOR+ (``FastAttention``: orthogonal
   features, the same count) at ``--peer-n``, non-causal and causal, with each one's deviation from
   exact softmax attention (float64 SDPA of the same inputs), averaged over ``--draws`` feature draws.
3. ``lowrank``: ``nystrom`` and ``linformer`` against lucidrains' ``nystrom-attention`` and
   ``linformer`` at ``--peer-n``, non-causal: their attention cores on our q, k, v (input and output
   projections replaced by identities, outside the timed call), time only.

Every round also measures the machine's fp32 GEMM rate as ``experiments/measure/roofline.py`` does (a
2048 x 2048 matmul); each of our kernels' GFLOP/s (its own ``flops``: its algorithm's work, not pairs)
is given as a % of the median of that rate. Prints as it goes; ``--out`` writes the Markdown tables.

    python scripts/linear_vs_peers.py --out results/cpu/linear_peers/RESULTS.md
    python scripts/linear_vs_peers.py --sizes 256 512 --peer-n 512 --rounds 2  # a quick check
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as fn
from arg_types import non_negative_int, output_file, positive_float, positive_int

import variants
from experiments.measure import machine_load
from experiments.measure.accuracy import error_stats
from experiments.measure.roofline import gemm_flops_per_s, gemm_n
from experiments.measure.spec import JobSpec
from experiments.records.environment import cpu_model
from experiments.sweep.allocator import JOB_ALLOCATOR_ENV

B, H, D = 1, 8, 64
IDENTITY = "linear(identity, normalize=false)"
FLA_CHUNK, FLA_RET = "fla naive_chunk_linear_attn", "fla naive_retention"
PEERS = ("fla-core", "performer-pytorch", "nystrom-attention", "linformer", "einops")


@dataclass
class Contender:
    """One timed call: ``run()`` returns its output; ``ours`` is the suite's variant it times (None for
    a peer), whose ``flops`` on ``workload`` give its GFLOP/s."""

    name: str
    run: Callable[[], torch.Tensor]
    ours: variants.AttentionVariant | None = None
    causal: bool = False
    times: list[float] = field(default_factory=list)


@dataclass
class Bench:
    rounds: int
    gemm_min_run_time: float
    gemm: list[float] = field(default_factory=list)  # FLOP/s, one figure per round of every part
    rows: list[dict] = field(default_factory=list)
    uniform_dev: dict[bool, float] = field(default_factory=dict)  # causal -> uniform attention's deviation
    load: dict[str, list[float]] = field(default_factory=dict)  # part -> cores others kept busy, per call

    def time(self, part: str, cs: list[Contender]) -> dict[str, torch.Tensor]:
        """First calls (the outputs, returned), then ``rounds`` rounds: each contender once, in turn,
        and the GEMM rate once."""
        start = machine_load.snapshot()
        with torch.no_grad():
            outs = {c.name: c.run() for c in cs}
            for _ in range(self.rounds):
                for c in cs:
                    t0 = time.perf_counter()
                    c.run()
                    c.times.append(time.perf_counter() - t0)
                self.gemm.append(gemm_flops_per_s("cpu", torch.float32, GEMM_N, self.gemm_min_run_time))
        others = machine_load.others_cores(start, machine_load.snapshot())
        if others is not None:
            self.load.setdefault(part, []).append(others)
        return outs


GEMM_N = gemm_n("cpu", torch.float32)


def qkv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, D, generator=g) for _ in range(3))  # type: ignore[return-value]


def workload(n: int, causal: bool) -> variants.Workload:
    return JobSpec(variant=None, batch=B, heads=H, head_dim=D, seq_len=n, causal=causal).workload()


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Max absolute difference over the reference's max absolute value (the suite's relative error), on
    the entries where the reference is finite, and the share of its entries that are not."""
    finite = ref.isfinite()
    return error_stats(out[finite], ref[finite], "d")["d_rel_err"], 1.0 - float(finite.double().mean())


def mean_rel_dev(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean absolute deviation over the reference's mean absolute value."""
    return float((out.double() - ref).abs().mean() / ref.abs().mean())


def record(part: str, n: int, c: Contender, **extra: object) -> dict:
    med = statistics.median(c.times)
    gflops = c.ours.flops(workload(n, c.causal)) / med / 1e9 if c.ours is not None else None
    row = {
        "part": part,
        "N": n,
        "causal": c.causal,
        "name": c.name,
        "ms": med * 1e3,
        "min_ms": min(c.times) * 1e3,
        "max_ms": max(c.times) * 1e3,
        "times_s": c.times,
        "gflops": gflops,
        **extra,
    }
    lo, hi = row["min_ms"], row["max_ms"]
    rate = f"  {gflops:7.2f} GFLOP/s" if gflops is not None else ""
    print(f"  {c.name:40s} {med * 1e3:10.2f} ms [{lo:.4g}-{hi:.4g}]{rate}", flush=True)
    return row


def ratio(a: Contender, b: Contender) -> dict[str, float]:
    """``a``'s time over ``b``'s: of the medians, and the range of the per-round ratios."""
    per_round = [x / y for x, y in zip(a.times, b.times, strict=True)]
    return {
        "ratio": statistics.median(a.times) / statistics.median(b.times),
        "round_min": min(per_round),
        "round_max": max(per_round),
    }


# ---------------------------------------------------------------------------------------------- parts
def causal_contenders(n: int, fla_retention_max: int) -> list[Contender]:
    from fla.ops.linear_attn.naive import naive_chunk_linear_attn
    from fla.ops.retention.naive import naive_retention

    q, k, v = qkv(n)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # fla's chunk layout (B, N, H, D)
    sdpa, lin, ret = variants.build("sdpa"), variants.build("linear"), variants.build("retention")
    lin_id = variants.build("linear", feature_map="identity", normalize=False)
    cs = [
        Contender("sdpa (dense)", lambda: sdpa(q, k, v, causal=True), sdpa),
        Contender("linear", lambda: lin(q, k, v, causal=True), lin),
        Contender("retention", lambda: ret(q, k, v, causal=True), ret),
        Contender(IDENTITY, lambda: lin_id(q, k, v, causal=True), lin_id),
        Contender(FLA_CHUNK, lambda: naive_chunk_linear_attn(qt, kt, vt)),
    ]
    if n <= fla_retention_max:  # it forms (H, N, N) decay and (B, H, N, N) score tensors
        cs.append(Contender(FLA_RET, lambda: naive_retention(q, k, v)))
    for c in cs:
        c.causal = True
    return cs


def causal_part(bench: Bench, sizes: list[int], fla_retention_max: int) -> None:
    try:  # the part compares against fla's references: without fla it has nothing to compare
        import fla.ops.linear_attn.naive  # noqa: F401
    except ImportError as e:
        print(f"fla (flash-linear-attention) not importable ({type(e).__name__}: {e}): causal part skipped")
        return
    for n in sizes:
        cs = causal_contenders(n, fla_retention_max)
        print(f"causal forward, N={n}:", flush=True)
        outs = bench.time("causal", cs)
        by = {c.name: c for c in cs}
        dense = by["sdpa (dense)"]
        pairs = {IDENTITY: (FLA_CHUNK, rel_diff(outs[IDENTITY].transpose(1, 2), outs[FLA_CHUNK]))}
        if FLA_RET in outs:
            pairs["retention"] = (FLA_RET, rel_diff(outs["retention"], outs[FLA_RET]))
        for c in cs:
            extra: dict = {"dense_over_this": ratio(dense, c)}
            if c.name in pairs:
                peer, (diff, bad) = pairs[c.name]
                extra.update(
                    peer=peer, peer_over_this=ratio(by[peer], c), max_rel_diff=diff, peer_nonfinite=bad
                )
                if bad:  # which heads: fla's naive_retention overflows its decay mask (inf * 0) in float32
                    ref = outs[peer]
                    extra["peer_nonfinite_heads"] = [h for h in range(H) if not ref[:, h].isfinite().all()]
            bench.rows.append(record("causal", n, c, **extra))
        for name, (peer, (diff, bad)) in pairs.items():
            r = ratio(by[peer], by[name])
            print(
                f"  {peer} / {name}: {r['ratio']:.2f}x; max rel difference {diff:.2e}"
                f" ({bad:.1%} of fla's output not finite)"
            )
        if n > fla_retention_max:
            print(f"  fla naive_retention not run above N={fla_retention_max} (N x N tensors per head)")


def performer_part(bench: Bench, n: int, features: int, draws: int) -> dict | None:
    try:
        from performer_pytorch import FastAttention
    except ImportError as e:
        print(f"performer-pytorch not importable ({e}): part 2 skipped")
        return None
    q, k, v = qkv(n)
    found = {}
    for causal in (False, True):
        ours = variants.build("performer", features=features, seed=0)
        torch.manual_seed(0)
        # ortho_scaling=0: orthogonal blocks, rows rescaled to Gaussian norms, as ours (performer.py)
        theirs = FastAttention(dim_heads=D, nb_features=features, ortho_scaling=0, causal=causal).eval()
        cs = [
            Contender(
                f"performer (features={features})", lambda o=ours, c=causal: o(q, k, v, causal=c), ours
            ),
            Contender(f"performer-pytorch FastAttention ({features})", lambda t=theirs: t(q, k, v)),
        ]
        for c in cs:
            c.causal = causal
        print(f"performer, N={n}, {'causal' if causal else 'non-causal'}:", flush=True)
        bench.time("performer", cs)
        # deviation from exact softmax attention, over feature draws (the timed ones are draw 0)
        with torch.no_grad():
            exact = fn.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
            # uniform attention over the visible keys: what an estimate collapsed to the mean of v gives
            seen = torch.arange(1, n + 1, dtype=torch.float64)[:, None] if causal else n
            uniform = (v.double().cumsum(-2) if causal else v.double().sum(-2, keepdim=True)) / seen
            bench.uniform_dev[causal] = mean_rel_dev(uniform.expand_as(exact), exact)
            devs: dict[str, list[float]] = {c.name: [] for c in cs}
            for seed in range(draws):
                o = variants.build("performer", features=features, seed=seed)
                torch.manual_seed(seed)
                t = FastAttention(dim_heads=D, nb_features=features, ortho_scaling=0, causal=causal)
                devs[cs[0].name].append(mean_rel_dev(o(q, k, v, causal=causal), exact))
                devs[cs[1].name].append(mean_rel_dev(t(q, k, v), exact))
        for c in cs:
            dev = statistics.mean(devs[c.name])
            extra = {"mean_rel_dev": dev, "mean_rel_dev_draws": devs[c.name]}
            if c.ours is not None:
                extra["peer"], extra["peer_over_this"] = cs[1].name, ratio(cs[1], cs[0])
            bench.rows.append(record("performer", n, c, **extra))
            print(f"    mean relative deviation from softmax attention over {draws} draws: {dev:.4f}")
        found[causal] = (cs, {c.name: statistics.mean(devs[c.name]) for c in cs})
    return found


class _Take(torch.nn.Module):
    """Columns ``[i * width, (i + 1) * width)`` of the last dimension: q, k or v of the packed input."""

    def __init__(self, i: int, width: int) -> None:
        super().__init__()
        self.i, self.width = i, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., self.i * self.width : (self.i + 1) * self.width]


def lowrank_part(bench: Bench, n: int) -> dict:
    from linformer import LinformerSelfAttention
    from nystrom_attention import NystromAttention

    q, k, v = qkv(n)
    inner = H * D
    packed = torch.cat([t.transpose(1, 2).flatten(2) for t in (q, k, v)], -1)  # (B, N, 3 H D)
    nys = variants.build("nystrom")  # landmarks 64, pinv_iters 6
    torch.manual_seed(0)
    lin = variants.build("linformer")  # proj_len 256, max_len 16384
    peer_nys = NystromAttention(
        dim=3 * inner,
        dim_head=D,
        heads=H,
        num_landmarks=nys.landmarks,
        pinv_iterations=nys.pinv_iters,
        residual=False,
    ).eval()
    peer_nys.to_qkv, peer_nys.to_out = torch.nn.Identity(), torch.nn.Identity()
    peer_lin = LinformerSelfAttention(
        dim=3 * inner, seq_len=lin.max_len, k=lin.proj_len, heads=H, dim_head=D
    ).eval()
    peer_lin.to_q, peer_lin.to_k, peer_lin.to_v = (_Take(i, inner) for i in range(3))
    peer_lin.to_out = torch.nn.Identity()
    with torch.no_grad():  # our E, F as its projections (its layout (max_len, k), ours (k, max_len))
        peer_lin.proj_k.copy_(lin.e.T)
        peer_lin.proj_v.copy_(lin.f.T)
    cs = [
        Contender("nystrom (landmarks=64)", lambda: nys(q, k, v), nys),
        Contender("nystrom-attention NystromAttention core", lambda: peer_nys(packed)),
        Contender("linformer (proj_len=256)", lambda: lin(q, k, v), lin),
        Contender("linformer LinformerSelfAttention core", lambda: peer_lin(packed)),
    ]
    print(f"low-rank, N={n}, non-causal:", flush=True)
    outs = bench.time("lowrank", cs)
    for ours, peer in ((cs[0], cs[1]), (cs[2], cs[3])):
        diff, _ = rel_diff(outs[ours.name].transpose(1, 2).flatten(2), outs[peer.name])
        bench.rows.append(
            record("lowrank", n, ours, peer=peer.name, peer_over_this=ratio(peer, ours), max_rel_diff=diff)
        )
        bench.rows.append(record("lowrank", n, peer))
        print(
            f"  {peer.name} / {ours.name}: {ratio(peer, ours)['ratio']:.2f}x; max rel difference {diff:.2e}"
        )
    return {c.name: c for c in cs}


# ------------------------------------------------------------------------------------------- markdown
def cell(row: dict) -> str:
    return f"{row['ms']:.4g} [{row['min_ms']:.4g}-{row['max_ms']:.4g}]"


def fmt_ratio(r: dict | None) -> str:
    return "" if r is None else f"{r['ratio']:.2f}x [{r['round_min']:.2f}-{r['round_max']:.2f}]"


def markdown(bench: Bench, args: argparse.Namespace, meta: dict) -> str:
    gemm = statistics.median(bench.gemm) / 1e9
    lines = [
        "# Linear-time variants against dense SDPA and their peers (issue 31)",
        "",
        f"Written by `scripts/linear_vs_peers.py` ({meta['when']}); {meta['cpu']}, "
        f"torch {torch.__version__}, 1 thread, fp32, B={B} H={H} D={D}, {args.rounds} interleaved rounds. "
        "Each time: median over the rounds [min-max], ms. A ratio `x / this`: of the medians, "
        "[the range of the per-round ratios].",
        "",
        f"**GEMM ceiling** (fp32 {GEMM_N}x{GEMM_N} matmul, one thread, `experiments/measure/roofline.py`'s "
        f"`gemm_flops_per_s`, once per round of every part, {len(bench.gemm)} figures): median "
        f"**{gemm:.1f} GFLOP/s** [{min(bench.gemm) / 1e9:.1f}-{max(bench.gemm) / 1e9:.1f}]. GFLOP/s of our "
        "kernels: each variant's own `flops(workload)` (its algorithm's work) over its median time; "
        "% GEMM: that over the median GEMM rate.",
        "",
        "Load: cores other processes kept busy while each part timed (of "
        + f"{os.cpu_count()}; /proc/stat, per timed group, listed): "
        + "; ".join(f"{p} " + ", ".join(f"{c:.2f}" for c in cs) for p, cs in bench.load.items())
        + f"; 1-minute load average {meta['load_start']:.2f} at the start, "
        f"{meta['load_end']:.2f} at the end.",
        "",
        "Peers: " + ", ".join(f"{p} {v}" for p, v in meta["peers"].items()) + ".",
        "",
        "Allocator (as in the suite's job processes, `experiments/sweep/allocator.py`): "
        + ", ".join(f"`{k}={v}`" for k, v in meta["allocator"].items())
        + ".",
        "",
    ]

    def rate(row: dict) -> tuple[str, str]:
        if row["gflops"] is None:
            return "", ""
        return f"{row['gflops']:.2f}", f"{100 * row['gflops'] / gemm:.1f}%"

    causal = [r for r in bench.rows if r["part"] == "causal"]
    if causal:
        lines += [
            "## Causal forward",
            "",
            "| N | contender | ms | GFLOP/s | % GEMM | dense sdpa / this | peer / this "
            "| max rel diff vs peer |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in causal:
            g, p = rate(r)
            peer = fmt_ratio(r.get("peer_over_this"))
            diff = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else ""
            if r.get("peer_nonfinite"):
                diff += f" (fla {r['peer_nonfinite']:.1%} NaN/inf: heads {r['peer_nonfinite_heads']})"
            lines.append(
                f"| {r['N']} | {r['name']} | {cell(r)} | {g} | {p} | {fmt_ratio(r['dense_over_this'])} "
                f"| {peer} | {diff} |"
            )
        lines += [
            "",
            "`peer / this`: fla's `naive_chunk_linear_attn` over `linear(identity, normalize=false)`, fla's "
            "`naive_retention` over `retention`; `max rel diff`: max |ours - fla| / max |fla| of the same "
            "inputs, over the entries where fla's is finite (its `naive_retention` forms the decay mask as "
            "exp2((i - j) log2 gamma) times (i >= j) in float32: above the diagonal exp2 overflows to inf "
            "once (j - i) |log2 gamma_h| > 128, and inf * 0 is NaN, which the einsum carries into the "
            "output rows of that head that have such a j). fla's `naive_retention` ran up to "
            f"N={args.fla_retention_max} (it forms (H, N, N) float32 tensors: 8.6 GB each at 16384).",
            "",
        ]
    perf = [r for r in bench.rows if r["part"] == "performer"]
    if perf:
        lines += [
            f"## Performer at N={args.peer_n}, {args.features} features",
            "",
            "| causal | contender | ms | GFLOP/s | % GEMM | theirs / ours "
            "| mean rel deviation from softmax |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in perf:
            g, p = rate(r)
            devs = ", ".join(f"{d:.4f}" for d in r["mean_rel_dev_draws"])
            lines.append(
                f"| {r['causal']} | {r['name']} | {cell(r)} | {g} | {p} "
                f"| {fmt_ratio(r.get('peer_over_this'))} | {r['mean_rel_dev']:.4f} ({devs}) |"
            )
        lines += [
            "",
            "Deviation: mean |out - exact| / mean |exact|, exact = float64 SDPA of the same inputs, averaged "
            f"over {args.draws} feature draws (seeds 0..{args.draws - 1}; the draws' figures in brackets); "
            "the timed instances are draw 0. Uniform attention over the visible keys (the mean of their "
            "values) deviates by "
            + ", ".join(f"{d:.4f} ({'causal' if c else 'non-causal'})" for c, d in bench.uniform_dev.items())
            + ": an estimate near that figure has collapsed to the mean.",
            "",
        ]
    low = [r for r in bench.rows if r["part"] == "lowrank"]
    if low:
        lines += [
            f"## Nystrom and Linformer at N={args.peer_n}, non-causal",
            "",
            "| contender | ms | GFLOP/s | % GEMM | theirs / ours | max rel diff vs peer |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in low:
            g, p = rate(r)
            diff = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else ""
            lines.append(
                f"| {r['name']} | {cell(r)} | {g} | {p} | {fmt_ratio(r.get('peer_over_this'))} | {diff} |"
            )
        lines += [
            "",
            "The peers' modules with their input projections replaced by slices of a packed (B, N, 3 H D) "
            "q|k|v built once outside the timed call, and their output projections by identities. The "
            "difference is a wiring check: nystrom-attention scales its pseudo-inverse's start by one norm "
            "over all heads, ours per head, so the two differ at H=8; linformer uses our E and F.",
            "",
        ]
    lines += ["## Goals", ""] + [f"- {g}" for g in goals(bench, args)] + [""]
    return "\n".join(lines)


def goals(bench: Bench, args: argparse.Namespace) -> list[str]:
    def find(part: str, name: str, n: int, causal: bool | None = None) -> dict | None:
        for r in bench.rows:
            if r["part"] == part and r["name"] == name and r["N"] == n and causal in (None, r["causal"]):
                return r
        return None

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**not met**"

    out = []
    for name in ("linear", "retention"):
        r = find("causal", name, 16384)
        if r is None:
            out.append(f"`{name}` >= 3x faster than dense sdpa at N=16384: not measured in this run")
            continue
        x = r["dense_over_this"]
        out.append(
            f"`{name}` >= 3x faster than dense sdpa at N=16384: {fmt_ratio(x)}: {verdict(x['ratio'] >= 3)}"
        )
    for name in ("linear", "retention"):
        rs = [r for r in bench.rows if r["part"] == "causal" and r["name"] == name]
        if rs:
            slow = [r["N"] for r in rs if r["dense_over_this"]["ratio"] <= 1]
            out.append(
                f"`{name}` faster than dense sdpa from N={min(r['N'] for r in rs)} (secondary): "
                + ", ".join(f"N={r['N']} {r['dense_over_this']['ratio']:.2f}x" for r in rs)
                + f": {verdict(not slow)}"
            )
    for name in ("linear(identity, normalize=false)", "retention"):
        r = find("causal", name, 8192)
        if r is None or "peer_over_this" not in r:
            out.append(f"`{name}` >= 2x faster than fla's naive form at N=8192: not measured")
            continue
        x, diff, bad = r["peer_over_this"], r["max_rel_diff"], r["peer_nonfinite"]
        heads = r.get("peer_nonfinite_heads")
        where = f" on fla's finite entries (fla's output is {bad:.1%} NaN/inf, heads {heads})" if bad else ""
        out.append(
            f"`{name}` >= 2x faster than fla's `{r['peer'].split()[-1]}` at N=8192: {fmt_ratio(x)}: "
            f"{verdict(x['ratio'] >= 2)}; equal within 1e-4 relative{where}: {diff:.1e}: "
            f"{verdict(diff <= 1e-4)}"
        )
    for causal in (False, True):
        ours = find("performer", f"performer (features={args.features})", args.peer_n, causal)
        theirs = find("performer", f"performer-pytorch FastAttention ({args.features})", args.peer_n, causal)
        if ours is None or theirs is None:
            continue
        x = ours["peer_over_this"]
        d_o, d_t = ours["mean_rel_dev"], theirs["mean_rel_dev"]
        out.append(
            f"`performer` ({'causal' if causal else 'non-causal'}, N={args.peer_n}) >= 2x faster than "
            f"performer-pytorch: {fmt_ratio(x)}: {verdict(x['ratio'] >= 2)}; deviation within 10% of theirs "
            f"(ours <= 1.1 x theirs): {d_o:.4f} vs {d_t:.4f} ({d_o / d_t:.3f}x): {verdict(d_o <= 1.1 * d_t)}"
        )
    return out


def run_under_job_allocator() -> None:
    """Re-execute this script with the allocator of the suite's job processes
    (experiments/sweep/allocator.py: freed memory kept, in huge pages) where it is not set yet, so
    every contender runs as a sweep job would; it must be in place when the process starts."""
    missing = {k: v for k, v in JOB_ALLOCATOR_ENV.items() if k not in os.environ}
    if missing:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **missing})


Option = tuple[str, dict]  # an option's flag and its add_argument keywords


def comparison_parser(
    doc: str,
    sizes_help: str,
    rounds: int,
    after_sizes: Sequence[Option] = (),
    after_rounds: Sequence[Option] = (),
) -> argparse.ArgumentParser:
    """The parser of this script and of ``scripts/gated_vs_peers.py``: the description (``doc``'s first
    paragraph), ``--sizes``, ``after_sizes``, ``--rounds`` (default ``rounds``), ``after_rounds``, then
    ``--gemm-min-run-time``, ``--out`` and ``--json``, in that order (the order of ``--help``)."""
    ap = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--sizes", type=positive_int, nargs="+", default=[2048, 4096, 8192, 16384], help=sizes_help
    )
    for flag, options in after_sizes:
        ap.add_argument(flag, **options)
    ap.add_argument(
        "--rounds", type=positive_int, default=rounds, help="interleaved rounds; a cell is their median"
    )
    for flag, options in after_rounds:
        ap.add_argument(flag, **options)
    ap.add_argument(
        "--gemm-min-run-time",
        type=positive_float,
        default=0.5,
        help="seconds per round timing the fp32 GEMM rate (the machine's ceiling)",
    )
    ap.add_argument("--out", type=output_file, help="write the Markdown tables here")
    ap.add_argument("--json", type=output_file, help="write every cell here")
    return ap


PARTS = ["causal", "performer", "lowrank"]


def parser() -> argparse.ArgumentParser:
    return comparison_parser(
        __doc__,
        "causal part's N",
        7,
        after_sizes=[
            ("--peer-n", dict(type=positive_int, default=4096, help="N of the performer and low-rank parts"))
        ],
        after_rounds=[
            (
                "--features",
                dict(
                    type=positive_int, default=256, help="random features of both performers (performer part)"
                ),
            ),
            (
                "--draws",
                dict(type=positive_int, default=3, help="feature draws the performer deviations average"),
            ),
            (
                "--fla-retention-max",
                dict(
                    type=non_negative_int, default=8192, help="largest N for fla's naive_retention (0: never)"
                ),
            ),
            # choices: a misspelt part would otherwise run nothing and fail on an empty GEMM list
            ("--parts", dict(nargs="+", choices=PARTS, default=PARTS, help="which parts to run")),
        ],
    )


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    for n in args.sizes if "causal" in args.parts else []:  # refused here, not by einops inside fla
        if n % 64:
            ap.error(
                f"--sizes {n}: fla's naive_chunk_linear_attn cuts N into 64-token chunks: a multiple of 64"
            )
    run_under_job_allocator()
    torch.set_num_threads(1)
    versions = {}
    for p in PEERS:
        try:
            versions[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            versions[p] = "not installed"
    meta = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "load_start": os.getloadavg()[0],
        "allocator": {k: os.environ[k] for k in JOB_ALLOCATOR_ENV},
        "peers": versions,
    }
    print(
        f"cpu ({meta['cpu']}), 1 thread, float32, B={B} H={H} D={D}, {args.rounds} rounds; peers {versions};"
        f" allocator {meta['allocator']}"
    )
    bench = Bench(args.rounds, args.gemm_min_run_time)
    if "causal" in args.parts:
        causal_part(bench, args.sizes, args.fla_retention_max)
    if "performer" in args.parts:
        performer_part(bench, args.peer_n, args.features, args.draws)
    if "lowrank" in args.parts:
        lowrank_part(bench, args.peer_n)
    if not bench.rows:
        raise SystemExit(f"nothing was measured (--parts {' '.join(args.parts)}): see the lines above")
    meta["load_end"] = os.getloadavg()[0]
    g = bench.gemm
    lo, hi = min(g) / 1e9, max(g) / 1e9
    print(f"GEMM {GEMM_N}: median {statistics.median(g) / 1e9:.1f} GFLOP/s [{lo:.1f}-{hi:.1f}]")
    print("cores kept busy by other processes, per part:", bench.load)
    md = markdown(bench, args, meta)
    print("\n".join(md.split("## Goals", 1)[1].splitlines()))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "meta": meta, "gemm_flops_per_s": g, "rows": bench.rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
