"""What the 2-D patterns share: the grid parameter, its token order, and each block's box.

Tokens lie on a grid of H rows and W columns in row-major order: token t sits at row t // W,
column t % W, and the sequence holds exactly H * W keys. ``grid=None`` takes the most nearly square
grid with H <= W (64 tokens: 8 x 8; 96: 8 x 12). Queries align bottom-right as everywhere in the
zoo (``zoo.patterns.base``): with fewer queries than keys they are the last grid cells; a query at a
negative position (more queries than keys) is off the grid and attends to nothing.

A 2-D window is not block-sparse in row-major order: 8 consecutive tokens of a 64-wide grid are a
strip of one row. ``Tiles`` names the token order in which it is (``zoo.layout.tiles`` builds it):
tiles of the grid made contiguous, each block one tile, and with dilation the residue classes folded
first, as NATTEN's token permutation does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..core.arguments import check_int
from .base import Box, Pattern, Spans


def int_pair(name: str, value: object, minimum: int = 1) -> tuple[int, int]:
    """An int or an (H-axis, W-axis) pair as a pair of ints of at least ``minimum``."""
    if isinstance(value, list | tuple):
        if len(value) != 2:
            raise ValueError(f"{name} must be an int or a (rows, columns) pair, got {value!r}")
        return (
            check_int(f"{name}[0]", value[0], minimum=minimum),
            check_int(f"{name}[1]", value[1], minimum=minimum),
        )
    n = check_int(name, value, minimum=minimum)
    return n, n


def square_grid(n: int) -> tuple[int, int]:
    """The most nearly square (H, W) with H * W == n and H <= W."""
    h = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return h, n // h


@dataclass(frozen=True)
class Tiles:
    """The tiled token order of a grid (see ``zoo.layout.tiles``): a pattern's ``stride`` names
    it."""

    grid: tuple[int, int]
    dilation: tuple[int, int] = (1, 1)


def box_of(spans: Spans, width: int) -> Box:
    """The box of rows and columns that holds each block's positions: the frame's own box on this
    grid, or one derived from [lo, hi] (a run of several rows may hold any column)."""
    if spans.box is not None and spans.box.width == width:
        return spans.box
    lo = torch.clamp(spans.lo, min=0)  # off-grid queries (negative positions) attend nothing
    hi = torch.maximum(spans.hi, lo)
    r0, r1 = lo // width, hi // width
    one_row = r0 == r1
    c0 = torch.where(one_row, lo % width, 0)
    c1 = torch.where(one_row, hi % width, width - 1)
    return Box(r0, r1, c0, c1, 1, 1, width)


def single_class(lo: Tensor, hi: Tensor, step: int, d: int) -> Tensor:
    """Whether lo, lo + step, ..., hi all lie in one residue class mod d."""
    return (lo == hi) | torch.full_like(lo, step % d == 0, dtype=torch.bool)


def on_grid(q: Spans) -> tuple[Tensor, Tensor]:
    """(some, every) query of the block sits on the grid (at a position >= 0)."""
    return q.hi >= 0, q.lo >= 0


class GridPattern(Pattern):
    """Base of the 2-D patterns: subclasses are frozen dataclasses with a ``grid`` field and a
    ``dilation`` pair, and check their own sizes against the grid in ``fits``."""

    grid: tuple[int, int] | None
    dilation: tuple[int, int] = (1, 1)

    @property
    def stride(self) -> Tiles | int:  # type: ignore[override]
        return self.__dict__["_order"]

    def check_grid(self) -> None:
        """Check ``grid`` and make the token order once: a traced graph reads it, and an object
        made inside the graph could not be handed to the per-shape builders
        (zoo.core.shape_cache)."""
        grid = check_grid(self.grid)
        object.__setattr__(self, "grid", grid)
        order = 1 if grid is None else Tiles(grid, self.dilation)
        object.__setattr__(self, "_order", order)

    def fits(self, rows: int, cols: int) -> None:
        """Raise ValueError where the pattern's sizes do not fit a grid of rows x cols."""

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        grid = square_grid(kv_len) if self.grid is None else self.grid
        if self.grid is None and grid[0] == 1 < kv_len:  # a prime: one row, a 1-D pattern
            raise ValueError(
                f"grid=None: {kv_len} keys make no grid of more than one row ({kv_len} is "
                f"prime), so the 2-D pattern would be a 1-D one; pass grid=(H, W) (H = 1 for "
                f"one row on purpose)"
            )
        if grid[0] * grid[1] != kv_len:
            raise ValueError(
                f"grid={self.grid!r} has {grid[0] * grid[1]} cells but the sequence has {kv_len} "
                f"keys; pass grid=(H, W) with H * W == {kv_len} (tokens in row-major order)"
            )
        self.fits(*grid)
        return self if grid == self.grid else replace(self, grid=grid)

    def rows_cols(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        width = self._width()
        return pos // width, pos % width

    def _width(self) -> int:
        if self.grid is None:
            raise TypeError(
                f"{type(self).__name__} needs its grid first: pass grid=(H, W) or call "
                "specialize(q_len, kv_len)"
            )
        return self.grid[1]

    def boxes(self, q: Spans, k: Spans) -> tuple[Box, Box]:
        width = self._width()
        return box_of(q, width), box_of(k, width)


def crop_queries(rows: Tensor, cols: Tensor, q_len: int) -> Tensor:
    """The [q_len, H * W] mask of ``rows`` [H, H] and ``cols`` [W, W] (a key allowed on both
    axes), for q_len bottom-right aligned queries; rows of off-grid queries allow nothing."""
    h, w = rows.shape[0], cols.shape[0]
    mask = (rows[:, None, :, None] & cols[None, :, None, :]).reshape(h * w, h * w)
    if q_len <= h * w:
        return mask[h * w - q_len :]
    return torch.cat([mask.new_zeros(q_len - h * w, h * w), mask])


def check_grid(grid: object) -> tuple[int, int] | None:
    """``grid`` as an (H, W) pair of positive ints, or None (a square grid from the length)."""
    if grid is None:
        return None
    if not isinstance(grid, list | tuple) or len(grid) != 2:
        raise ValueError(f"grid must be an (H, W) pair (tokens in row-major order), got {grid!r}")
    return int_pair("grid", grid)
