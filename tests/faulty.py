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
