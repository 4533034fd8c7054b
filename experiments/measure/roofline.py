"""The machine's own ceilings, measured in the same run as the variants: a large matrix multiply's
FLOP/s, a large copy's bandwidth and a large read's (a sum or a matrix-vector product, the faster),
for one device and dtype.

A decode reads its cache and writes almost nothing, so the read bandwidth is its true ceiling; the
copy (read + write) is the conventional one.

Attention's useful FLOP/s divided by the same run's GEMM FLOP/s says how close a variant comes to
what the hardware does on the friendliest dense workload, on this machine, under this load; a
vendor's datasheet peak says neither. Measured once per sweep and (device, dtype), in the first job's
child process, and copied into every record of that sweep (``record["roofline"]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .inputs import DTYPES
from .timing import time_call

#: the square GEMM of the ceiling, fixed per device and dtype. A size chosen by timing one call picked
#: 256 on a loaded machine and recorded 1.06 GFLOP/s, so that sdpa showed 809% of the "GEMM rate".
#: CPU: 2048 in fp32/fp64 (17 GFLOP, about 0.2 s on one core of the project's VM), 512 in half
#: precision (a CPU without matrix units runs it at about 1 GFLOP/s); CUDA: 8192 (1.1 TFLOP in bf16,
#: about 1.5 ms on an H100)
_GEMM_N = {"cpu": 2048, "cpu_half": 512, "cuda": 8192}
# bytes copied (read once, written once): beyond every CPU's last-level cache and a GPU's L2
_COPY_MIB = {"cpu": 512, "cuda": 2048}


def gemm_n(device: str, dtype: torch.dtype) -> int:
    """The side of the ceiling's square GEMM on ``device`` in ``dtype`` (:data:`_GEMM_N`)."""
    if device == "cpu" and dtype.itemsize == 2:
        return _GEMM_N["cpu_half"]
    return _GEMM_N["cuda" if device == "cuda" else "cpu"]


def implausible(gflops_per_s: float | None, roofline: dict[str, Any] | None, threads: int | None) -> bool:
    """Whether a job's useful GFLOP/s exceeds the GEMM rate of the ceiling it was given, measured with
    the same thread count: a ceiling below what the sweep's own kernels reach was measured in a slow
    moment, and the sweep measures it again."""
    if not roofline or gflops_per_s is None or roofline.get("threads") != threads:
        return False
    return gflops_per_s * 1e9 > roofline.get("gemm_flops_per_s", float("inf"))


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


#: columns of the read ceiling's matrix-vector product: rows of 32 KiB, each read once
_GEMV_COLS = 2**13


def read_bytes_per_s(device: str, mib: int, min_run_time: float = 0.5) -> tuple[float, str]:
    """``(bytes per second, op)``: the faster of two reads of ``mib`` MiB of float32, each one pass
    with next to nothing written: ``sum`` (``src.sum()``) and ``gemv`` (the same bytes as a ``(rows,
    8192)`` matrix times a vector, a decode's own access pattern). Neither alone is the ceiling: on the
    project's VM the sum read 17.7-18.5 GB/s and the product 21.6-22.5, 1 or 2 threads, and a decode
    22 GB/s."""
    src = torch.ones(mib * 2**18, dtype=torch.float32, device=device)  # mib MiB of 4-byte floats
    mat = src.view(-1, _GEMV_COLS)  # (mib * 32, 8192)
    vec = torch.ones(_GEMV_COLS, dtype=torch.float32, device=device)
    rates = {
        op: src.numel() * 4 / time_call(fn, device, min_run_time).median_s
        for op, fn in (("sum", src.sum), ("gemv", lambda: mat @ vec))
    }
    op = max(rates, key=rates.get)
    return rates[op], op


def last_level_cache_bytes(cpu: int = 0) -> int | None:
    """The size of the largest cache CPU ``cpu`` sees (its last level, shared), from Linux's
    ``/sys/devices/system/cpu/cpu<cpu>/cache``; None where that is not there. Bytes that fit in it are
    read from the cache when a call repeats, not from memory."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    sizes = []
    for index in Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()  # e.g. "32768K"
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes) if sizes else None


def cpu_half_gemm(dtype: torch.dtype, min_run_time: float = 0.5) -> tuple[float, int, str]:
    """The CPU ceiling for half-precision inputs, ``(FLOP/s, n, the GEMM's dtype)``: the fastest of
    the dtype's GEMM at 512, at 2048 where the 512 rate says a call takes at most a second (bf16 on a
    core with bf16 dot products: 34 GFLOP/s at 512, 363 at 2048 on the project's Zen 5 VM, 2 threads),
    and float32's at 2048. CPU attention kernels compute half-precision inputs in float32 (ATen's
    flash kernel does), so a GEMM without half-precision units (fp16 there: 2.6 GFLOP/s) is no ceiling
    for them: every fp16 job ran at 10-25x it, and each measured the ceiling again."""
    half = _GEMM_N["cpu_half"]
    best = (gemm_flops_per_s("cpu", dtype, half, min_run_time), half, str(dtype).removeprefix("torch."))
    big = _GEMM_N["cpu"]
    if 2 * big**3 / best[0] <= 1.0:
        best = max(best, (gemm_flops_per_s("cpu", dtype, big, min_run_time), big, best[2]))
    return max(best, (gemm_flops_per_s("cpu", torch.float32, big, min_run_time), big, "float32"))


def measure_roofline(device: str, dtype: str, min_run_time: float = 0.5) -> dict[str, Any]:
    """``{"device", "dtype", "gemm_n", "gemm_dtype", "gemm_flops_per_s", "copy_mib", "copy_bytes_per_s",
    "read_bytes_per_s", "read_op", "threads"}`` for ``device`` and ``dtype`` (a name from
    :data:`experiments.measure.inputs.DTYPES`); the GEMM is in ``dtype`` but on a CPU in half precision
    (:func:`cpu_half_gemm`)."""
    n, mib = gemm_n(device, DTYPES[dtype]), _COPY_MIB[device]
    if device == "cpu" and DTYPES[dtype].itemsize == 2:
        flops, n, gemm_dtype = cpu_half_gemm(DTYPES[dtype], min_run_time)
    else:
        flops, gemm_dtype = gemm_flops_per_s(device, DTYPES[dtype], n, min_run_time), dtype
    read, read_op = read_bytes_per_s(device, mib, min_run_time)
    return {
        "device": device,
        "dtype": dtype,
        "gemm_n": n,
        "gemm_dtype": gemm_dtype,
        "gemm_flops_per_s": flops,
        "copy_mib": mib,
        "copy_bytes_per_s": copy_bytes_per_s(device, mib, min_run_time),
        "read_bytes_per_s": read,
        "read_op": read_op,
        "threads": torch.get_num_threads(),
    }
