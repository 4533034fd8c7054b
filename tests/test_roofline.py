"""The machine's ceilings: a GEMM of fixed size, and the rule that a ceiling below the sweep's own
kernels is measured again."""

from __future__ import annotations

import pytest
import torch

from experiments.measure import roofline
from experiments.measure.timing import Timing


def test_the_gemm_size_is_fixed_whatever_the_machine_is_doing(monkeypatch):
    # a machine so slow that every call takes a second: the size does not shrink with it
    seen = []

    def slow_call(fn, device, min_run_time):
        seen.append(fn)
        return Timing(median_s=1.0, q1_s=1.0, q3_s=1.0, reps=1)

    monkeypatch.setattr(roofline, "time_call", slow_call)
    monkeypatch.setattr(roofline, "_COPY_MIB", {"cpu": 1})
    roof = roofline.measure_roofline("cpu", "float32")
    assert roof["gemm_n"] == 2048
    assert roof["gemm_flops_per_s"] == pytest.approx(2 * 2048**3)  # 2 n^3 FLOPs in the 1 s it took
    assert roof["copy_bytes_per_s"] == pytest.approx(2 * 2**20)  # 1 MiB read and written in 1 s
    assert roof["read_bytes_per_s"] == pytest.approx(2**20)  # 1 MiB read in 1 s
    assert len(seen) == 4  # the GEMM, the copy, the two reads
    assert roofline.gemm_n("cpu", torch.bfloat16) == roofline.gemm_n("cpu", torch.float16) == 512
    assert roofline.gemm_n("cpu", torch.float64) == 2048 and roofline.gemm_n("cuda", torch.bfloat16) == 8192


def test_the_read_ceiling_is_the_faster_of_a_sum_and_a_matrix_vector_product(monkeypatch):
    """A sum alone read 18 GB/s on the project's VM where a decode read 22: the ceiling is the faster
    of the two reads, and the record says which."""
    for fast in ("sum", "gemv"):

        def timed(fn, device, min_run_time, fast=fast):
            out = fn()  # which read it is: a scalar from the sum, a vector from the product
            is_sum = out.dim() == 0
            secs = 0.5 if is_sum == (fast == "sum") else 1.0
            return Timing(median_s=secs, q1_s=secs, q3_s=secs, reps=1)

        monkeypatch.setattr(roofline, "time_call", timed)
        assert roofline.read_bytes_per_s("cpu", 1) == (pytest.approx(2 * 2**20), fast)


@pytest.mark.parametrize(
    "rates,want",
    [
        # fp16 without half-precision units (2.6 GFLOP/s): float32's GEMM is the ceiling
        ({(torch.float16, 512): 2.6e9, (torch.float32, 2048): 90e9}, (90e9, 2048, "float32")),
        # bf16 with bf16 dot products: fast enough at 512 to be measured at 2048, where it is fastest
        (
            {(torch.bfloat16, 512): 34e9, (torch.bfloat16, 2048): 363e9, (torch.float32, 2048): 90e9},
            (363e9, 2048, "bfloat16"),
        ),
    ],
    ids=["fp16_slow", "bf16_fast"],
)
def test_a_cpu_half_precision_ceiling_is_the_fastest_gemm_its_kernels_could_use(monkeypatch, rates, want):
    """CPU kernels compute half-precision inputs in float32: an fp16 GEMM at 2.6 GFLOP/s put every fp16
    job at 10-25x "the ceiling", and each job measured it again."""
    calls = []

    def fake(device, dtype, n, min_run_time=0.5):
        calls.append((dtype, n))
        return rates[(dtype, n)]

    monkeypatch.setattr(roofline, "gemm_flops_per_s", fake)
    half = want[2] if want[2] != "float32" else "float16"
    assert roofline.cpu_half_gemm(getattr(torch, half)) == want
    assert set(calls) == set(rates)  # a slow half GEMM is not run at 2048 (6.6 s a call at 2.6 GFLOP/s)


def test_a_ceiling_below_the_jobs_own_rate_is_implausible():
    roof = {"gemm_flops_per_s": 50e9, "threads": 1}
    assert roofline.implausible(60.0, roof, threads=1)  # 60 GFLOP/s of attention above a 50 GFLOP/s GEMM
    assert not roofline.implausible(40.0, roof, threads=1)
    assert not roofline.implausible(60.0, roof, threads=2)  # another thread count: not comparable
    assert not roofline.implausible(None, roof, threads=1) and not roofline.implausible(60.0, None, 1)


