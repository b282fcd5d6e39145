"""Token orders for block-sparse kernels.

A kernel works on blocks of consecutive slots. A *frame* says which token sits in each slot: in
the natural frame (stride 1) slot t holds token t, and the axes are padded to whole blocks. In the
frame of stride s, tokens are regrouped by position mod s (s groups, each in position order and
padded to whole blocks), which turns strided and dilated patterns into dense or banded blocks::

    positions 0..7, stride 2, blocks of 2:   slots [0 2 | 4 6 | 1 3 | 5 7]

Padding slots are marked invalid; masks exclude them and outputs drop them. A frame's order is an
int stride, or a ``Tiles`` order of a grid (``zoo.layout.tiles``), in which 2-D patterns are sparse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..backends.blocked.index_rows import index_rows
from ..core.narrowed import narrowed
from ..core.shape_cache import per_shape
from ..patterns.base import Spans
from ..patterns.grid import Tiles
from .tiles import block_boxes, tiled_slots

_FAR = 2**62  # larger than any position; marks the bounds of blocks with no valid slot


@dataclass(frozen=True, eq=False)
class Axis:
    """One side (queries or keys) of a frame."""

    length: int  # tokens in the original order
    index: Tensor  # [slots] original token of each slot (0 for padding slots)
    position: Tensor  # [slots] position of each slot's token
    valid: Tensor  # [slots] False for padding slots
    slot_of: Tensor  # [length] the slot of each original token
    block: int
    step: int
    tiles: Tiles | None = None  # the grid order whose tiles the blocks are, if any
    # stride frame whose first group starts at the first token: slot r * G + t holds token
    # t * step + r, so the order is a transpose of the tokens padded to step * G (see gather)
    aligned: bool = False
    start: int = 0  # the first token's position (natural order: slot t holds start + t)

    @property
    def slots(self) -> int:
        return self.index.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.slots // self.block

    @property
    def identity(self) -> bool:
        """Slot t holds token t (only padding added at the end)."""
        return self.step == 1 and self.tiles is None

    def spans(self, size: int | None = None) -> Spans:
        """The progression of valid positions in each block, or in each run of ``size`` slots
        (a divisor of the block: a block's parts, which lie in one group of a stride's order
        and in one tile of a grid's)."""
        size = self.block if size is None else size
        if self.block % size:
            raise ValueError(f"size must divide the frame's block of {self.block}, got {size}")
        pos = self.position.view(-1, size)
        valid = self.valid.view(-1, size)
        lo = torch.where(valid, pos, _FAR).amin(dim=1)
        hi = torch.where(valid, pos, -_FAR).amax(dim=1)
        box = None if self.tiles is None else block_boxes(self.tiles, pos, valid, size)
        # A block of one slot lies in [p, p + 1) for its position p, in any order.
        whole = size == 1 or (self.identity and self.start % size == 0)
        aligned = size if whole else None
        return Spans(lo, hi, self.step, valid.all(dim=1), box, aligned)

    def gather(self, x: Tensor, dim: int = -2) -> Tensor:
        """Tokens of ``x`` (original order along ``dim``) placed into this frame's slots; padding
        slots hold zeros, or the last token where the frame is not a transpose."""
        if self.identity:
            return _padded(x, dim, self.slots)
        # A transposing copy: faster than index_select on a CPU
        # (measured: eval/results/design-notes-cpu.md#frames-transposing-copy).
        if self.aligned:
            dim, groups = dim % x.dim(), self.slots // self.step
            x = _padded(x, dim, self.slots).unflatten(dim, (groups, self.step))
            return x.transpose(dim, dim + 1).flatten(dim, dim + 1)
        return index_rows(x, dim, self.index)

    def scatter(self, x: Tensor, dim: int = -2) -> Tensor:
        """Slots of ``x`` back into the original order (padding slots dropped)."""
        if self.identity:
            return narrowed(x, dim, 0, self.length)
        if self.aligned:
            dim, groups = dim % x.dim(), self.slots // self.step
            x = x.unflatten(dim, (self.step, groups)).transpose(dim, dim + 1).flatten(dim, dim + 1)
            return narrowed(x, dim, 0, self.length)
        return index_rows(x, dim, self.slot_of)


def _padded(x: Tensor, dim: int, length: int) -> Tensor:
    """``x`` with zeros appended along ``dim`` up to ``length``."""
    if x.shape[dim] == length:
        return x
    # cat, not F.pad: on a busy CPU, pad's threaded fill was far slower than cat's copy
    # (measured: eval/results/design-notes-cpu.md#frames-cat-not-pad).
    tail = list(x.shape)
    tail[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(tail)], dim=dim)


def _axis(length: int, start: int, stride: int | Tiles, block: int, device: torch.device) -> Axis:
    """Positions start .. start + length - 1 regrouped by position mod ``stride``, or in tiles."""
    if isinstance(stride, Tiles):
        return Axis(length, *tiled_slots(stride, length, start, block, device), block, 1, stride)
    if stride == 1:
        slots = -(-length // block) * block
        t = torch.arange(slots, device=device)
        valid = t < length
        return Axis(
            length, t.clamp(max=length - 1), t + start, valid, t[:length], block, 1, start=start
        )
    base = start // stride * stride  # first position of group 0 at or before `start`
    group_len = -(-(start + length - base) // stride)
    padded = -(-group_len // block) * block
    slot = torch.arange(stride * padded, device=device)
    residue, t = slot // padded, slot % padded
    position = base + t * stride + residue
    valid = (t < group_len) & (position >= start) & (position < start + length)
    index = (position - start).clamp(0, length - 1)
    p = torch.arange(length, device=device) + start - base
    slot_of = (p % stride) * padded + p // stride
    return Axis(length, index, position, valid, slot_of, block, stride, aligned=base == start)


@dataclass(frozen=True, eq=False)
class Frame:
    """Query and key axes in one token order (compared by identity; built once per shape)."""

    q: Axis
    k: Axis
    stride: int | Tiles


@per_shape(maxsize=256)
def build_frame(
    stride: int | Tiles, q_len: int, kv_len: int, block_q: int, block_k: int, device: torch.device
) -> Frame:
    """The frame of ``stride`` for these lengths, with queries aligned to the keys' end."""
    return Frame(
        _axis(q_len, kv_len - q_len, stride, block_q, device),
        _axis(kv_len, 0, stride, block_k, device),
        stride,
    )
