"""Preloaded by the fork server that starts CPU jobs: hides every GPU, then imports the suite once.

A process that has queried CUDA (even ``torch.cuda.is_available()``) poisons its forks: CUDA cannot
be initialised again in them ("Cannot re-initialize CUDA in forked subprocess"), and some of torch's
own code paths query the GPU whenever one is visible. So the fork server never sees one: with
``CUDA_VISIBLE_DEVICES`` empty before torch is imported, nothing it or a CPU job does can touch CUDA.
CUDA jobs are spawned instead (see :mod:`experiments.sweep.isolation`).
"""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported, in this process only
os.environ["HIP_VISIBLE_DEVICES"] = ""  # the same for ROCm builds of torch

import experiments.measure.kernel  # noqa: E402,F401  torch and the variants, imported once for every fork