def test_the_report_names_each_ceiling_and_which_read_was_the_faster():
    import pandas as pd

    from experiments.report.report import _ceilings

    row = {
        "env_host": "h",
        "roofline_device": "cpu",
        "roofline_dtype": "float32",
        "roofline_gemm_n": 2048,
        "roofline_gemm_flops_per_s": 90e9,
        "roofline_copy_bytes_per_s": 20e9,
        "roofline_read_bytes_per_s": 22e9,
    }
    older = _ceilings(pd.DataFrame([row]))  # records from before read_op
    assert older == ["- h cpu float32: GEMM 90 GFLOP/s (n=2048), copy 20 GB/s, read 22 GB/s"]
    assert _ceilings(pd.DataFrame([{**row, "roofline_read_op": "gemv"}])) == [older[0] + " (gemv)"]


def test_the_report_gives_each_thread_count_its_own_ceilings():
    """A 1-thread and a 2-thread sweep in one store: one line each, as the canaries have (the GEMM rate
    was one median with "sweeps ranged 107-203" over both)."""
    import pandas as pd

    from experiments.report.report import _ceilings

    row = {
        "env_host": "h",
        "roofline_device": "cpu",
        "roofline_dtype": "float32",
        "roofline_gemm_n": 2048,
        "roofline_copy_bytes_per_s": 20e9,
    }
    df = pd.DataFrame(
        [
            {**row, "roofline_threads": 1, "roofline_gemm_flops_per_s": 107e9},
            {**row, "roofline_threads": 1, "roofline_gemm_flops_per_s": 111e9},
            {**row, "roofline_threads": 2, "roofline_gemm_flops_per_s": 203e9},
        ]
    )
    assert _ceilings(df) == [
        "- h cpu float32, 1 thread(s): GEMM 109 GFLOP/s (n=2048) (sweeps ranged 107-111), copy 20 GB/s",
        "- h cpu float32, 2 thread(s): GEMM 203 GFLOP/s (n=2048), copy 20 GB/s",
    ]
    # a GPU's ceilings do not depend on the host's threads: not named
    gpu = df.assign(roofline_device="cuda")
    assert _ceilings(gpu) == [
        "- h cuda float32: GEMM 111 GFLOP/s (n=2048) (sweeps ranged 107-203: 1.90x apart, in different "
        "machine states), copy 20 GB/s"
    ]


def test_a_gpu_s_ceilings_read_in_tera():
    """An H100's bf16 GEMM at 682-683 TFLOP/s and its copy at 3 TB/s read as such, the range in the
    median's unit (they printed as "6.82e+05 GFLOP/s" and "3.02e+03 GB/s")."""
    import pandas as pd

    from experiments.report.report import _ceilings

    row = {
        "env_host": "h",
        "roofline_device": "cuda",
        "roofline_dtype": "bfloat16",
        "roofline_gemm_n": 8192,
        "roofline_copy_bytes_per_s": 3.02e12,
        "roofline_read_bytes_per_s": 3.06e12,
    }
    df = pd.DataFrame([{**row, "roofline_gemm_flops_per_s": r} for r in (682e12, 683e12)])
    assert _ceilings(df) == [
        "- h cuda bfloat16: GEMM 682 TFLOP/s (n=8192) (sweeps ranged 682-683), copy 3.02 TB/s, read 3.06 TB/s"
    ]


def test_the_report_gives_the_range_of_the_copy_as_of_the_gemm():
    """Two sweeps of one store on a day apart: the copy moved 37.6 -> 18.6 GB/s while the GEMM moved
    16%; the report gave the GEMM's range only, and wrote its size as ``n=1024.0`` where a record
    without ceilings made the column float."""
    import pandas as pd

    from experiments.report.report import _ceilings

    row = {"env_host": "h", "roofline_device": "cpu", "roofline_dtype": "float32", "roofline_threads": 1}
    df = pd.DataFrame(
        [
            {
                **row,
                "roofline_gemm_n": 1024,
                "roofline_gemm_flops_per_s": 110e9,
                "roofline_copy_bytes_per_s": 37.6e9,
            },
            {
                **row,
                "roofline_gemm_n": 1024,
                "roofline_gemm_flops_per_s": 92.5e9,
                "roofline_copy_bytes_per_s": 18.6e9,
            },
            {"env_host": "h", "roofline_gemm_n": None},  # a record without ceilings
        ]
    )
    assert _ceilings(df) == [
        "- h cpu float32, 1 thread(s): GEMM 101 GFLOP/s (n=1024) (sweeps ranged 92.5-110: 1.19x apart, in "
        "different machine states), copy 28.1 GB/s (sweeps ranged 18.6-37.6: 2.02x apart, in different "
        "machine states)"
    ]
    # within the canary's 1.15x: a range, not a different state
    df.loc[1, ["roofline_gemm_flops_per_s", "roofline_copy_bytes_per_s"]] = [100e9, 34e9]
    assert _ceilings(df) == [
        "- h cpu float32, 1 thread(s): GEMM 105 GFLOP/s (n=1024) (sweeps ranged 100-110), "
        "copy 35.8 GB/s (sweeps ranged 34-37.6)"
    ]
