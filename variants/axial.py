"""``axial``: attention along the rows, then along the columns, of a 2-D grid (Ho et al., 2019,
"Axial Attention in Multidimensional Transformers").

The sequence of length ``N`` is laid out row-major on a ``rows x cols`` grid (``N = rows * cols``;
token ``t`` sits at row ``t // cols``, column ``t % cols``). Stage 1 attends each query to the keys of
its row; stage 2 attends each query to the keys of its column, with the stage-1 outputs as values
(same ``q`` and ``k``), so ``out = A_col @ (A_row @ V)``: information reaches every token of the grid
in two hops. Causal: within the row in stage 1 and within the column in stage 2, so no token later
in raster order leaks in. Key padding masks keys in both stages. ``rows=None`` picks the divisor of
``N`` closest to ``sqrt(N)`` (a length with no grid other than ``1 x N``, such as a prime, is
unsupported then); an explicit ``rows`` must divide ``N``.

Shapes: ``q (B, H, N, D)``, ``k (B, H, N, D)``, ``v (B, H, N, Dv)`` -> ``(B, H, N, Dv)``; self-attention
only, no arbitrary ``attn_mask``. Time ``O(B H N (rows + cols) D)`` (``O(N^1.5)`` on a square grid);
memory ``O(B H N (rows + cols))``. Low-precision inputs are accumulated in float32, including the
stage-1 output that stage 2 reads.
"""

from __future__ import annotations

import torch

from .base import AttentionVariant, Unsupported, Workload
from .masks import combined_mask, softmax_blocked_, zero_empty_rows
from .reference import reference_attention
from .registry import register


def _axis_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kpm: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """Attention within each line of a grid: ``q, k (B, H, L, M, D)``, ``v (B, H, L, M, Dv)``.

    ``kpm`` is ``(B, L, M)`` (True = real key) or None. Returns ``(B, H, L, M, Dv)``.
    """
    m = q.shape[-2]
    blocked = None  # True = may not attend
    if causal:
        blocked = torch.ones(m, m, dtype=torch.bool, device=q.device).triu(1)  # (M, M)
    if kpm is not None:
        pad = ~kpm[:, None, :, None, :]  # (B, 1, L, 1, M)
        blocked = pad if blocked is None else blocked | pad  # (B, 1, L, M|1, M)
    p = softmax_blocked_(q @ k.transpose(-2, -1), blocked)  # (B, H, L, M, M)
    return zero_empty_rows(p @ v, blocked)  # (B, H, L, M, Dv)


