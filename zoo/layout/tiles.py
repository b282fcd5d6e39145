"""The tiled token order of a grid: the frame in which 2-D patterns are block-sparse.

In row-major order a kernel block of 64 tokens is a strip of a row, and a 7 x 7 neighborhood
touches a strip from each of 7 rows: nearly every block pair is partly inside. Here each block is
a tile of the grid instead (a block of b slots is a th x tw tile, the squarest that does not pad
the grid much: 64 -> 8 x 8 and 128 -> 8 x 16 on a large grid, 1 x 64 on one row), so a
neighborhood touches the few tiles around its own.
With dilation (dh, dw) the residue classes are folded first, as NATTEN's token permutation does:
class (rh, rw) holds rows rh, rh + dh, ... and columns rw, rw + dw, ...; its tiles come one class
after another. A 4 x 6 grid, blocks of 4 (2 x 2 tiles)::

    grid positions        slots (| between blocks)
     0  1  2  3  4  5     [0 1 6 7 | 2 3 8 9 | 4 5 10 11 | 12 13 18 19 | ...]
     6  7  8  9 10 11
    12 13 14 15 16 17
    18 19 20 21 22 23

Tiles at the right and bottom edges that the grid does not fill are padded with invalid slots.
Queries at negative positions (more queries than keys; they attend nothing) come first, in order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..patterns.base import Box
from ..patterns.grid import Tiles

_FAR = 2**62


def tile_shape(block: int, rows: int | None = None, cols: int | None = None) -> tuple[int, int]:
    """(th, tw) with th * tw == block, as square as the block's divisors allow: a neighborhood
    then touches the fewest tiles. For a grid (of one residue class) of ``rows`` x ``cols``, the
    squarest of the shapes that pad it at most 1.25x as much as the least padding one: a grid of
    fewer rows than a square tile's would be mostly padding (a 1 x 512 grid in 8 x 8 tiles: 7 of
    every 8 slots)."""
    shapes = [(d, block // d) for d in range(1, block + 1) if block % d == 0]
    if rows is not None and cols is not None:
        padded = {(th, tw): -(-rows // th) * th * (-(-cols // tw) * tw) for th, tw in shapes}
        least = min(padded.values())
        shapes = [shape for shape in shapes if padded[shape] * 4 <= least * 5]
    return min(shapes, key=lambda s: (abs(s[0] - s[1]), s[0] > s[1]))


def tiled_slots(
    order: Tiles, length: int, start: int, block: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(index, position, valid, slot_of) of positions start .. start + length - 1 in tiled order."""
    (h, w), (dh, dw) = order.grid, order.dilation
    th, tw = tile_shape(block, -(-h // dh), -(-w // dw))  # one shape for every residue class
    stop = start + length
    positions, valids = [], []
    if start < 0:  # off-grid queries, in order, padded to whole blocks
        off = min(stop, 0) - start
        slots = torch.arange(-(-off // block) * block, device=device)
        positions.append(slots + start)
        valids.append(slots < off)
    for rh in range(dh):
        for rw in range(dw):
            rows = torch.arange(rh, h, dh, device=device)
            cols = torch.arange(rw, w, dw, device=device)
            tiles_h, tiles_w = -(-rows.numel() // th), -(-cols.numel() // tw)
            ti, tj, i, j = torch.meshgrid(
                *(torch.arange(n, device=device) for n in (tiles_h, tiles_w, th, tw)),
                indexing="ij",
            )
            r, c = (ti * th + i).flatten(), (tj * tw + j).flatten()
            inside = (r < rows.numel()) & (c < cols.numel())
            pos = rows[r.clamp(max=rows.numel() - 1)] * w + cols[c.clamp(max=cols.numel() - 1)]
            positions.append(pos)
            valids.append(inside & (pos >= start) & (pos < stop))
    position, valid = torch.cat(positions), torch.cat(valids)
    index = (position - start).clamp(0, length - 1)
    slot_of = torch.empty(length, dtype=torch.long, device=device)
    slot_of[index[valid]] = torch.nonzero(valid).flatten()
    return index, position, valid, slot_of


def block_boxes(order: Tiles, position: Tensor, valid: Tensor, block: int) -> Box:
    """Each block's rows and columns: one tile of one residue class, so the steps are the
    dilation."""
    w = order.grid[1]
    pos, ok = position.view(-1, block), valid.view(-1, block)

    def bounds(x: Tensor) -> tuple[Tensor, Tensor]:
        return torch.where(ok, x, _FAR).amin(dim=1), torch.where(ok, x, -_FAR).amax(dim=1)

    (r0, r1), (c0, c1) = bounds(pos // w), bounds(pos % w)
    return Box(r0, r1, c0, c1, order.dilation[0], order.dilation[1], w)
