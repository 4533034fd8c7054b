"""Deliberately broken variants for the runner's crash-isolation tests (never registered)."""

import os
import signal
import time

import torch

from variants.naive import NaiveAttention


class HangingAttention(NaiveAttention):
    """Never returns: the job must end as 'timeout'."""

    def _attend(self, q, k, v, **kw):
        time.sleep(3600)


class SelfKillingAttention(NaiveAttention):
    """Dies as the OOM killer would make it die: the job must end as 'killed'."""

    def _attend(self, q, k, v, **kw):
        os.kill(os.getpid(), signal.SIGKILL)


class NaNAttention(NaiveAttention):
    """Returns NaN: the job must end as 'nan'."""

    def _attend(self, q, k, v, **kw):
        return torch.full_like(super()._attend(q, k, v, **kw), float("nan"))


class WrongAttention(NaiveAttention):
    """Fast but wrong (drops the last key): figures must be marked invalid."""

    def _attend(self, q, k, v, **kw):
        return super()._attend(
            q, k[:, :, :-1], v[:, :, :-1], causal=False, key_padding_mask=None, attn_mask=None
        )


class CrashingAttention(NaiveAttention):
    """Raises an ordinary exception: the job must end as 'error' with the message."""

    def _attend(self, q, k, v, **kw):
        raise ZeroDivisionError("deliberate failure for the test")


class NeedsHiddenGpuAttention(NaiveAttention):
    """Fails unless every GPU is hidden from its process (as the CPU fork server arranges)."""

    def _attend(self, q, k, v, **kw):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible != "":
            raise RuntimeError(f"a GPU is visible: CUDA_VISIBLE_DEVICES={visible!r}")
        return super()._attend(q, k, v, **kw)


class ShakyOnceAttention(NaiveAttention):
    """Slower with every call in the first process that calls it (0.3 ms more each time: the
    repetitions spread as widely as they go on, so no figure can be stable), a steady 1 ms in later
    ones (a sleep: steadier on a busy 2-core CI machine than the microseconds of the attention
    itself): a job with ``retry_unstable=1`` must come out stable. The first caller writes its pid
    to a marker file, ``$ATTNBENCH_SHAKY_MARKER``; a later one writes its own to that path +
    ``.later``, so a test can tell a fresh process measured without timing anything."""

    calls = 0

    def _attend(self, q, k, v, **kw):
        marker = os.environ["ATTNBENCH_SHAKY_MARKER"]
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
        with open(marker) as f:
            if f.read() == str(os.getpid()):
                ShakyOnceAttention.calls += 1
                time.sleep(0.0003 * ShakyOnceAttention.calls)
            else:
                with open(marker + ".later", "w") as later:
                    later.write(str(os.getpid()))
                time.sleep(0.001)
        return super()._attend(q, k, v, **kw)
