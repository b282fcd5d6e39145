"""``axial_2d``: each token of a grid attends to its own row and its own column (Ho et al. 2019,
Axial Attention, as one pattern rather than two layers).

Query (r, c) attends to key (r', c') when r' == r or c' == c: W + H - 1 keys. A 3 x 4 grid, the
keys of the query at q::

    . x . .
    x q x x
    . x . .

In row-major order a row is contiguous but a column touches every block; in tiled order
(``Tiles``) a tile needs only the tiles of its tile-row and tile-column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Spans, state_from
from .families import register_pattern
from .grid import GridPattern, crop_queries, on_grid


def _same(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """(some, every) pair with equal coordinates, for coordinates in [a0, a1] x [b0, b1]."""
    (a0, a1), (b0, b1) = a, b
    return (a0 <= b1) & (b0 <= a1), (a0 == a1) & (b0 == b1) & (a0 == b0)


@dataclass(frozen=True)
class Axial2D(GridPattern):
    """Key (r', c') is allowed for query (r, c) when r' == r or c' == c."""

    grid: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self.check_grid()

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        (qr, qc), (kr, kc) = self.rows_cols(q_pos), self.rows_cols(kv_pos)
        return ((qr == kr) | (qc == kc)) & (q_pos >= 0)

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        qb, kb = self.boxes(q, k)
        some_r, every_r = _same((qb.row_lo, qb.row_hi), (kb.row_lo, kb.row_hi))
        some_c, every_c = _same((qb.col_lo, qb.col_hi), (kb.col_lo, kb.col_hi))
        any_q, all_q = on_grid(q)
        return state_from((some_r | some_c) & any_q, (every_r | every_c) & all_q, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        h, w = self.grid
        # Same row: every column pair of equal rows; same column: every row pair of equal columns.
        rows = crop_queries(
            torch.eye(h, dtype=torch.bool), torch.ones(w, w, dtype=torch.bool), q_len
        )
        cols = crop_queries(
            torch.ones(h, h, dtype=torch.bool), torch.eye(w, dtype=torch.bool), q_len
        )
        return rows | cols


@register_pattern("axial_2d")
def axial_2d(grid: tuple[int, int] | None = None) -> Axial2D:
    """The query's row and column of a grid of H x W tokens (row-major)."""
    return Axial2D(grid)
