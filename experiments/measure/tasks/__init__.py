"""Task accuracy: train a small Transformer with each attention variant on synthetic tasks.

``data`` generates the tasks from a seed, ``model`` is the Transformer whose attention core is any
registered variant, ``train.measure_task`` is the measurer of a task job (:mod:`experiments.measure.kinds`).
The report side is :mod:`experiments.report.task_section`.
"""
