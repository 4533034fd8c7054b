"""Random inputs for one workload: q, k, v, the key padding mask, and the scale and bias."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from variants.masks import alibi_bias

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class Inputs:
    q: torch.Tensor  # (B, H, Nq, D)
    k: torch.Tensor  # (B, Hkv, Nk, D)
    v: torch.Tensor  # (B, Hkv, Nk, Dv)
    key_padding_mask: torch.Tensor | None  # (B, Nk), True = real key
    scale: float | None = None
    bias: torch.Tensor | None = None  # (1, H, Nq, Nk)

    def kwargs(self, causal: bool, cross: bool = False) -> dict[str, object]:
        """The keyword arguments of the variant's call (scale, bias and cross only when set)."""
        kw: dict[str, object] = {"causal": causal, "key_padding_mask": self.key_padding_mask}
        if cross:
            kw["cross"] = True
        if self.scale is not None:
            kw["scale"] = self.scale
        if self.bias is not None:
            kw["bias"] = self.bias
        return kw

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
    kv_heads: int | None = None,
    scale: float | None = None,
    bias: str | None = None,
    causal: bool = False,
) -> Inputs:
    """Standard-normal q, k, v drawn from ``seed`` (k and v with ``kv_heads`` heads, default
    ``heads``); with ``padding > 0`` the last ``round(padding * Nk)`` keys of every sequence are
    padding (never all of them); ``bias="alibi"`` adds ALiBi's ``(1, H, Nq, Nk)`` bias."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    q = draw(batch, heads, nq, head_dim)
    k = draw(batch, kv_heads or heads, nk, head_dim)
    v = draw(batch, kv_heads or heads, nk, v_head_dim)
    kpm = None
    n_pad = min(nk - 1, round(padding * nk))
    if n_pad > 0:
        kpm = torch.ones(batch, nk, dtype=torch.bool, device=device)
        kpm[:, nk - n_pad :] = False
    bias_t = None
    if bias == "alibi":
        bias_t = alibi_bias(heads, nq, nk, causal=causal, dtype=dtype, device=device)
    return Inputs(q, k, v, kpm, scale, bias_t)
