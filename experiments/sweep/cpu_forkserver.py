"""Preloaded by the fork server that starts CPU jobs: hides every GPU, then imports the suite once.

A process that has queried CUDA (even ``torch.cuda.is_available()``) poisons its forks: CUDA cannot
be initialised again in them ("Cannot re-initialize CUDA in forked subprocess"), and some of torch's
own code paths query the GPU whenever one is visible. So the fork server never sees one: with
``CUDA_VISIBLE_DEVICES`` empty before torch is imported, nothing it or a CPU job does can touch CUDA.
CUDA jobs are spawned instead (see :mod:`experiments.sweep.isolation`). The server ends without
tearing torch down (:mod:`experiments.sweep.fast_exit`).
"""

import os

from experiments.sweep.fast_exit import exit_last

exit_last()  # first, so that torch's own atexit handlers run before the exit that skips the teardown
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported, in this process only
os.environ["HIP_VISIBLE_DEVICES"] = ""  # the same for ROCm builds of torch

# torch._dynamo: imported by the profiler on its first use (the memory figure), which took 1.8-2.9 s of
# every job on this project's 2-core VM when each fork imported it again. The profiler itself is never
# run here: a fork of a process that has run it hangs in its first profile.
import torch._dynamo  # noqa: E402,F401

import experiments.measure.kernel  # noqa: E402,F401  torch and the variants, imported once for every fork