@register("axial")
class AxialAttention(AttentionVariant):
    """Row attention then column attention on a ``rows x cols`` grid of the sequence."""

    exact = False  # a different operator from full attention; see oracle_forward
    supports_attn_mask = False
    supports_cross = False
    #: its two softmax stages' graph at the gradient check: 7.3-7.8x its count
    oracle_graph_copies = 8
    # a new token's column step reads the row-step outputs of every earlier token, which a K/V cache
    # does not hold: decoding would recompute the whole grid, so it is refused with that reason
    supports_decode = False
    example_knobs = ({"rows": None}, {"rows": 2})

    def __init__(self, rows: int | None = None) -> None:
        super().__init__()
        if rows is not None and rows < 1:
            raise ValueError(f"rows must be >= 1 or None, got {rows}")
        self.rows = rows

    def knobs(self) -> dict[str, object]:
        return {"rows": self.rows}

    def grid(self, n: int) -> tuple[int, int]:
        """``(rows, cols)`` for length ``n``; :class:`Unsupported` when no grid fits."""
        if self.rows is not None:
            if n % self.rows != 0:
                raise Unsupported(
                    f"axial: N={n} cannot be laid out on a grid with rows={self.rows} "
                    f"({n} is not a multiple of {self.rows})"
                )
            return self.rows, n // self.rows
        # the proper divisor closest to sqrt(n): rows == 1 would just be full attention
        divisors = [r for r in range(2, n) if n % r == 0]
        if not divisors:
            raise Unsupported(
                f"axial: N={n} has no rows x cols grid with 1 < rows < N (it is prime or < 4); "
                "choose a length with a divisor or set rows explicitly"
            )
        rows = min(divisors, key=lambda r: (abs(r - n**0.5), r))
        return rows, n // rows

    def check(self, w: Workload) -> None:
        if w.nq < w.nk and not w.cross:  # cross-attention (also Nq < Nk) is refused as such, below
            raise Unsupported(
                f"axial cannot decode (Nq={w.nq} < Nk={w.nk}): its second (column) step attends to the "
                "first step's outputs of every earlier token, which a K/V cache does not hold, so a new "
                "token would recompute the whole grid"
            )
        super().check(w)
        self.grid(w.nk)

    def _attend(self, q, k, v, *, causal, key_padding_mask, attn_mask):
        bsz, h, n, d = q.shape
        dv = v.shape[-1]
        rows, cols = self.grid(n)
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        # scale q before the matmuls: in low precision q k^T could overflow first
        qg = (q.to(work) * d**-0.5).view(bsz, h, rows, cols, d)  # (B, H, R, C, D)
        kg = k.to(work).view(bsz, h, rows, cols, d)  # (B, H, R, C, D)
        vg = v.to(work).view(bsz, h, rows, cols, dv)  # (B, H, R, C, Dv)
        kpm = None if key_padding_mask is None else key_padding_mask.to(q.device).view(bsz, rows, cols)

        # stage 1: each row is a sequence of length C
        row_out = _axis_attention(qg, kg, vg, kpm, causal)  # (B, H, R, C, Dv)
        # stage 2: each column is a sequence of length R; the stage-1 outputs are its values
        col_kpm = None if kpm is None else kpm.transpose(1, 2)  # (B, C, R)
        out = _axis_attention(
            qg.transpose(2, 3),  # (B, H, C, R, D)
            kg.transpose(2, 3),  # (B, H, C, R, D)
            row_out.transpose(2, 3),  # (B, H, C, R, Dv)
            col_kpm,
            causal,
        )  # (B, H, C, R, Dv)
        return out.transpose(2, 3).reshape(bsz, h, n, dv).to(q.dtype)  # (B, H, N, Dv), raster order

    def _lines(self, nq: int, nk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense ``(Nq, Nk)`` same-row and same-column matrices on the grid of ``Nk``."""
        _, cols = self.grid(nk)
        i = torch.arange(nq)[:, None]  # (Nq, 1); query i sits where key i would
        j = torch.arange(nk)[None, :]  # (1, Nk)
        return i // cols == j // cols, i % cols == j % cols

    def left_padding_moves_pattern(self) -> str | None:
        """Its grid starts at position 0. ``O(1)``."""
        return (
            "axial lays its rows x cols grid from the first position, so left padding moves every real "
            "token's row and column"
        )

    def pattern(self, nq: int, nk: int, causal: bool = False) -> torch.Tensor:
        """Pairs that interact directly: same row or same column (intersected with causal)."""
        same_row, same_col = self._lines(nq, nk)
        allowed = same_row | same_col
        return allowed.tril() if causal else allowed

    def num_pairs(self, nq: int, nk: int, causal: bool = False) -> int:
        """Pairs scored by the two stages (the diagonal is scored twice, so this exceeds pattern())."""
        if nq != nk:
            same_row, same_col = self._lines(nq, nk)
            if causal:
                same_row, same_col = same_row.tril(), same_col.tril()
            return int(same_row.sum() + same_col.sum())
        rows, cols = self.grid(nq)
        if causal:
            return rows * cols * (cols + 1) // 2 + cols * rows * (rows + 1) // 2
        return nq * cols + nq * rows

    def oracle_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Float64 axial attention written densely: two masked full attentions in raster order (both
        with the scores scaled by ``scale``, default ``1/sqrt(D)``)."""
        if attn_mask is not None:
            raise Unsupported("axial does not support an arbitrary attn_mask")
        bsz, nq, nk = q.shape[0], q.shape[2], k.shape[2]
        same_row, same_col = self._lines(nq, nk)
        same_row, same_col = same_row.to(q.device), same_col.to(q.device)
        # in raster order "j <= i" is exactly "earlier in the row" / "earlier in the column"
        masks = combined_mask(bsz, nq, nk, causal=causal, key_padding_mask=key_padding_mask, device=q.device)
        row_allowed = same_row if masks is None else masks & same_row  # (B|1, 1, Nq, Nk)
        col_allowed = same_col if masks is None else masks & same_col
        row_out = reference_attention(q, k, v, allowed=row_allowed, scale=scale)  # (B, H, N, Dv) float64
        # no ``rows=``: a checked row's column reads the row stage at every position of that column, so
        # this form computes all rows (and the job's budget counts them all: N x N float64 per head)
        return reference_attention(q, k, row_out, allowed=col_allowed, scale=scale)
