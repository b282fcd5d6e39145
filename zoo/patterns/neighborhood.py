"""``neighborhood_2d``: each token of a grid attends to a kernel_size window around it (NATTEN).

NATTEN's definition (Hassani et al. 2023), applied to rows and to columns separately; a key is
allowed when it is allowed on both axes. On an axis of S cells with kernel k::

    left = k // 2,  right = k // 2 + k % 2 - 1
    centre(i) = clamp(i, left, S - 1 - right)     keys centre - left .. centre + right

so a query at the border sees a window shifted inward, exactly k keys, never fewer (k = 3, S = 6;
rows are queries, columns keys)::

    x x x . . .
    x x x . . .
    . x x x . .
    . . x x x .
    . . . x x x
    . . . x x x

``dilation`` d keeps a query within its residue class: the axis splits into the classes
{r, r + d, r + 2d, ...}, and the window above applies inside the query's class (S then counts the
cells of that class). ``causal_axes`` makes an axis causal: keys j <= i with i - j < k (in class
units), no shift at the border, so early queries see fewer keys. It is separate from the call's
1-D ``causal=``, which still means key position <= query position in row-major order.

Requires kernel_size * dilation <= S on each axis, as NATTEN does: every class then holds at least
k cells. Runs block-sparse in the tiled order of ``zoo.patterns.grid.Tiles``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Spans, state_from
from .families import register_pattern
from .grid import GridPattern, crop_queries, int_pair, on_grid, single_class


def _window(x: Tensor, cells: Tensor, k: int, causal: bool) -> tuple[Tensor, Tensor]:
    """First and last key (class units) of the window of query x in a class of ``cells`` cells."""
    if causal:
        return x - k + 1, x
    left, right = k // 2, k // 2 + k % 2 - 1
    centre = torch.minimum(x.clamp(min=left), cells - 1 - right)
    return centre - left, centre + right


def axis_allowed(i: Tensor, j: Tensor, size: int, k: int, d: int, causal: bool) -> Tensor:
    cells = (size - i % d + d - 1) // d  # cells in i's residue class
    lo, hi = _window(i // d, cells, k, causal)
    return ((i - j) % d == 0) & (j // d >= lo) & (j // d <= hi)


def axis_state(
    a: tuple[Tensor, Tensor, int], b: tuple[Tensor, Tensor, int], size: int, k: int, d: int,
    causal: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(some, every) pair allowed on this axis, for queries at a0, a0 + sa, ..., a1 and keys at
    b0, ..., b1. Windows move monotonically with the query, so the union of the windows of a0..a1
    runs from a0's first key to a1's last, and their intersection from a1's first to a0's last."""
    (a0, a1, sa), (b0, b1, sb) = a, b
    reach = (k - 1) * d
    loose = (b1 >= a0 - reach) & (b0 <= (a1 if causal else a1 + reach))  # classes mixed
    single = single_class(a0, a1, sa, d) & single_class(b0, b1, sb, d)
    same = single & ((a0 - b0) % d == 0)
    cells = (size - a0 % d + d - 1) // d
    first_lo, first_hi = _window(a0 // d, cells, k, causal)
    last_lo, last_hi = _window(a1 // d, cells, k, causal)
    some = torch.where(single, same & (b1 // d >= first_lo) & (b0 // d <= last_hi), loose)
    every = same & (b0 // d >= last_lo) & (b1 // d <= first_hi)
    return some, every


def axis_dense(size: int, k: int, d: int, causal: bool) -> Tensor:
    """[size, size] allowed on one axis, from NATTEN's start-index form (an independent check)."""
    mask = torch.zeros(size, size, dtype=torch.bool)
    left, right = k // 2, k // 2 + k % 2 - 1
    for i in range(size):
        members = list(range(i % d, size, d))  # i's residue class
        x = members.index(i)
        if causal:
            keys = members[max(0, x - k + 1) : x + 1]
        else:
            start = max(x - left, 0)
            if x + right >= len(members):
                start = len(members) - k
            keys = members[start : start + k]
        mask[i, keys] = True
    return mask


@dataclass(frozen=True)
class Neighborhood2D(GridPattern):
    """Key (r', c') is allowed for query (r, c) when r' is in r's window and c' in c's."""

    kernel_size: tuple[int, int] = (7, 7)
    dilation: tuple[int, int] = (1, 1)
    causal_axes: tuple[bool, bool] = (False, False)
    grid: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_size", int_pair("kernel_size", self.kernel_size))
        object.__setattr__(self, "dilation", int_pair("dilation", self.dilation))
        axes = self.causal_axes
        if not isinstance(axes, list | tuple) or len(axes) != 2:
            raise ValueError(f"causal_axes must be a (rows, columns) pair of bools, got {axes!r}")
        if not all(isinstance(a, bool) for a in axes):
            raise ValueError(f"causal_axes must hold bools (True: causal on an axis), got {axes!r}")
        object.__setattr__(self, "causal_axes", tuple(axes))
        self.check_grid()

    def fits(self, rows: int, cols: int) -> None:
        for axis, size, k, d in zip(("rows", "columns"), (rows, cols), self.kernel_size,
                                    self.dilation, strict=True):  # fmt: skip
            if k * d > size:
                raise ValueError(
                    f"kernel_size={self.kernel_size} with dilation={self.dilation} needs "
                    f"kernel_size * dilation <= {size} {axis} of grid=({rows}, {cols}); use a "
                    "smaller kernel or dilation, or a larger grid"
                )

    def _axes(self):
        self._width()  # a clear error before specialize has chosen the grid
        return zip(self.grid, self.kernel_size, self.dilation, self.causal_axes, strict=True)

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        (qr, qc), (kr, kc) = self.rows_cols(q_pos), self.rows_cols(kv_pos)
        (h, kh, dh, ch), (w, kw, dw, cw) = self._axes()
        rows = axis_allowed(qr, kr, h, kh, dh, ch)
        return rows & axis_allowed(qc, kc, w, kw, dw, cw) & (q_pos >= 0)

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        qb, kb = self.boxes(q, k)
        (h, kh, dh, ch), (w, kw, dw, cw) = self._axes()
        row = ((qb.row_lo, qb.row_hi, qb.row_step), (kb.row_lo, kb.row_hi, kb.row_step))
        col = ((qb.col_lo, qb.col_hi, qb.col_step), (kb.col_lo, kb.col_hi, kb.col_step))
        some_r, every_r = axis_state(*row, h, kh, dh, ch)
        some_c, every_c = axis_state(*col, w, kw, dw, cw)
        any_q, all_q = on_grid(q)
        return state_from(some_r & some_c & any_q, every_r & every_c & all_q, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        (h, kh, dh, ch), (w, kw, dw, cw) = self._axes()
        rows, cols = axis_dense(h, kh, dh, ch), axis_dense(w, kw, dw, cw)
        return crop_queries(rows, cols, q_len)


@register_pattern("neighborhood_2d")
def neighborhood_2d(
    kernel_size: int | tuple[int, int] = 7,
    dilation: int | tuple[int, int] = 1,
    causal_axes: tuple[bool, bool] = (False, False),
    grid: tuple[int, int] | None = None,
) -> Neighborhood2D:
    """NATTEN's 2-D neighborhood attention on a grid of H x W tokens (row-major)."""
    return Neighborhood2D(kernel_size, dilation, causal_axes, grid)
