"""Task accuracy: train a small Transformer with each attention variant on synthetic tasks.

``data`` generates the tasks from a seed, ``model`` is the Transformer whose attention core is any
registered variant, ``train.measure_task`` is the job :func:`experiments.measure.kernel.measure` runs
for a spec with ``task`` set. The report side is :mod:`experiments.report.task_report`.
"""
