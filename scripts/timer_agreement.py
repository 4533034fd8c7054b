"""Does the harness time what torch.utils.benchmark times? (issue: sdpa at N=1024 within 10%).

Runs, in one process and interleaved, (a) a full harness job (``experiments.measure.kernel.measure``
with isolation off, which times through the variant wrapper) and (b) ``torch.utils.benchmark.Timer``
directly on ``F.scaled_dot_product_attention``, both on ``--threads`` torch threads; prints both
medians and their ratio per round.

    python scripts/timer_agreement.py [--n 1024] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tbench
from arg_types import positive_float, positive_int, threads

from experiments.measure.kernel import measure
from experiments.measure.spec import JobSpec
from experiments.records.environment import cpu_model


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--n", type=positive_int, default=1024, help="sequence length N")
    ap.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds, one ratio each")
    ap.add_argument(
        "--min-run-time", type=positive_float, default=1.0, help="seconds per timing, on both sides"
    )
    ap.add_argument(
        "--threads", type=threads, default=torch.get_num_threads(), help="torch threads of both sides"
    )
    args = ap.parse_args()
    # the same threads on both sides: a spec without them runs the harness on every CPU (its affinity)
    torch.set_num_threads(args.threads)
    spec = JobSpec(
        variant={"_target_": "variants.sdpa.SDPAAttention", "backend": "auto"},
        seq_len=args.n,
        threads=args.threads,
        min_run_time=args.min_run_time,
        accuracy_rows=64,
    )
    q, k, v = (torch.randn(1, 8, args.n, 64) for _ in range(3))
    timer = tbench.Timer(
        stmt="F.scaled_dot_product_attention(q, k, v)",
        globals={"F": F, "q": q, "k": k, "v": v},
        num_threads=args.threads,
    )
    ratios = []
    print(f"{cpu_model()}, torch {torch.__version__}")
    print(f"sdpa N={args.n}, B=1 H=8 D=64 fp32, {args.threads} threads on both sides")
    for r in range(args.rounds):
        res = measure(spec)
        if res["status"] != "ok":  # measure never raises: its figures are then missing
            raise SystemExit(f"error: the harness job did not measure: {res['status']}: {res['reason']}")
        harness = res["figures"]["fwd_median_s"]
        with torch.no_grad():
            direct = timer.blocked_autorange(min_run_time=args.min_run_time).median
        ratios.append(harness / direct)
        print(
            f"round {r}: harness {harness * 1e3:.3f} ms, Timer {direct * 1e3:.3f} ms, ratio {ratios[-1]:.3f}"
        )
    median = statistics.median(ratios)
    verdict = "PASS" if 0.9 <= median <= 1.1 else "FAIL"
    print(
        f"median ratio {median:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); goal: within 10% "
        f"(0.90-1.10): {verdict}"
    )
    if verdict == "FAIL":  # a check: its exit status says whether the goal held
        raise SystemExit(1)


if __name__ == "__main__":
    main()
