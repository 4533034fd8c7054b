"""Measuring one job: the typed job spec, the kernel measurement (time, memory, accuracy) and task
training. Imports variants; nothing from sweep, records or report."""
