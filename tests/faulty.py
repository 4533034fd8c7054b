"""Deliberately broken variants for the runner's crash-isolation tests (never registered)."""

import os
import signal
import time

import torch

from variants.linear import LinearAttention
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


class LateRowsLostAttention(NaiveAttention):
    """Right on the first eighth of the queries, zero on the rest (a split-K merge that drops every
    block after the first, say): causal, the late rows are 10-100x smaller than the first, so the
    error over the whole output's scale stays small; figures must still be marked invalid."""

    def _attend(self, q, k, v, **kw):
        out = super()._attend(q, k, v, **kw).clone()
        out[:, :, out.shape[2] // 8 :] = 0
        return out


class _ScaledGrad(torch.autograd.Function):
    """The identity forward on ``(B, H, N, D)``; its backward multiplies the gradient of the positions
    from ``start`` on by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor, start):
        ctx.factor, ctx.start = factor, start
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[:, :, ctx.start :] *= ctx.factor
        return g, None, None


class WrongGradAttention(NaiveAttention):
    """A right output with dV 20% off: fwd_bwd figures must be marked invalid, in half precision too."""

    def _attend(self, q, k, v, **kw):
        return super()._attend(q, k, _ScaledGrad.apply(v, 1.2, 0), **kw)


class LateRowsWrongGradAttention(NaiveAttention):
    """A right output with dQ 20% off on the last eighth of the queries: a gradient check in blocks of
    rows must reach the last block."""

    def _attend(self, q, k, v, **kw):
        return super()._attend(_ScaledGrad.apply(q, 1.2, q.shape[2] * 7 // 8), k, v, **kw)


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
    """In the first process that calls it, calls sleep 1 ms sixteen at a time, then 8 ms sixteen at a
    time, and so on, for 200 calls; then 1 ms and 2 ms the same way for 200 calls, and again. A
    window of its calls is never stable, however many calls came before it (a figure timed again
    after a window that page-faulted included) and however many calls the timer averages into one
    sample: torch's timer takes 10 or, where its overhead estimate comes out larger (a busy
    machine), 100. Ten calls span parts of two runs of sixteen; a hundred average those runs out,
    but a window of four or more such samples spans both halves of the 400-call cycle (4.5 and 1.5 ms
    a call on average): its IQR is at least 25% of its median, whatever the phase. (With 4 ms in
    place of 8, a window half in each half came out at 12.5%, and noise took one under the 10% rule.)
    In later processes a steady 1 ms (a sleep: steadier on a busy 2-core CI machine than the
    microseconds of the attention itself): a job with ``retry_unstable=1`` must come out stable. The
    first caller writes its pid to a marker file, ``$ATTNBENCH_SHAKY_MARKER``; a later one writes its
    own to that path + ``.later``, so a test can tell a fresh process measured without timing
    anything."""

    calls = 0

    def _attend(self, q, k, v, **kw):
        marker = os.environ["ATTNBENCH_SHAKY_MARKER"]
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
        with open(marker) as f:
            if f.read() == str(os.getpid()):
                ShakyOnceAttention.calls += 1
                n = ShakyOnceAttention.calls
                slow = 0.008 if n // 200 % 2 == 0 else 0.002
                time.sleep(slow if n // 16 % 2 else 0.001)
            else:
                with open(marker + ".later", "w") as later:
                    later.write(str(os.getpid()))
                time.sleep(0.001)
        return super()._attend(q, k, v, **kw)


class WritesParentAttention(NaiveAttention):
    """Writes its process's parent pid to the file ``$ATTNBENCH_TEST_PARENT_FILE`` names: which
    process a job was forked from."""

    def _attend(self, q, k, v, **kw):
        with open(os.environ["ATTNBENCH_TEST_PARENT_FILE"], "w") as f:
            f.write(str(os.getppid()))
        return super()._attend(q, k, v, **kw)


class ContextLostStepLinear(LinearAttention):
    """Right forward; its decoding step ignores the prefilled state (starts from an empty one, as a
    step that never received its prefill would): a decode job's figures must be marked invalid."""

    def step(self, q, k_new, v_new, state):
        return super().step(q, k_new, v_new, None)


class LateRowsLostLinear(LinearAttention):
    """linear attention right on its first half of queries, zero on the rest: at a length where its
    float64 oracle was too large to run, such a record was called valid unchecked."""

    def _attend(self, q, k, v, **kw):
        out = super()._attend(q, k, v, **kw).clone()
        out[:, :, out.shape[2] // 2 :] = 0
        return out
