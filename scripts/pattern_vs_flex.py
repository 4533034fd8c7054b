"""Pattern variants against compiled FlexAttention with the same pattern and against dense SDPA.

Forward on the CPU (flex has no CPU backward), interleaved round by round in one process, median and
min-max of the rounds per call; prints one row per length with the ratios issue 12 asks about.

    python scripts/pattern_vs_flex.py --lengths 1024 2048 4096 8192 16384 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--block", type=int, default=64, help="sparse block (flex sparse uses the same)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"B=1 H=8 D=64 fp32, fwd, {args.threads} threads, window {args.window}, sparse block {args.block}")
    contenders = {
        "local_window": variants.build("local_window", window=args.window),
        "local_window[blocked]": variants.build("local_window", window=args.window, impl="blocked"),
        "flex window": variants.build("flex", pattern="window", window=args.window, block=128),
        "sparse": variants.build("sparse", block=args.block),
        "flex sparse": variants.build("flex", pattern="sparse", block=args.block),
        "sdpa (dense)": variants.build("sdpa"),
    }
    for n in args.lengths:
        torch._dynamo.reset()  # one compiled kernel per length, never dynamo's eager fallback after 8
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, n, 64, generator=g) for _ in range(3))
        times: dict[str, list[float]] = {name: [] for name in contenders}
        with torch.no_grad():
            for attn in contenders.values():  # first calls: compile, caches
                attn(q, k, v)
            for _ in range(args.rounds):
                for name, attn in contenders.items():
                    t0 = time.perf_counter()
                    attn(q, k, v)
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        cells = ", ".join(
            f"{name} {med[name]:.3g} ms [{min(t) * 1e3:.3g}-{max(t) * 1e3:.3g}]" for name, t in times.items()
        )
        print(f"N={n}: {cells}")
        print(
            f"  ratios: local_window/flex {med['local_window'] / med['flex window']:.2f}, "
            f"local_window/sdpa {med['local_window'] / med['sdpa (dense)']:.2f}, "
            f"local_window/blocked {med['local_window'] / med['local_window[blocked]']:.2f}, "
            f"sparse/flex {med['sparse'] / med['flex sparse']:.2f}, "
            f"sparse/sdpa {med['sparse'] / med['sdpa (dense)']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
