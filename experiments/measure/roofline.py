"""The machine's own ceilings, measured in the same run as the variants: a large matrix multiply's
FLOP/s and a large copy's bandwidth, for one device and dtype.

Attention's useful FLOP/s divided by the same run's GEMM FLOP/s says how close a variant comes to
what the hardware does on the friendliest dense workload, on this machine, under this load; a
vendor's datasheet peak says neither. Measured once per sweep and (device, dtype), in the first job's
child process, and copied into every record of that sweep (``record["roofline"]``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .inputs import DTYPES
from .timing import time_call

# the largest square GEMM tried: CUDA bf16 at 8192 is 1.1 TFLOP, about 1.5 ms on an H100
_GEMM_N = {"cpu": 2048, "cuda": 8192}
# a GEMM size is large enough once one call takes this long (half precision on a CPU without
# matrix units runs at about 1 GFLOP/s, so it stops at a few hundred, fp32 at 1024-2048)
_GEMM_CALL_S = 0.02
# bytes copied (read once, written once): beyond every CPU's last-level cache and a GPU's L2
_COPY_MIB = {"cpu": 512, "cuda": 2048}


def gemm_size(device: str, dtype: torch.dtype, cap: int) -> int:
    """The smallest power of two from 256 up to ``cap`` whose GEMM call takes ``_GEMM_CALL_S``."""
    n = 256
    while n < cap:
        a = torch.ones(n, n, device=device, dtype=dtype)
        torch.mm(a, a)  # first call: library setup, not counted
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, a)
        if device == "cuda":
            torch.cuda.synchronize()
        if time.perf_counter() - t0 >= _GEMM_CALL_S:
            break
        n *= 2
    return n


def gemm_operands(
    n: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``a, b, out``: two seeded random ``(n, n)`` matrices and an output buffer for ``torch.mm``."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    return a, b, torch.empty(n, n, device=device, dtype=dtype)


def gemm_flops_per_s(device: str, dtype: torch.dtype, n: int, min_run_time: float = 0.5) -> float:
    """FLOP/s of ``(n, n) @ (n, n)`` in ``dtype`` on ``device`` (``2 n^3`` FLOPs per call)."""
    a, b, out = gemm_operands(n, device, dtype)
    t = time_call(lambda: torch.mm(a, b, out=out), device, min_run_time)
    return 2 * n**3 / t.median_s


def copy_bytes_per_s(device: str, mib: int, min_run_time: float = 0.5) -> float:
    """Bytes per second moved by ``dst.copy_(src)`` of ``mib`` MiB (counted as read + write)."""
    src = torch.ones(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_call(lambda: dst.copy_(src), device, min_run_time)
    return 2 * src.numel() / t.median_s


def measure_roofline(device: str, dtype: str, min_run_time: float = 0.5) -> dict[str, Any]:
    """``{"device", "dtype", "gemm_n", "gemm_flops_per_s", "copy_mib", "copy_bytes_per_s", "threads"}``
    for ``device`` and ``dtype`` (a name from :data:`experiments.measure.inputs.DTYPES`)."""
    n, mib = gemm_size(device, DTYPES[dtype], _GEMM_N[device]), _COPY_MIB[device]
    return {
        "device": device,
        "dtype": dtype,
        "gemm_n": n,
        "gemm_flops_per_s": gemm_flops_per_s(device, DTYPES[dtype], n, min_run_time),
        "copy_mib": mib,
        "copy_bytes_per_s": copy_bytes_per_s(device, mib, min_run_time),
        "threads": torch.get_num_threads(),
    }
