"""Block spans and their states: the positions in each block of a grid (``Spans``, with a 2-D
``Box``) and EMPTY / PARTIAL / FULL, which every pattern's ``block_state`` answers
(``zoo.patterns.base``) and ``zoo.patterns.derived`` computes from ``allowed``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class Spans:
    """The positions in each block of a grid: the progression lo, lo + step, ..., hi.

    Tensors have one entry per block and broadcast against each other (queries as a column, keys as
    a row). A block with no valid position has lo > hi. ``complete`` is False where a block holds
    padding slots; such a block is never FULL, so the mask sees the padding.

    A frame over a 2-D grid (``zoo.layout.tiles``) also gives each block's ``box``; its positions
    are then only known to lie in [lo, hi] (step 1), which every 1-D family's formulas treat
    conservatively.
    """

    lo: Tensor
    hi: Tensor
    step: int
    complete: Tensor
    box: Box | None = None
    # Known on the host: every span's positions lie in [c * aligned, (c + 1) * aligned) for
    # some c (a natural-order frame whose blocks start at multiples of their size); None where
    # not known. Lets a pattern answer without reading the bounds (ChosenBlocks).
    aligned: int | None = None

    @property
    def nonempty(self) -> Tensor:
        return self.lo <= self.hi

    def map(self, f: Callable[[Tensor], Tensor]) -> Spans:
        """These spans with ``f`` applied to each per-block tensor (their box's too)."""
        box = None if self.box is None else self.box.map(f)
        return Spans(f(self.lo), f(self.hi), self.step, f(self.complete), box, self.aligned)

    def column(self) -> Spans:
        return self.map(lambda t: t[:, None])

    def row(self) -> Spans:
        return self.map(lambda t: t[None, :])


@dataclass(frozen=True)
class Box:
    """Each block's rows row_lo, row_lo + row_step, ..., row_hi and columns likewise, on a grid
    ``width`` tokens wide (token t at row t // width, column t % width): a box that holds every
    valid position of the block, as frames over a grid (``zoo.layout.tiles``) know it."""

    row_lo: Tensor
    row_hi: Tensor
    col_lo: Tensor
    col_hi: Tensor
    row_step: int
    col_step: int
    width: int

    def map(self, f: Callable[[Tensor], Tensor]) -> Box:
        corners = (f(self.row_lo), f(self.row_hi), f(self.col_lo), f(self.col_hi))
        return Box(*corners, self.row_step, self.col_step, self.width)


def state_from(any_allowed: Tensor, all_allowed: Tensor, q: Spans, k: Spans) -> Tensor:
    """Combine 'some pair allowed' and 'every pair allowed' into EMPTY / PARTIAL / FULL.

    Blocks without a valid position are EMPTY and blocks with padding are at most PARTIAL, so a
    family's formulas need not think about either.
    """
    some = any_allowed & q.nonempty & k.nonempty
    full = some & all_allowed & q.complete & k.complete
    # EMPTY 0, PARTIAL 1, FULL 2, and full implies some: no int64 intermediate (a where on
    # Python ints made one, 8 bytes per block pair, before the cast).
    return some.to(torch.int8) + full
