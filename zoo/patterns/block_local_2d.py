"""``block_local_2d``: non-overlapping windows of a grid, each attending within itself (Swin
without the shift).

``window_size`` (an int, or a (rows, columns) pair) cuts the H x W grid into windows; query
(r, c) attends to key (r', c') when r // wh == r' // wh and c // ww == c' // ww. Where the grid is
not a multiple of the window the last windows are smaller (Swin pads them instead). A 4 x 4 grid,
window_size=2, the windows by letter::

    a a b b
    a a b b
    c c d d
    c c d d

Aligned to the tiles of ``Tiles`` (a window of 8 x 8 and kernel blocks of 64), every block pair
is FULL or EMPTY: no mask is evaluated at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Spans, state_from
from .families import register_pattern
from .grid import GridPattern, crop_queries, int_pair, on_grid


def _same_window(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], w: int):
    """(some, every) pair on this axis in one window, for positions in [a0, a1] x [b0, b1]."""
    (a0, a1), (b0, b1) = (x // w for x in a), (x // w for x in b)
    return (a0 <= b1) & (b0 <= a1), (a0 == a1) & (b0 == b1) & (a0 == b0)


def _axis_dense(size: int, w: int) -> Tensor:
    window = torch.arange(size) // w
    return window[:, None] == window[None, :]


@dataclass(frozen=True)
class BlockLocal2D(GridPattern):
    """Key (r', c') is allowed for query (r, c) when both lie in the same window."""

    window_size: tuple[int, int] = (8, 8)
    grid: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "window_size", int_pair("window_size", self.window_size))
        self.check_grid()

    def fits(self, rows: int, cols: int) -> None:
        wh, ww = self.window_size
        if wh > rows or ww > cols:
            raise ValueError(
                f"window_size={self.window_size} is larger than grid=({rows}, {cols}); use a "
                "window that fits the grid"
            )

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        (qr, qc), (kr, kc) = self.rows_cols(q_pos), self.rows_cols(kv_pos)
        wh, ww = self.window_size
        return (qr // wh == kr // wh) & (qc // ww == kc // ww) & (q_pos >= 0)

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        qb, kb = self.boxes(q, k)
        wh, ww = self.window_size
        some_r, every_r = _same_window((qb.row_lo, qb.row_hi), (kb.row_lo, kb.row_hi), wh)
        some_c, every_c = _same_window((qb.col_lo, qb.col_hi), (kb.col_lo, kb.col_hi), ww)
        any_q, all_q = on_grid(q)
        return state_from(some_r & some_c & any_q, every_r & every_c & all_q, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        (h, w), (wh, ww) = self.grid, self.window_size
        return crop_queries(_axis_dense(h, wh), _axis_dense(w, ww), q_len)


@register_pattern("block_local_2d")
def block_local_2d(
    window_size: int | tuple[int, int] = 8, grid: tuple[int, int] | None = None
) -> BlockLocal2D:
    """Non-overlapping window_size windows of a grid of H x W tokens (row-major)."""
    return BlockLocal2D(window_size, grid)
