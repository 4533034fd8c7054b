"""A small Transformer whose attention core is any registered variant (Vaswani et al. 2017).

Built from the seeds' description: token embedding (scaled by ``sqrt(d_model)``) plus sinusoidal
position encoding; ``layers`` encoder blocks of (multi-head self-attention, feed-forward network),
each sub-layer wrapped in a residual connection and layer norm; for sequence-to-sequence tasks a
decoder stack of (masked self-attention, cross-attention to the encoder output, feed-forward
network). Every attention is :class:`variants.multihead.MultiHeadAttention` with the variant chosen
by its registered name, so any registered variant (third-party ones included) trains without new
code. No dropout: the suite measures attention itself (DESIGN.md).

Cost per example of length ``N``: ``O(layers * N * d_model * (d_model + ffn))`` for projections and
feed-forward networks plus whatever the variant costs (``O(N^2 * d_model)`` for exact attention).

Layer norm placement: ``norm_first=True`` (pre-LN, ``x + f(norm(x))``, with a final norm) trains
small models without a long warm-up; ``False`` is the paper's post-LN ``norm(x + f(x))``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from variants import AttentionVariant
from variants.masks import safe_softmax
from variants.multihead import MultiHeadAttention


def sinusoidal_positions(n: int, d: int, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(n, d)`` position encoding ``PE[p, 2i] = sin(p / 10000^(2i/d))``, ``PE[p, 2i+1] = cos(...)``.

    (One seed article swaps sine and cosine between even and odd columns; this follows the paper.)
    Computed in float64 so long sequences keep distinct codes, then cast.
    """
    pos = torch.arange(n, dtype=torch.float64)[:, None]  # (n, 1)
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (ceil(d/2),)
    angle = pos * freq  # (n, ceil(d/2))
    pe = torch.empty(n, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d // 2])  # odd d: one cosine fewer than sines
    return pe.to(dtype)


class FeedForward(nn.Module):
    """``FFN(x) = max(0, x W1 + b1) W2 + b2``, applied to every position: ``(B, N, E) -> (B, N, E)``."""

    def __init__(self, d_model: int, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(d_model, width)
        self.outer = nn.Linear(width, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.inner(x)))


class _Residual(nn.Module):
    """A sub-layer with its residual connection and layer norm (pre- or post-norm)."""

    def __init__(self, d_model: int, norm_first: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.norm_first = norm_first

    def forward(self, x: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.norm_first:
            return x + f(self.norm(x))
        return self.norm(x + f(x))


# a registered variant name, or a factory ``(heads, head_dim) -> AttentionVariant`` for a class that
# is not reachable by its name (e.g. a subclass that inherits its parent's name)
VariantSpec = str | Callable[[int, int], AttentionVariant]


def attention_layer(
    d_model: int, heads: int, variant: VariantSpec, knobs: dict[str, Any]
) -> MultiHeadAttention:
    """One multi-head attention layer with a fresh core of ``variant``."""
    if isinstance(variant, str):
        return MultiHeadAttention(d_model, heads, variant=variant, **knobs)
    return MultiHeadAttention(d_model, heads, variant=variant(heads, d_model // heads))


class EncoderLayer(nn.Module):
    """Self-attention (``causal``: position t sees positions <= t only) then feed-forward network:
    ``(B, N, E) -> (B, N, E)``."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        ffn: int,
        variant: VariantSpec,
        knobs: dict[str, Any],
        norm_first: bool,
        causal: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = attention_layer(d_model, heads, variant, knobs)
        self.ffn = FeedForward(d_model, ffn)
        self.res_attn = _Residual(d_model, norm_first)
        self.res_ffn = _Residual(d_model, norm_first)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res_attn(x, lambda h: self.self_attn(h, causal=self.causal))
        return self.res_ffn(x, self.ffn)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to ``memory (B, Ns, E)``, feed-forward: ``(B, T, E)``."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        ffn: int,
        variant: VariantSpec,
        knobs: dict[str, Any],
        norm_first: bool,
    ) -> None:
        super().__init__()
        self.self_attn = attention_layer(d_model, heads, variant, knobs)
        self.cross_attn = attention_layer(d_model, heads, variant, knobs)
        self.ffn = FeedForward(d_model, ffn)
        self.res_self = _Residual(d_model, norm_first)
        self.res_cross = _Residual(d_model, norm_first)
        self.res_ffn = _Residual(d_model, norm_first)

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        # causal: position t may not see the tokens it is about to predict
        y = self.res_self(y, lambda h: self.self_attn(h, causal=True))
        y = self.res_cross(y, lambda h: self.cross_attn(h, memory, cross=True))
        return self.res_ffn(y, self.ffn)

    def step(self, y: torch.Tensor, past: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """The output ``(B, 1, E)`` of one new position ``y (B, 1, E)`` given this layer's inputs at
        the earlier positions ``past (B, t, E)``: the last row of :meth:`forward` on ``past + y``.

        Causality makes the earlier rows independent of ``y``, so a decoder can keep them; the new
        row attends to all ``t + 1`` positions (a cross-shaped call, ``Nq = 1``), which equals the
        causal row only for a core whose pattern is every pair (see ``TaskTransformer.greedy``).
        """
        seq = torch.cat([past, y], dim=1)  # (B, t + 1, E)
        kv = self.res_self.norm(seq) if self.res_self.norm_first else seq  # what forward's keys see
        y = self.res_self(y, lambda h: self.self_attn(h, kv))
        y = self.res_cross(y, lambda h: self.cross_attn(h, memory, cross=True))
        return self.res_ffn(y, self.ffn)


class TaskTransformer(nn.Module):
    """Encoder (and, with ``decoder_layers > 0``, decoder) over one shared token vocabulary.

    ``forward(src)`` returns encoder logits ``(B, N, vocab)`` (one prediction per input position);
    ``forward(src, dec_in)`` returns decoder logits ``(B, T, vocab)``. ``causal``: the encoder's
    self-attention is causal (a decoder-only model, each position predicted from the ones before).
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        d_model: int,
        heads: int,
        layers: int,
        ffn: int,
        variant: VariantSpec,
        knobs: dict[str, Any] | None = None,
        decoder_layers: int = 0,
        norm_first: bool = True,
        causal: bool = False,
    ) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} must be a multiple of heads={heads}")
        if layers < 1 or ffn < 1 or decoder_layers < 0:
            raise ValueError(
                f"need layers >= 1, ffn >= 1, decoder_layers >= 0; got {layers}, {ffn}, {decoder_layers}"
            )
        knobs = dict(knobs or {})
        self.d_model, self.norm_first = d_model, norm_first
        self.embed = nn.Embedding(vocab_size, d_model)
        # std d^-1/2, so the sqrt(d)-scaled embedding has unit-size entries like the position code;
        # torch's default N(0, 1) would make it sqrt(d) times larger than every sub-layer's output and
        # the residual updates negligible (training then stalls)
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)
        self.encoder = nn.ModuleList(
            EncoderLayer(d_model, heads, ffn, variant, knobs, norm_first, causal) for _ in range(layers)
        )
        self.decoder = nn.ModuleList(
            DecoderLayer(d_model, heads, ffn, variant, knobs, norm_first) for _ in range(decoder_layers)
        )
        # pre-LN leaves the residual stream un-normalised: one norm before each read-out
        self.enc_norm = nn.LayerNorm(d_model) if norm_first else nn.Identity()
        self.dec_norm = nn.LayerNorm(d_model) if norm_first and decoder_layers else nn.Identity()
        self.head = nn.Linear(d_model, vocab_size)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, N)`` tokens -> ``(B, N, E)``: scaled embedding plus position encoding."""
        x = self.embed(tokens) * math.sqrt(self.d_model)  # the paper's scaling keeps PE from dominating
        return x + sinusoidal_positions(tokens.shape[1], self.d_model, dtype=x.dtype).to(x.device)

    def encode(self, src: torch.Tensor) -> torch.Tensor:
        """``(B, N)`` tokens -> encoder output ``(B, N, E)``."""
        x = self._embed(src)
        for layer in self.encoder:
            x = layer(x)
        return self.enc_norm(x)

    def decode(self, dec_in: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """Decoder logits ``(B, T, vocab)`` for ``dec_in (B, T)`` attending to ``memory (B, N, E)``."""
        y = self._embed(dec_in)
        for layer in self.decoder:
            y = layer(y, memory)
        return self.head(self.dec_norm(y))

    def forward(self, src: torch.Tensor, dec_in: torch.Tensor | None = None) -> torch.Tensor:
        memory = self.encode(src)
        if dec_in is None:
            return self.head(memory)
        if not len(self.decoder):
            raise ValueError("dec_in given but the model has no decoder (decoder_layers=0)")
        return self.decode(dec_in, memory)

    @torch.no_grad()
    def greedy(self, src: torch.Tensor, bos: int, steps: int, cached: bool | None = None) -> torch.Tensor:
        """Greedy decoding of ``steps`` tokens after ``bos``: ``(B, steps)``.

        ``cached`` (default: when every decoder core attends every pair it is given, i.e. its
        pattern is full) keeps each layer's inputs at earlier positions and computes one new
        position per step: ``O(steps)`` positions through the layers, ``O(steps^2)`` attention
        pairs. Otherwise (a core with a structured pattern, whose cross-shaped call would align
        queries differently) the whole prefix is decoded again each step: ``O(steps^2)`` positions.
        """
        if cached is None:
            cores = [m for layer in self.decoder for m in layer.modules() if isinstance(m, AttentionVariant)]
            cached = all(bool(c.pattern(3, 5).all()) for c in cores)
        memory = self.encode(src)
        out = torch.full((src.shape[0], 1), bos, dtype=torch.long, device=src.device)  # (B, 1)
        if not cached:
            for _ in range(steps):
                nxt = self.decode(out, memory)[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
                out = torch.cat([out, nxt], dim=1)  # (B, t + 1)
            return out[:, 1:]
        pe = sinusoidal_positions(steps, self.d_model, dtype=memory.dtype).to(memory.device)  # (T, E)
        past = [memory.new_zeros(src.shape[0], 0, self.d_model) for _ in self.decoder]  # (B, 0, E) each
        for t in range(steps):
            y = self.embed(out[:, -1:]) * math.sqrt(self.d_model) + pe[t]  # (B, 1, E), as _embed does
            for i, layer in enumerate(self.decoder):
                y, past[i] = layer.step(y, past[i], memory), torch.cat([past[i], y], dim=1)
            nxt = self.head(self.dec_norm(y))[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
            out = torch.cat([out, nxt], dim=1)  # (B, t + 2)
        return out[:, 1:]


def attention_cores(model: nn.Module) -> dict[str, AttentionVariant]:
    """Every attention core (the variant modules inside the multi-head layers), by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, AttentionVariant)}


