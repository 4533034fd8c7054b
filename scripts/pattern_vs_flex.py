"""Pattern variants against FlexAttention with the same pattern and against dense SDPA (issue 12);
on CUDA also xFormers with the same window (issue 37).

Contenders are timed interleaved, round by round, in one process; each cell is the median over the
rounds and the min-max of the rounds. CPU: one wall-clock call per round, forward or forward+backward
(flex has no CPU backward: its contenders are left out there). CUDA: the harness's CUDA-event timer
(``experiments.measure.timing.time_cuda``), forward or forward+backward. Prints one row per
contender and length: ms, useful TFLOP/s (the variant's own pair count, DESIGN.md), and for flex the
TFLOP/s over the tiles its block mask visits.

    python scripts/pattern_vs_flex.py --lengths 1024 2048 4096 8192 16384 --rounds 7
    python scripts/pattern_vs_flex.py --mode fwd_bwd --lengths 1024 4096 16384 --rounds 5
    python scripts/pattern_vs_flex.py --device cuda --dtype bfloat16 --mode fwd_bwd --lengths 16384 \\
        --shape 1 8 64 --shape 4 16 128

``--profile K`` also profiles one call of each contender (``experiments.measure.profile``) and prints
its K longest kernels (CUDA: device time; the CPU: each operator's own time), so that a kernel whose
one long program sets the call's time shows up by name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from arg_types import non_negative_int, output_file, positive_float, positive_int, threads

import variants
from experiments.measure.profile import format_table, kernel_table
from experiments.measure.timing import time_cuda
from experiments.records.environment import cpu_model
from variants.flex_kernel import tiles_per_head


def contenders(window: int, block: int, device: str) -> dict[str, variants.AttentionVariant]:
    """The variants compared: each pattern variant by default and with ``impl=flex`` (compiled
    FlexAttention with its pattern), their fused-SDPA route, and on CUDA xFormers' window, on the CPU
    local_window's plain-PyTorch route."""
    c = {
        "local_window": variants.build("local_window", window=window),
        "flex window": variants.build("local_window", window=window, impl="flex"),
        "sparse": variants.build("sparse", block=block),
        "flex sparse": variants.build("sparse", block=block, impl="flex"),
        "sdpa (dense)": variants.build("sdpa"),
    }
    # the fused-SDPA routes, which auto takes on neither device for a forward (CUDA: flex; the CPU:
    # the suite's C kernel)
    c["local_window[sdpa]"] = variants.build("local_window", window=window, impl="sdpa")
    c["sparse[sdpa]"] = variants.build("sparse", block=block, impl="sdpa")
    if device == "cuda":
        # xFormers' local-attention type; lift_gate: its PyTorch-backed operators run on a torch the
        # wheel was not built for (the record-free script says nothing else about it)
        c["xformers window"] = variants.build("xformers", window=window, lift_gate=True)
        # sparse in 128-wide tiles with its global rows in the block mask, and apart, whatever the
        # shape; and in 64-wide tiles (whole layout blocks, autotuned) with them in the mask and apart:
        # what sparse's per-shape choice (cuda_tile=auto, global_rows=auto) saves or costs
        placements = {
            "sparse[global in mask]": (128, "block_mask"),
            "sparse[global dense]": (128, "dense"),
            "sparse[tile 64]": (64, "block_mask"),
            "sparse[tile 64 global dense]": (64, "dense"),
        }
        for name, (tile, rows) in placements.items():
            c[name] = variants.build("sparse", block=block, impl="flex", cuda_tile=tile, global_rows=rows)
    else:
        c["local_window[blocked]"] = variants.build("local_window", window=window, impl="blocked")
    return {name: attn.to(device) for name, attn in c.items()}


