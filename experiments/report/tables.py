"""The names tests import from ``experiments.report.tables``, the module the report's tables lived in
before they were split by job kind (tests/test_compare.py, test_decode_jobs.py, test_rounds.py,
test_runner.py). New code imports from the modules themselves: :mod:`.kernel_tables`,
:mod:`.grouping`, :mod:`.format`, :mod:`.compare`, :mod:`.model_section`, and
:func:`experiments.records.store.select`."""

from __future__ import annotations

from ..records.store import select
from .compare import baseline_table
from .format import Section, num
from .grouping import group_keys, length_axis
from .kernel_tables import LEGEND, bandwidth_table, speed_table
from .model_section import model_table

__all__ = [
    "LEGEND",
    "Section",
    "bandwidth_table",
    "baseline_table",
    "group_keys",
    "length_axis",
    "model_table",
    "num",
    "select",
    "speed_table",
]
