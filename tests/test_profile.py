"""experiments.measure.profile: the kernel table of one call, against what the call is known to do
(three matrix products and a sleep outside every operator)."""

from __future__ import annotations

import time

import torch

from experiments.measure.profile import OUTSIDE, format_table, kernel_table


def test_the_table_counts_each_operator_and_the_time_outside_them():
    a = torch.randn(64, 64)
    calls = []

    def fn() -> None:
        calls.append(1)
        for _ in range(3):
            a @ a
        time.sleep(0.05)  # Python's own time: no operator

    table, total, wall = kernel_table(fn, "cpu")
    assert len(calls) == 2  # one call to warm up, one profiled
    by_name = {r.name: r for r in table}
    assert by_name["aten::mm"].calls == 3
    assert by_name[OUTSIDE].ms >= 50 and table[0].name == OUTSIDE  # the sleep is the longest row
    assert [r.ms for r in table] == sorted((r.ms for r in table), reverse=True)
    assert abs(sum(r.share for r in table) - 1) < 1e-9 and abs(total - wall) < 1e-6
    text = format_table(table, total, top=2)
    assert text.splitlines()[0].endswith(OUTSIDE) and "more)" in text.splitlines()[-1]
