"""Random inputs for one workload: q, k, v, the key padding mask, the packed documents' mask, and the
scale and bias."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from variants.base import full_pairs
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
    documents: torch.Tensor | None = None  # (B, Nk) int64: each key position's document (``documents > 1``)
    document_lengths: list[list[int]] | None = None  # per batch row, the lengths of its documents

    def kwargs(self, causal: bool, cross: bool = False) -> dict[str, object]:
        """The keyword arguments of the variant's call (scale, bias, documents and cross only when set)."""
        kw: dict[str, object] = {"causal": causal, "key_padding_mask": self.key_padding_mask}
        if self.documents is not None:
            kw["documents"] = self.documents
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
    documents: int = 1,
) -> Inputs:
    """Standard-normal q, k, v drawn from ``seed`` (k and v with ``kv_heads`` heads, default
    ``heads``); with ``padding > 0`` the last ``round(padding * Nk)`` keys of every sequence are
    padding (never all of them); ``bias="alibi"`` adds ALiBi's ``(1, H, Nq, Nk)`` bias; with
    ``documents > 1`` every sequence packs that many documents (:func:`document_lengths`), given to the
    call as ``(B, Nk)`` ids: a query sees the keys of its own document only."""
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
    lengths = ids = None
    if documents > 1:
        lengths = document_lengths(batch, nk, documents, seed)
        ids = document_ids(lengths).to(device)
    return Inputs(q, k, v, kpm, scale, bias_t, ids, lengths)


def document_lengths(batch: int, n: int, documents: int, seed: int = 0) -> list[list[int]]:
    """How ``batch`` sequences of ``n`` tokens each pack ``documents`` documents: per sequence, the
    lengths (each >= 1, summing to ``n``), drawn from ``seed`` around ``n / documents``: each document
    has one token, and each of the other ``n - documents`` goes to a document drawn uniformly (so
    lengths vary by about ``sqrt(n / documents)``, each row its own draw). O(B n)."""
    if not 1 <= documents <= n:
        raise ValueError(f"documents must be between 1 and the sequence's {n} tokens; got {documents}")
    g = torch.Generator(device="cpu").manual_seed(seed + 7919)  # apart from q, k, v's draw
    out = []
    for _ in range(batch):
        owner = torch.randint(documents, (n - documents,), generator=g)  # the document of each token
        out.append((torch.bincount(owner, minlength=documents) + 1).tolist())
    return out


def document_ids(lengths: list[list[int]]) -> torch.Tensor:
    """``(B, Nk)`` int64: each key position's document, numbered from 0 in each row, from the rows'
    document lengths (:func:`document_lengths`)."""
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths]
    )


def pairs_kept(lengths: list[list[int]], nq: int, causal: bool) -> float:
    """The share of the pairs a full (or causal) call computes that lie within one document, counted
    from the lengths alone: the useful FLOPs of a packed call against an unpacked one's. The queries
    are the last ``nq`` of each row's ``Nk = sum(row)`` positions. O(B * documents)."""
    nk = sum(lengths[0])
    first = nk - nq  # the first query's position

    def tri(n: int) -> int:  # 1 + 2 + ... + n
        return n * (n + 1) // 2

    kept = 0
    for row in lengths:
        start = 0
        for n in row:
            a = max(start, first)  # this document's first query
            if a < start + n:
                # causal: the query at p sees p - start + 1 keys of its document; else all n
                kept += tri(n) - tri(a - start) if causal else (start + n - a) * n
            start += n
    return kept / (len(lengths) * full_pairs(nq, nk, causal))
