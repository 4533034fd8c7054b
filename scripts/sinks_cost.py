"""What attention sinks (gpt-oss's per-head logits) cost sdpa: the call without sinks, with them as sdpa
takes them now (the sink key shaped for the fused kernel), and as every variant once took them (one more
key and feature, head sizes D+1 against Dv: PyTorch's math kernel), interleaved round by round in one
process; median ms [min-max], each form's peak memory (the allocator's bytes above those held) and its
useful GFLOP/s as a share of a 2048x2048 fp32 GEMM timed in the same run (the machine's ceiling).

    python scripts/sinks_cost.py [--lengths 1024 4096] [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse

import torch
from arg_types import positive_float, positive_int, threads
from torch.utils import benchmark

import variants
from experiments.measure.memory import cpu_peak_bytes
from experiments.measure.roofline import gemm_flops_per_s, gemm_n
from experiments.records.environment import cpu_model
from variants.sdpa import SDPAAttention


class _AsOneMoreKey(SDPAAttention):
    """sdpa handed the sinks as every variant once was: ``forward`` adds the sink key and feature."""

    def native_sinks(self, w: variants.Workload) -> bool:
        return False


def _call(attn: SDPAAttention, inputs: tuple, sinks: torch.Tensor | None, causal: bool, backward: bool):
    """One timed call: the forward, and the backward of its sum when ``backward``."""

    def run() -> None:
        with torch.set_grad_enabled(backward):
            out = attn(*inputs, causal=causal, sinks=sinks)
            if backward:
                out.sum().backward()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--lengths", type=positive_int, nargs="+", default=[1024, 4096], help="sequence lengths N"
    )
    ap.add_argument("--threads", type=threads, default=2, help="torch threads")
    ap.add_argument(
        "--rounds", type=positive_int, default=5, help="interleaved rounds; a cell is their median"
    )
    ap.add_argument("--min-run-time", type=positive_float, default=0.5, help="seconds per timed figure")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    forms = {
        "no sinks": SDPAAttention(),
        "sinks (now)": SDPAAttention(),
        "sinks (one more key)": _AsOneMoreKey(),
    }
    gemm = gemm_flops_per_s("cpu", torch.float32, gemm_n("cpu", torch.float32))
    print(f"{cpu_model()}, torch {torch.__version__}")
    print(f"sdpa, B=1 H=8 D=64 fp32, {args.threads} threads, {args.rounds} rounds: median ms [min-max], peak")
    print(f"GEMM ceiling (2048x2048 fp32, this run): {gemm / 1e9:.0f} GFLOP/s")
    for n in args.lengths:
        for causal in (True, False):
            for backward in (False, True):
                g = torch.Generator().manual_seed(0)
                inputs = tuple(
                    torch.randn(1, 8, n, 64, generator=g).requires_grad_(backward) for _ in range(3)
                )
                sinks = torch.randn(8, generator=g)
                calls = {
                    name: _call(attn, inputs, None if name == "no sinks" else sinks, causal, backward)
                    for name, attn in forms.items()
                }
                times: dict[str, list[float]] = {name: [] for name in calls}
                for _ in range(args.rounds):  # interleaved: a slow moment hits every form alike
                    for name, run in calls.items():
                        timer = benchmark.Timer("run()", globals={"run": run}, num_threads=args.threads)
                        times[name].append(
                            timer.blocked_autorange(min_run_time=args.min_run_time).median * 1e3
                        )
                peak = {name: cpu_peak_bytes(run) / 2**20 for name, run in calls.items()}
                med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
                # useful FLOPs: 4 N^2 D per head forward (QK^T and PV), half of it causal; backward 2.5x
                flops = 4 * n * n * 64 * 8 * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
                share = {name: flops / (m / 1e3) / gemm for name, m in med.items()}
                cells = "; ".join(
                    f"{name} {med[name]:.1f} [{min(t):.1f}-{max(t):.1f}] {peak[name]:.0f} MiB "
                    f"{share[name]:.0%} of GEMM"
                    + (
                        f" ({med[name] / med['no sinks']:.2f}x, {attn.backend_ran})"
                        if name != "no sinks"
                        else ""
                    )
                    for (name, t), attn in zip(times.items(), forms.values(), strict=True)
                )
                print(
                    f"N={n} {'causal' if causal else 'full'} {'fwd+bwd' if backward else 'fwd'}: {cells}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