def count_params(model: nn.Module, *, cores: bool = True) -> int:
    """Number of parameters; ``cores=False`` leaves out those of the attention cores.

    The model without its cores' parameters is the same architecture with a parameter-free exact
    core, which is the baseline a learned scorer is matched against.
    """
    total = sum(p.numel() for p in model.parameters())
    if cores:
        return total
    core = {id(p): p.numel() for c in attention_cores(model).values() for p in c.parameters()}
    return total - sum(core.values())


@contextmanager
def recorded_attention(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block, each attention core's weights ``(B, H, Nq, Nk)`` of the last call, by name.

    The weights are not taken from the variant's own kernel (fused kernels never form them): they are
    recomputed in float64 from the ``q, k`` it was called with, as ``softmax(reference_scores)``
    restricted to its ``pattern`` and the call's masks, exactly as the oracle
    (:func:`variants.oracle`) defines the variant. A variant that is not a restricted softmax
    (it defines ``oracle_forward``, e.g. axial) has no single weight matrix and is left out.
    Memory ``O(B * H * Nq * Nk)`` per core: use it on a few examples.
    """
    maps: dict[str, torch.Tensor] = {}
    handles = []

    def hook(name: str) -> Callable[..., None]:
        def pre(mod: AttentionVariant, args: tuple, kwargs: dict[str, Any]) -> None:
            q, k = args[0], args[1]
            causal = bool(kwargs.get("causal", False))
            nq, nk = q.shape[2], k.shape[2]
            allowed = mod.pattern(nq, nk, causal).to(q.device)[None, None]  # (1, 1, Nq, Nk)
            kpm, am = kwargs.get("key_padding_mask"), kwargs.get("attn_mask")
            if kpm is not None:
                allowed = allowed & kpm[:, None, None, :]  # (B, 1, Nq, Nk)
            if am is not None:
                allowed = allowed & am
            with torch.no_grad():
                maps[name] = safe_softmax(mod.reference_scores(q.detach(), k.detach()), allowed)

        return pre

    for name, core in attention_cores(model).items():
        if getattr(core, "oracle_forward", None) is None:
            handles.append(core.register_forward_pre_hook(hook(name), with_kwargs=True))
    try:
        yield maps
    finally:
        for h in handles:
            h.remove()
