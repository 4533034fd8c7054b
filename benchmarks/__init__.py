"""Regression benchmarks (pytest-benchmark) and their gates; run with ``python -m pytest benchmarks``."""
