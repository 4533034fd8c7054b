"""Does the installed xFormers run on this GPU once its CUDA gate is lifted? (issue 37's H200 check)

xFormers refuses every CUDA operator when its compiled extension did not load (it reads the build's
CUDA version from it). This lifts the gate as the variant's ``lift_gate=true`` does, runs auto, cutlass
and flash (B=1, N=4096, H=8, D=64, causal, fwd+bwd) against a float64 SDPA, then split-K decoding
(GQA 8:1, D=128, 64k keys). The host-timer figures are indicative only; sweeps time properly.
Needs a CUDA GPU and xformers (``pip install -e .[xformers]``); it takes no options.

    python scripts/xformers_gate_check.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from variants.base import Unavailable
from variants.xformers_attn import lift_cuda_gate, load_xformers, quiet_xformers


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.rsplit("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.parse_args()
    # the checks below would fail at their first CUDA tensor with torch's AssertionError
    if not torch.cuda.is_available():
        ap.error("no CUDA GPU here (torch.cuda.is_available() is False): this check needs one")
    try:
        xops = load_xformers()
    except Unavailable as exc:
        ap.error(str(exc))
    print("gate _built_with_cuda =", xops.fmha.common._built_with_cuda)
    lift_cuda_gate(xops)
    causal = xops.LowerTriangularMask()
    families = {"auto": None, "cutlass": xops.fmha.cutlass, "flash": xops.fmha.flash}
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for name, fam in families.items():
            ops = None if fam is None else (fam.FwOp, fam.BwOp)
            q, k, v = (
                torch.randn(1, 4096, 8, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3)
            )
            try:
                with quiet_xformers():
                    out = xops.memory_efficient_attention(q, k, v, attn_bias=causal, op=ops)  # (B, N, H, D)
                    q64, k64, v64 = (t.detach().double().transpose(1, 2) for t in (q, k, v))  # (B, H, N, D)
                    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True).transpose(1, 2)
                    out.float().pow(2).sum().backward()
                    finite = all(torch.isfinite(t.grad).all().item() for t in (q, k, v))
                    times = []
                    for _ in range(20):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        xops.memory_efficient_attention(q, k, v, attn_bias=causal, op=ops)
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                print(
                    f"{str(dtype):15s} {name:8s} ran; rel err vs float64 {rel(out, ref):.2e}; grads finite "
                    f"{finite}; fwd median {sorted(times)[10] * 1e3:.3f} ms (host timer)"
                )
            except Exception as exc:
                why = " ".join(str(exc).split())[:300]
                print(f"{str(dtype):15s} {name:8s} refused: {type(exc).__name__}: {why}")
    # split-K decoding: one query, 32 heads on 4 K/V heads (xFormers' grouped 5-D layout), 64k keys
    q = torch.randn(1, 1, 4, 8, 128, device="cuda", dtype=torch.bfloat16)  # (B, 1, G, H/G, D)
    k = torch.randn(1, 65536, 4, 1, 128, device="cuda", dtype=torch.bfloat16).expand(1, 65536, 4, 8, 128)
    try:
        with quiet_xformers():
            out = xops.memory_efficient_attention_forward(q, k, k, op=xops.fmha.triton_splitk.FwOp)
        q64, k64 = (t.flatten(2, 3).transpose(1, 2).double() for t in (q, k))  # (B, H, N, D)
        ref = F.scaled_dot_product_attention(q64, k64, k64).transpose(1, 2)  # (B, 1, H, D)
        print("triton_splitk decode ran; rel err", rel(out.flatten(2, 3), ref))
    except Exception as exc:
        print("triton_splitk refused:", type(exc).__name__, " ".join(str(exc).split())[:300])


if __name__ == "__main__":
    main()
