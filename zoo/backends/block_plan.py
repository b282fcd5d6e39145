"""What the blocked backend gathers for each group of query blocks, computed once per shape.

A plan depends on the pattern part and the frame only (key padding and data come per call), so
it is cached: the gather indices, the positions, and the mask of pairs the pattern forbids.

Where a group's rows are consecutive query blocks and each needs the key blocks of a sliding
band (row r: blocks r + lo .. r + lo + W - 1, as in local and sliding-window patterns), the plan
says so (``Window``): the backend then reads overlapping windows of the keys as a strided view
(``unfold``) instead of copying W blocks per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..frames import Frame
from ..layout import build_layout, used_first
from ..patterns import EMPTY, Pattern
from ..shape_cache import per_shape


def gather_blocks(x: Tensor, index: Tensor, width: int, block: int) -> Tensor:
    """(B, H, slots, D) -> (B, H, R, width * block, D): the blocks ``index`` names, R * width of
    them in row order. index_select, whose backward is an index_add, not a scatter."""
    blocks = x.unflatten(2, (-1, block)).index_select(2, index)  # (B, H, R * width, block, D)
    return blocks.unflatten(2, (-1, width)).flatten(3, 4)


@dataclass(frozen=True)
class Window:
    """Rows first .. first + R - 1 read key blocks row + lo .. row + lo + width - 1 (blocks
    before 0 or past the end are padding)."""

    first: int
    lo: int
    width: int


def key_windows(x: Tensor, window: Window, rows: int, block: int) -> Tensor:
    """(H, slots, D) -> (rows, H, width * block, D): overlapping windows as a strided view of
    x padded with whole blocks, without copying them (unfold's backward adds overlaps back)."""
    blocks = x.shape[1] // block
    front = max(0, -(window.first + window.lo))
    back = max(0, window.first + window.lo + rows - 1 + window.width - blocks)
    padded = torch.nn.functional.pad(x, (0, 0, front * block, back * block))
    windows = padded.unflatten(1, (-1, block)).unfold(1, window.width, 1)  # (H, n, bk, D, W)
    windows = windows.narrow(1, window.first + window.lo + front, rows)
    return windows.permute(1, 0, 4, 2, 3).flatten(2, 3)  # (rows, H, W * bk, D)


def band_window(rows: Tensor, kv_blocks: Tensor, used: Tensor, waste: float) -> Window | None:
    """The band that covers a group's key blocks, if its rows are consecutive and the band wastes
    no more than ``waste`` of the blocks it reads."""
    order = torch.argsort(rows)
    rows, kv_blocks, used = rows[order], kv_blocks[order], used[order]
    count = rows.numel()
    if int(rows[-1] - rows[0]) + 1 != count:
        return None
    relative = torch.where(used, kv_blocks - rows[:, None], 0)
    lo = int(torch.where(used, relative, relative.max() + 1).min())
    width = int(relative.max()) - lo + 1
    if count * width > (1 + waste) * int(used.sum()):
        return None
    return Window(int(rows[0]), lo, width)


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """One group of query blocks that need about as many key blocks (``row_groups``)."""

    rows: Tensor  # (R,) query blocks
    kv_index: Tensor  # (R * W,) key blocks, row by row
    width: int  # W
    k_slot: Tensor  # (R, W * bk) key slots in the frame
    q_pos: Tensor  # (R, bq, 1) query positions
    k_pos: Tensor  # (R, 1, W * bk) key positions
    masked: Tensor  # (R, bq, W * bk) True where the pattern forbids the pair or the slot is padding
    window: Window | None = None  # when set, rows are consecutive and keys come as a band

    def gather(
        self, q: Tensor, k: Tensor, v: Tensor, frame: Frame
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(B, H, slots, D) each -> this group's query blocks (B, H, R, bq, D) and key and value
        blocks (B, H, R, W * bk, D)."""
        q_blocks = q.unflatten(2, (-1, frame.q.block)).index_select(2, self.rows)
        k_blocks = gather_blocks(k, self.kv_index, self.width, frame.k.block)
        v_blocks = gather_blocks(v, self.kv_index, self.width, frame.k.block)
        return q_blocks, k_blocks, v_blocks

    def masked_with(self, padded: Tensor | None) -> Tensor:
        """The mask with a call's key padding (B, slots) added: (B or 1, R, bq, W * bk)."""
        if padded is None:
            return self.masked[None]
        return self.masked[None] | padded[:, self.k_slot][:, :, None, :]

    def additive(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """The mask as SDPA takes it, (R, 1, bq, W * bk) of 0 and -inf, built once per dtype; and
        (R, 1, bq, 1) True where a query has some key, or None when all do. A query with no key
        sees every slot (the kernel would divide 0 by 0) and its output is zeroed after."""
        return additive_mask(self, dtype)


@per_shape(maxsize=1024)
def additive_mask(group: GroupPlan, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """``GroupPlan.additive``, built outside any traced graph: whether every query has a key is a
    tensor's value, which a graph cannot branch on."""
    has_key = ~group.masked.all(dim=-1, keepdim=True)
    mask = torch.zeros(group.masked.shape, dtype=dtype, device=group.masked.device)
    mask = mask.masked_fill(group.masked & has_key, float("-inf"))[:, None]
    return mask, None if bool(has_key.all()) else has_key[:, None]


def _group(
    part: Pattern,
    frame: Frame,
    rows: Tensor,
    kv_blocks: Tensor,
    used: Tensor,
    window: Window | None,
) -> GroupPlan:
    bq, bk = frame.q.block, frame.k.block
    offsets = torch.arange(bk, device=kv_blocks.device)
    k_slot = (kv_blocks.clamp(0, frame.k.num_blocks - 1)[..., None] * bk + offsets).flatten(1)
    q_pos = frame.q.position.view(-1, bq)[rows][:, :, None]
    k_pos = frame.k.position[k_slot][:, None, :]
    usable = used.repeat_interleave(bk, dim=1) & frame.k.valid[k_slot]  # (R, W * bk)
    masked = ~(part.allowed(q_pos, k_pos) & usable[:, None, :])
    flat = kv_blocks.clamp(0, frame.k.num_blocks - 1).flatten()
    return GroupPlan(rows, flat, kv_blocks.shape[1], k_slot, q_pos, k_pos, masked, window)


def _window_group(part: Pattern, frame: Frame, window: Window, count: int) -> GroupPlan:
    rows = window.first + torch.arange(count, device=frame.q.position.device)
    kv_blocks = rows[:, None] + window.lo + torch.arange(window.width, device=rows.device)
    used = (kv_blocks >= 0) & (kv_blocks < frame.k.num_blocks)
    return _group(part, frame, rows, kv_blocks, used, window)


@per_shape(maxsize=256)
def plan(part: Pattern, frame: Frame, waste: float) -> list[GroupPlan]:
    """The row groups of a part's layout in its frame, with gather indices and masks: one band
    window for the whole layout where it is a band, else row groups (``BlockLayout.row_groups``),
    each a band window where it can be."""
    layout = build_layout(part, frame)
    banded = frame.q.block == frame.k.block
    used = layout.state != EMPTY
    rows = torch.nonzero(used.any(dim=1)).flatten()
    if banded and rows.numel():
        kv_order = used_first(used[rows])
        whole = band_window(rows, kv_order, used[rows].gather(1, kv_order), waste)
        if whole is not None:
            return [_window_group(part, frame, whole, rows.numel())]
    plans = []
    for group in layout.row_groups(waste):
        window = band_window(group.rows, group.kv_blocks, group.used, waste) if banded else None
        if window is None:
            plans.append(_group(part, frame, group.rows, group.kv_blocks, group.used, None))
        else:
            plans.append(_window_group(part, frame, window, group.rows.numel()))
    return plans
