"""What a variant keeps of a pretrained model, as numbers: embedding cosines, retrieval agreement,
the share of (query, key) pairs a pattern keeps and the share of the model's attention mass inside it.

Pure functions of tensors (no model here), each ``O(size of its inputs)``; the tests check them
against plain-Python computations.
"""

from __future__ import annotations

import torch


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unit-length mean of the real tokens' states: ``hidden (B, N, E)``, ``mask (B, N)`` (1 = real
    token) -> ``(B, E)`` in float32 (sentence-transformers' pooling for this model)."""
    m = mask.to(torch.float32).unsqueeze(-1)  # (B, N, 1)
    summed = (hidden.float() * m).sum(1)  # (B, E)
    return torch.nn.functional.normalize(summed / m.sum(1).clamp_min(1.0), dim=-1)


def cosine_stats(ref: torch.Tensor, got: torch.Tensor) -> dict[str, float]:
    """Cosine of each row of ``got (T, E)`` to the same row of ``ref (T, E)`` (both unit length):
    mean, 5th percentile (linear interpolation) and minimum over the ``T`` texts."""
    cos = (ref.double() * got.double()).sum(-1)  # (T,)
    return {
        "cosine_mean": float(cos.mean()),
        "cosine_p5": float(torch.quantile(cos, 0.05)),
        "cosine_min": float(cos.min()),
    }


def _top(queries: torch.Tensor, texts: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``(Q, k)`` of the ``k`` texts most similar to each query, best first (ties: lower
    index first, so the ranking is deterministic)."""
    sim = queries.double() @ texts.double().T  # (Q, T)
    order = torch.argsort(-sim, dim=1, stable=True)  # (Q, T)
    return order[:, :k]


def retrieval_agreement(
    ref_q: torch.Tensor, ref_t: torch.Tensor, got_q: torch.Tensor, got_t: torch.Tensor, k: int = 5
) -> dict[str, float]:
    """Neighbour agreement of a retrieval task between the unmodified model (``ref_*``) and the
    model with a variant (``got_*``): query embeddings ``(Q, E)``, text embeddings ``(T, E)``, query
    ``i`` taken from text ``i``.

    ``top1_agreement``: share of queries whose nearest text is the same for both; ``top{k}_agreement``:
    mean share of the ``k`` nearest texts the two have in common; ``retrieval_top1`` and
    ``retrieval_top1_ref``: share of queries whose nearest text is the one they come from. ``O(Q T E)``.
    """
    if ref_t.shape[0] < k:
        raise ValueError(f"top-{k} agreement needs at least {k} texts, got {ref_t.shape[0]}")
    a, b = _top(ref_q, ref_t, k), _top(got_q, got_t, k)  # (Q, k) each
    source = torch.arange(ref_q.shape[0], device=a.device)
    common = [len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(a, b, strict=True)]
    return {
        "top1_agreement": float((a[:, 0] == b[:, 0]).double().mean()),
        f"top{k}_agreement": float(sum(common) / len(common)),
        "retrieval_top1": float((b[:, 0] == source).double().mean()),
        "retrieval_top1_ref": float((a[:, 0] == source).double().mean()),
    }


def kept_share(keep: torch.Tensor) -> float:
    """Share of the (query, key) pairs a boolean pattern ``keep (Nq, Nk)`` lets interact."""
    return float(keep.double().mean())


def band(n: int, radius: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The diagonal band ``(n, n)``: True where ``|i - j| <= radius``."""
    i = torch.arange(n, device=device)
    return (i[:, None] - i[None, :]).abs() <= radius


def reweights(cls: type) -> bool:
    """Whether the variant class sees every pair but weighs them its own way (linear, performer,
    nystrom: not exact, no pattern of its own): the model's attention mass inside its pattern is then
    all of it and says nothing of what it keeps. ``O(1)``."""
    from variants.base import AttentionVariant

    return not cls.exact and cls.pattern is AttentionVariant.pattern


def mass_inside(attn: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Attention mass inside a pattern, per batch element: ``attn (B, H, N, N)`` (rows sum to 1,
    the model's own weights), ``keep (N, N)`` bool -> ``(B,)``: the mean over heads and query rows of
    the weight that falls on kept keys. Summed over a batch of equal-length texts it gives the mean."""
    inside = (attn.double() * keep.to(attn.device)).sum(-1)  # (B, H, N): kept mass per query row
    return inside.mean(dim=(1, 2))


class MassTally:
    """Running per-layer means of the attention mass on the first key, on a diagonal band and inside a
    variant's pattern, over the texts of several batches (texts of equal length, no padding).

    ``keep``: the pattern ``(N, N)`` every layer runs, or one per layer (a local/global layer mix)."""

    def __init__(self, layers: int, keep: torch.Tensor | list[torch.Tensor], radius: int) -> None:
        keeps = list(keep) if isinstance(keep, (list, tuple)) else [keep] * layers
        if len(keeps) != layers:
            raise ValueError(f"MassTally: {len(keeps)} patterns for {layers} layers")
        n = keeps[0].shape[-1]
        self.keeps, self.band, self.radius = keeps, band(n, radius, keeps[0].device), radius
        self.first = torch.zeros(layers, dtype=torch.float64)
        self.diag = torch.zeros(layers, dtype=torch.float64)
        self.inside = torch.zeros(layers, dtype=torch.float64)
        self.texts = 0

    def add(self, attentions: tuple[torch.Tensor, ...]) -> None:
        """One batch: a ``(B, H, N, N)`` weight tensor per layer."""
        for layer, attn in enumerate(attentions):
            self.first[layer] += float(attn[..., 0].double().mean(dim=(1, 2)).sum())  # weight on key 0
            self.diag[layer] += float(mass_inside(attn, self.band).sum())
            self.inside[layer] += float(mass_inside(attn, self.keeps[layer]).sum())
        self.texts += attentions[0].shape[0]

    def figures(self) -> dict[str, list[float]]:
        """Per-layer means: ``mass_first_token``, ``mass_band``, ``mass_inside``."""
        t = max(self.texts, 1)
        return {
            "mass_first_token": (self.first / t).tolist(),
            "mass_band": (self.diag / t).tolist(),
            "mass_inside": (self.inside / t).tolist(),
        }
