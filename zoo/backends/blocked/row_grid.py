"""A piece's query rows as a grid of the merged output's rows, where they lie on one.

``lse_merge`` writes each piece's output into the rows its queries belong to. Where a piece's
(N, M) queries go to rows offset + n * across + m * along, evenly spaced in n-major order (a
band's consecutive query blocks: along 1, across the block) or in m-major order (a residue
order's tokens, token r + s * t at (r, t): across 1, along the stride s), the rows are a view
of the output, read and written in place instead of gathered and scattered by index, which
were a noticeable share of strided attention's forward on a CPU
(measured: eval/results/design-notes-cpu.md#row-grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RowGrid:
    """A piece's rows (N, M) as a grid of the output's: row offset + n * across + m * along."""

    offset: int
    across: int
    along: int

    def view(self, x: Tensor, n: int, m: int) -> Tensor:
        """The rows of x (rows, ...) on this grid as an (n, m, ...) view of x: every step-th row
        from the offset, in n-major order (along * m == across) or m-major (across * n ==
        along), then transposed. Slices and reshapes only: ``torch.compile`` cannot trace a write
        through ``as_strided``, nor through ``unfold`` (it overlaps)."""
        n_major = self.along * m == self.across
        step, shape = (self.along, (n, m)) if n_major else (self.across, (m, n))
        rows = x.narrow(0, self.offset, (n * m - 1) * step + 1)[::step].unflatten(0, shape)
        return rows if n_major else rows.transpose(0, 1)


def row_grid(rows: Tensor, total: int) -> RowGrid | None:
    """The grid of rows (N, M), or None where they lie on none that ``RowGrid.view`` reads, or some
    are dropped (== total). Reads the rows' values: call it where a plan is built, not in a traced
    graph."""
    n, m = rows.shape
    if rows.numel() == 0 or bool((rows >= total).any()):
        return None
    offset = int(rows[0, 0])
    across = int(rows[1, 0]) - offset if n > 1 else None
    along = int(rows[0, 1]) - offset if m > 1 else None
    if along is None:  # one query per piece row: a single column, read m-major
        along = 1 if across is None else across * n
    if across is None:  # a single row, read n-major
        across = along * m
    if min(along, across) < 1 or (along * m != across and across * n != along):
        return None  # not one of the two orders that ``view`` reads
    n_index = torch.arange(n, device=rows.device)[:, None]
    grid = offset + n_index * across + torch.arange(m, device=rows.device) * along
    return RowGrid(offset, across, along) if bool((grid == rows).all()) else None