def visited_pairs(attn: variants.AttentionVariant, q: torch.Tensor, k: torch.Tensor) -> int | None:
    """Pairs inside the tiles the block mask of a variant's flex route visits (partial and full
    tiles), per (batch, head); None where the route that ran was not flex."""
    if attn.describe().get("impl_ran") != "flex":
        return None
    # sparse's global query rows, where computed apart, are one dense call beside the kernel
    # (variants/sparse.py), whose block mask skips them; the pairs of the dense call count
    n = k.shape[2]
    apart = attn.describe().get("global_rows") == "dense"
    ng = min(attn.global_blocks * attn.block, q.shape[2]) if apart else 0
    kernel = getattr(attn, "flex_ran", None) or attn._flex  # sparse: the kernel of the call just timed
    bm = kernel.block_mask(q, k, False, None, None)
    if bm is None:
        return None
    qt, kt = bm.BLOCK_SIZE
    return round(tiles_per_head(bm) * qt * kt) + ng * n  # the kernel's tiles and the dense global rows


def call(
    attn: variants.AttentionVariant, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str
) -> Callable:
    if mode == "fwd":

        def fwd() -> None:
            with torch.no_grad():
                attn(q, k, v)

        return fwd
    grad = torch.randn_like(q)

    def fwd_bwd() -> None:
        attn(q, k, v).backward(grad)

    return fwd_bwd


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--lengths", type=positive_int, nargs="+", default=[1024, 2048, 4096, 8192], help="sequence lengths N"
    )
    ap.add_argument(
        "--rounds", type=positive_int, default=7, help="interleaved rounds; a cell is their median"
    )
    ap.add_argument(
        "--threads",
        type=threads,
        default=torch.get_num_threads(),
        help="torch threads; the default is torch's count here",
    )
    ap.add_argument("--window", type=non_negative_int, default=128, help="local_window radius, tokens")
    ap.add_argument("--block", type=positive_int, default=64, help="sparse block (flex sparse uses the same)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="q, k, v dtype"
    )
    ap.add_argument(
        "--mode", default="fwd", choices=["fwd", "fwd_bwd"], help="time the forward, or forward+backward"
    )
    ap.add_argument(
        "--shape",
        type=positive_int,
        nargs=3,
        action="append",
        metavar=("B", "H", "D"),
        help="batch, heads, head size; repeat for several (None: 1 8 64)",
    )
    ap.add_argument("--min-run-time", type=positive_float, default=0.2, help="CUDA: seconds per timing")
    ap.add_argument("--json", type=output_file, help="write every cell here")
    ap.add_argument(
        "--profile", type=non_negative_int, default=0, metavar="K", help="print each call's K longest kernels"
    )
    ap.add_argument(
        "--contenders", help="comma-separated names to time (None: all); 'sdpa (dense)' is always timed"
    )
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():  # else torch's AssertionError, mid-setup
        ap.error("--device cuda: no CUDA GPU here (torch.cuda.is_available() is False)")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = args.shape or [[1, 8, 64]]
    where = torch.cuda.get_device_name() if args.device == "cuda" else cpu_model()  # the machine's name
    print(
        f"{args.device} ({where}, {args.threads} threads), torch {torch.__version__}, {args.dtype}, "
        f"{args.mode}, window {args.window}, sparse block {args.block}"
    )
    rows = []
    for bsz, h, d in shapes:
        for n in args.lengths:
            torch._dynamo.reset()  # one compiled kernel per shape, never dynamo's eager fallback after 8
            g = torch.Generator().manual_seed(0)
            q, k, v = (
                torch.randn(bsz, h, n, d, generator=g)
                .to(args.device, dtype)
                .requires_grad_(args.mode == "fwd_bwd")
                for _ in range(3)
            )
            cs = contenders(args.window, args.block, args.device)
            if args.contenders:
                keep = {*args.contenders.split(","), "sdpa (dense)"}
                if unknown := keep - cs.keys():
                    ap.error(f"unknown contenders {sorted(unknown)}; known: {', '.join(cs)}")
                cs = {name: attn for name, attn in cs.items() if name in keep}
            if args.mode == "fwd_bwd" and args.device == "cpu":  # flex has no CPU backward
                if args.contenders and (
                    asked := [c for c in args.contenders.split(",") if c.startswith("flex")]
                ):
                    ap.error(f"{', '.join(asked)}: FlexAttention has no backward on the CPU (use --mode fwd)")
                cs = {name: attn for name, attn in cs.items() if not name.startswith("flex")}
            fns = {name: call(attn, q, k, v, args.mode) for name, attn in cs.items()}
            times: dict[str, list[float]] = {name: [] for name in cs}
            t_compile = {}
            for name, fn in list(fns.items()):  # first calls: compile, caches
                t0 = time.perf_counter()
                try:
                    fn()
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                except Exception as exc:  # one contender that cannot run must not cost the others
                    if name == "sdpa (dense)":
                        raise  # every ratio is to it
                    reason = " ".join(str(exc).split())[:300]
                    print(f"  {name:22s} left out at N={n}: {type(exc).__name__}: {reason}", flush=True)
                    del fns[name], cs[name], times[name]
                    continue
                t_compile[name] = time.perf_counter() - t0
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    if args.device == "cuda":
                        times[name].append(time_cuda(fn, min_run_time=args.min_run_time).median_s)
                    else:
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
            per_pair = 4 * d * (3.5 if args.mode == "fwd_bwd" else 1.0)  # DESIGN.md: bwd = 2.5x fwd
            med_dense = statistics.median(times["sdpa (dense)"])
            print(f"B={bsz} H={h} D={d} N={n}:")
            for name, attn in cs.items():
                med = statistics.median(times[name])
                useful = bsz * h * attn.num_pairs(n, n) * per_pair / med / 1e12
                visited = visited_pairs(attn, q, k)
                tiles = bsz * h * visited * per_pair / med / 1e12 if visited else None
                row = {
                    "name": name,
                    "impl_ran": attn.describe().get("impl_ran"),
                    "B": bsz,
                    "H": h,
                    "D": d,
                    "N": n,
                    "ms": med * 1e3,
                    "min_ms": min(times[name]) * 1e3,
                    "max_ms": max(times[name]) * 1e3,
                    "useful_tflops": useful,
                    "visited_tflops": tiles,
                    "visited_share": visited / (n * n) if visited else None,
                    "dense_over_this": med_dense / med,
                    "first_call_s": t_compile[name],
                }
                rows.append(row)
                extra = f", {tiles:.3g} TFLOP/s over visited tiles ({visited / n / n:.1%})" if tiles else ""
                lo, hi = min(times[name]) * 1e3, max(times[name]) * 1e3
                print(
                    f"  {name:30s} {med * 1e3:9.3f} ms [{lo:.3g}-{hi:.3g}]"
                    f"  {useful:8.3g} TFLOP/s useful{extra}; dense sdpa / this {med_dense / med:.2f}x",
                    flush=True,
                )
                if args.profile:
                    table, total, wall = kernel_table(fns[name], args.device)
                    print(
                        f"    profiled call: {wall:.3f} ms wall, {total:.3f} ms in the rows below", flush=True
                    )
                    print(format_table(table, total, args.profile, indent="      "), flush=True)
                    row["kernels"] = [vars(r) for r in table[: args.profile]]
            for a, b in (
                ("local_window", "flex window"),
                ("sparse", "flex sparse"),
                ("sparse", "sparse[global in mask]"),
                ("sparse[global dense]", "sparse[global in mask]"),
                ("sparse[tile 64]", "sparse[global in mask]"),
                ("sparse[tile 64 global dense]", "sparse[tile 64]"),
                ("xformers window", "local_window"),
            ):
                if a in times and b in times:
                    ratio = statistics.median(times[a]) / statistics.median(times[b])
                    print(f"  ratio {a} / {b}: {ratio:.2f}")
            if args.json:  # after every length: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(
                        {
                            "args": vars(args),
                            "device_name": where,
                            "cpu": cpu_model(),
                            "threads": args.threads,
                            "torch": torch.__version__,
                            "rows": rows,
                        },
                        f,
                        indent=1,
                    )


if __name__ == "__main__":
    main()
