"""Does the harness time what torch.utils.benchmark times? (issue: sdpa at N=1024 within 10%).

Runs, in one process and interleaved, (a) a full harness job (``experiments.measure.kernel.measure``
with isolation off, which times through the variant wrapper) and (b) ``torch.utils.benchmark.Timer``
directly on ``F.scaled_dot_product_attention``; prints both medians and their ratio per round.

    python scripts/timer_agreement.py [--n 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tbench

from experiments.measure.kernel import measure
from experiments.measure.spec import JobSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-run-time", type=float, default=1.0)
    args = ap.parse_args()
    spec = JobSpec(
        variant={"_target_": "variants.sdpa.SDPAAttention", "backend": "auto"},
        seq_len=args.n,
        min_run_time=args.min_run_time,
        accuracy_rows=64,
    )
    q, k, v = (torch.randn(1, 8, args.n, 64) for _ in range(3))
    timer = tbench.Timer(
        stmt="F.scaled_dot_product_attention(q, k, v)",
        globals={"F": F, "q": q, "k": k, "v": v},
        num_threads=torch.get_num_threads(),
    )
    ratios = []
    print(f"sdpa N={args.n}, B=1 H=8 D=64 fp32, {torch.get_num_threads()} threads")
    for r in range(args.rounds):
        res = measure(spec)
        harness = res["figures"]["fwd_median_s"]
        with torch.no_grad():
            direct = timer.blocked_autorange(min_run_time=args.min_run_time).median
        ratios.append(harness / direct)
        print(
            f"round {r}: harness {harness * 1e3:.3f} ms, Timer {direct * 1e3:.3f} ms, ratio {ratios[-1]:.3f}"
        )
    print(
        f"median ratio {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}); goal: within 10% (0.90-1.10)"
    )


if __name__ == "__main__":
    main()
