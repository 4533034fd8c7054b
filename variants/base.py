"""The one interface every attention variant implements.

Conventions (see DESIGN.md): tensors are ``(B, H, N, D)``; boolean masks mean True = may attend;
``key_padding_mask`` is ``(B, Nk)``; ``attn_mask`` broadcasts to ``(B, H, Nq, Nk)``; ``causal`` needs
``Nq == Nk``; a query that can see no key outputs zeros with zero gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

ALL_DTYPES = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})


class Unsupported(Exception):
    """Raised by :meth:`AttentionVariant.check` before any work, with a human-readable reason."""


class Unavailable(Exception):
    """The device or a library the variant needs is not there, or cannot load (a fact about the
    machine, not the variant); the reason says what is missing and how to get it."""


@dataclass(frozen=True)
class Workload:
    """Everything a variant needs to know to decide whether it can run, without any tensor."""

    batch: int
    heads: int
    nq: int
    nk: int
    head_dim: int
    v_head_dim: int
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    causal: bool = False
    key_padding: bool = False
    attn_mask: bool = False
    backward: bool = False

    @classmethod
    def of(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> Workload:
        """Describe the call ``variant(q, k, v, ...)``; checks the shapes agree."""
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(
                f"q, k, v must be (B, H, N, D); got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        b, h, nq, d = q.shape
        if 0 in (*q.shape, *k.shape, *v.shape):
            raise ValueError(
                f"q, k, v need non-empty B, H, N and D; got shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        if not (q.device == k.device == v.device):
            raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
        if k.shape[:2] != (b, h) or k.shape[3] != d:
            raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, H or D")
        if v.shape[:3] != k.shape[:3]:
            raise ValueError(f"v {tuple(v.shape)} does not match k {tuple(k.shape)} in B, H or N")
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, k.shape[2]):
            raise ValueError(
                f"key_padding_mask must be (B, Nk) = {(b, k.shape[2])}, got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            raise ValueError("key_padding_mask must be boolean (True = real key)")
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            raise ValueError("attn_mask must be boolean (True = may attend)")
        return cls(
            batch=b,
            heads=h,
            nq=nq,
            nk=k.shape[2],
            head_dim=d,
            v_head_dim=v.shape[3],
            device=q.device.type,
            dtype=q.dtype,
            causal=causal,
            key_padding=key_padding_mask is not None,
            attn_mask=attn_mask is not None,
            backward=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        )


class AttentionVariant(nn.Module):
    """Base class: ``forward(q, k, v, *, causal, key_padding_mask, attn_mask) -> (B, H, Nq, Dv)``.

    Subclasses set the class-level facts below, implement :meth:`_attend`, and override
    :meth:`pattern` / :meth:`num_pairs` when they do not compute every (query, key) pair.
    Structural knobs (window, block size, ...) are constructor arguments.
    """

    name: ClassVar[str] = ""
    #: True when the output equals full softmax attention (up to rounding).
    exact: ClassVar[bool] = True
    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    dtypes: ClassVar[frozenset[torch.dtype]] = ALL_DTYPES
    supports_causal: ClassVar[bool] = True
    supports_key_padding: ClassVar[bool] = True
    supports_attn_mask: ClassVar[bool] = True
    supports_cross: ClassVar[bool] = True
    #: devices on which backward runs
    backward_devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    has_params: ClassVar[bool] = False
    #: True when the variant is compiled (its first call includes compile time).
    compiled: ClassVar[bool] = False
    #: Knob sets that give a non-trivial pattern at small sizes (N around 16-64), used by the
    #: registry-wide tests and the pattern plots so a new variant is tested without new test code.
    example_knobs: ClassVar[tuple[dict[str, object], ...]] = ({},)

    def __init__(self) -> None:  # subclasses list their knobs explicitly (the registry reads them)
        super().__init__()

    # ------------------------------------------------------------------ capability checks
    def check(self, w: Workload) -> None:
        """Raise :class:`Unsupported` with a reason if this variant cannot run ``w``."""
        who = self.name or type(self).__name__
        if w.device not in self.devices:
            raise Unsupported(f"{who} does not run on device '{w.device}'")
        if w.dtype not in self.dtypes:
            raise Unsupported(f"{who} does not support dtype {str(w.dtype).replace('torch.', '')}")
        if w.causal and w.nq != w.nk:
            raise Unsupported(f"causal attention needs Nq == Nk, got Nq={w.nq}, Nk={w.nk}")
        if w.causal and not self.supports_causal:
            raise Unsupported(f"{who} does not support causal masking")
        if w.key_padding and not self.supports_key_padding:
            raise Unsupported(f"{who} does not support a key padding mask")
        if w.attn_mask and not self.supports_attn_mask:
            raise Unsupported(f"{who} does not support an arbitrary attn_mask")
        if w.nq != w.nk and not self.supports_cross:
            raise Unsupported(f"{who} does not support cross-attention (Nq={w.nq} != Nk={w.nk})")
        if w.backward and w.device not in self.backward_devices:
            raise Unsupported(f"{who} has no backward pass on device '{w.device}'")

    # ------------------------------------------------------------------ the computation
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend ``q (B,H,Nq,D)`` to ``k (B,H,Nk,D)``, ``v (B,H,Nk,Dv)``; returns ``(B,H,Nq,Dv)``."""
        w = Workload.of(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        self.check(w)
        return self._attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_mask=attn_mask)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ structure and work
    def pattern(self, nq: int, nk: int, causal: bool = False) -> torch.Tensor:
        """Boolean ``(Nq, Nk)`` matrix of the (query, key) pairs this variant lets interact.

        Masks passed at call time come on top of it. Default: every pair (lower triangle if causal).
        """
        allowed = torch.ones(nq, nk, dtype=torch.bool)
        return allowed.tril() if causal else allowed

    def num_pairs(self, nq: int, nk: int, causal: bool = False) -> int:
        """Number of (query, key) pairs computed; analytic where the pattern is known."""
        if type(self).pattern is AttentionVariant.pattern:
            return nq * (nq + 1) // 2 if causal else nq * nk
        return int(self.pattern(nq, nk, causal).sum())

    def flops(self, w: Workload, mode: str = "fwd") -> int:
        """Useful FLOPs of ``mode`` ('fwd', 'bwd' or 'fwd_bwd') for workload ``w``.

        Forward is ``B * H * pairs * (2*D + 2*Dv)`` (FlashAttention convention: useful pairs, not what
        a blocked kernel computes); backward counts 2.5x forward. Call-time masks are not subtracted.
        """
        pairs = self.num_pairs(w.nq, w.nk, w.causal)
        fwd = w.batch * w.heads * pairs * (2 * w.head_dim + 2 * w.v_head_dim)
        factor = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
        return int(fwd * factor)

    # ------------------------------------------------------------------ oracle hooks
    def reference_scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Float64 ``(B, H, Nq, Nk)`` scores the oracle softmaxes; default ``q k^T / sqrt(D)``."""
        return (q.double() @ k.double().transpose(-2, -1)) / q.shape[-1] ** 0.5

    def describe(self) -> dict[str, object]:
        """The variant's name, knobs and facts, for records."""
        return {
            "name": self.name,
            "exact": self.exact,
            "knobs": self.knobs(),
        }

    def knobs(self) -> dict[str, object]:
        """The structural knobs this instance was built with (override to list them)."""
        return {}
