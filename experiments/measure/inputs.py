"""Random inputs for one workload: q, k, v and the key padding mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class Inputs:
    q: torch.Tensor  # (B, H, Nq, D)
    k: torch.Tensor  # (B, H, Nk, D)
    v: torch.Tensor  # (B, H, Nk, Dv)
    key_padding_mask: torch.Tensor | None  # (B, Nk), True = real key

    def kwargs(self, causal: bool) -> dict[str, object]:
        return {"causal": causal, "key_padding_mask": self.key_padding_mask}

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q, self.k, self.v


def make_inputs(
    batch: int,
    heads: int,
    nq: int,
    nk: int,
    head_dim: int,
    v_head_dim: int,
    *,
    dtype: torch.dtype,
    device: str,
    padding: float = 0.0,
    seed: int = 0,
    requires_grad: bool = False,
) -> Inputs:
    """Standard-normal q, k, v drawn from ``seed``; with ``padding > 0`` the last
    ``round(padding * Nk)`` keys of every sequence are padding (never all of them)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    q = draw(batch, heads, nq, head_dim)
    k = draw(batch, heads, nk, head_dim)
    v = draw(batch, heads, nk, v_head_dim)
    kpm = None
    n_pad = min(nk - 1, round(padding * nk))
    if n_pad > 0:
        kpm = torch.ones(batch, nk, dtype=torch.bool, device=device)
        kpm[:, nk - n_pad :] = False
    return Inputs(q, k, v, kpm)
