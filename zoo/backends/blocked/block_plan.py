"""What the blocked backend reads for each group of query blocks, computed once per shape.

A plan depends on the pattern part and the frame only (key padding and data come per call), so
it is cached: the gather indices, the positions, and the mask of pairs the pattern forbids.

A group's keys come from up to three sources, side by side in one mask::

    row r reads   [ band: blocks r+lo .. r+lo+W-1 | shared: blocks S | extra: its own blocks ]
                    a strided view, no copy         one copy, all rows  gathered per row

- the **band** (``Window``): where consecutive rows need the blocks of a sliding band (local and
  sliding-window patterns, the window of Longformer and BigBird), read as overlapping windows of
  the keys (``key_windows``) instead of copying W blocks per row;
- **shared** blocks: key blocks most of the group's rows need outside the band (the global
  columns of Longformer and BigBird), read once and expanded over the rows; only their slots
  that some query uses are read (Longformer's one global token: one column, not a block);
- **extra** blocks: the rest (BigBird's random blocks), gathered per row, padded to the widest.

A pair belongs to one source only: a shared block is masked in the rows whose band holds it.
Rows that need most key blocks (global rows) and rows whose band would leave the key range (the
first and last few) are grouped apart (``BlockLayout.row_groups``) and gathered whole.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ...core.shape_cache import per_shape
from ...layout.block_layout import BlockLayout, build_layout
from ...layout.frames import Frame, build_frame
from ...patterns import EMPTY, Pattern
from .index_rows import index_rows
from .key_windows import KeyWindows, key_windows
from .wide_queries import WideSplit, split_wide_queries


@dataclass(frozen=True)
class Window:
    """Rows first .. first + R - 1 read key blocks row + lo .. row + lo + width - 1, all of them
    inside the key range."""

    first: int
    lo: int
    width: int


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """One group of query blocks and the key blocks each reads (see the module docstring)."""

    rows: Tensor  # (R,) query blocks
    kv_blocks: Tensor  # (R, W + S + E) each row's key blocks: band, shared, extra
    k_slot: Tensor  # (R, C) key slots in the frame, C = W * bk + P + E * bk columns
    q_pos: Tensor  # (R, bq, 1) query positions
    k_pos: Tensor  # (R, 1, C) key positions
    masked: Tensor  # (R, bq, C) True where the pattern forbids the pair or another source
    # holds it, or the slot is padding
    widths: tuple[int, int, int]  # columns from the band (W * bk), shared (P), extra (E * bk)
    window: Window | None = None  # the band; rows are then consecutive
    shared: Tensor | None = None  # (P,) the key slots of the shared blocks that some row uses
    q_slot: Tensor | None = None  # (1, G) a query group's query slots (``wide_queries``);
    # its ``rows`` then holds the block of the first one only
    all_keys: bool = False  # one row reading every key slot in order: k itself, not a copy

    @property
    def width(self) -> int:
        """Key blocks per row."""
        return self.kv_blocks.shape[1]

    def query_slots(self, block: int) -> Tensor:
        """(R, bq or G) the frame slot of each query."""
        if self.q_slot is not None:
            return self.q_slot
        return self.rows[:, None] * block + torch.arange(block, device=self.rows.device)

    def gather(
        self, q: Tensor, k: Tensor, v: Tensor, frame: Frame
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(B, H, slots, D) each -> this group's query blocks (B, H, R, bq, D) and keys and
        values (B, H, R, C, D), every source copied."""
        if self.q_slot is None:
            q_rows = index_rows(q.unflatten(2, (-1, frame.q.block)), 2, self.rows)
        else:
            q_rows = index_rows(q, 2, self.q_slot.flatten()).unflatten(2, self.q_slot.shape)
        if self.all_keys:
            return q_rows, k.unsqueeze(2), v.unsqueeze(2)
        index = self.k_slot.flatten()
        k_cols, v_cols = (index_rows(x, 2, index).unflatten(2, self.k_slot.shape) for x in (k, v))
        return q_rows, k_cols, v_cols

    def band(self, block: int) -> KeyWindows | None:
        """The band source as key windows, one per row of the group; None without a band."""
        if not self.widths[0]:
            return None
        return KeyWindows((self.window.first + self.window.lo) * block, self.window.width, block)

    def key_sources(self, x: Tensor, block: int, band_view: bool = True) -> list[Tensor]:
        """One sequence's keys or values (H, slots, D) as the group's sources, each (R, H,
        columns, D): the band as a view (or, without ``band_view``, x itself, which the caller
        reads through ``band``), the shared slots expanded, the extra blocks gathered."""
        band, shared, extra = self.widths
        rows = self.rows.numel()
        out = []
        if band:
            out.append(key_windows(x, self.band(block), rows) if band_view else x)
        if shared:
            cols = index_rows(x, 1, self.shared)
            out.append(cols.expand(rows, *cols.shape))
        if extra:
            index = self.k_slot[:, band + shared :].flatten()
            out.append(index_rows(x, 1, index).unflatten(1, (rows, extra)).transpose(0, 1))
        return out

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
    usable: Tensor,
    window: Window | None = None,
    shared: Tensor | None = None,
    q_slot: Tensor | None = None,
) -> GroupPlan:
    """A group reading ``kv_blocks`` (R, width), of which ``usable`` (R, width) may hold pairs;
    its queries are the blocks ``rows``, or the slots ``q_slot`` (1, G)."""
    bq, bk = frame.q.block, frame.k.block
    kv_blocks = kv_blocks.clamp(0, frame.k.num_blocks - 1)
    offsets = torch.arange(bk, device=kv_blocks.device)
    k_slot = (kv_blocks[..., None] * bk + offsets).flatten(1)
    if q_slot is None:
        q_pos = frame.q.position.view(-1, bq)[rows][:, :, None]
    else:
        q_pos = frame.q.position[q_slot][:, :, None]
    k_pos = frame.k.position[k_slot][:, None, :]
    usable = usable.repeat_interleave(bk, dim=1) & frame.k.valid[k_slot]  # (R, width * bk)
    masked = ~(part.allowed(q_pos, k_pos) & usable[:, None, :])
    widths = (0, 0, k_slot.shape[1])
    if window is not None:
        widths = (window.width * bk, 0 if shared is None else shared.numel() * bk, 0)
        widths = (*widths[:2], k_slot.shape[1] - sum(widths))
    every = torch.arange(frame.k.slots, device=k_slot.device)
    all_keys = k_slot.shape == (1, frame.k.slots) and bool((k_slot[0] == every).all())
    group = GroupPlan(
        rows, kv_blocks, k_slot, q_pos, k_pos, masked, widths, window, None, q_slot, all_keys
    )
    return group if shared is None else _used_shared_slots(group)


def _used_shared_slots(group: GroupPlan) -> GroupPlan:
    """The group with only the shared slots that some query uses: Longformer's one global token
    is 1 column, not the 64 of its block, whose piece was a sizeable share of Longformer's forward
    on a CPU (measured: eval/results/design-notes-cpu.md#used-shared-slots)."""
    band, shared, extra = group.widths
    unused = group.masked[:, :, band : band + shared].all(dim=1).all(dim=0)
    ones = functools.partial(torch.ones, dtype=torch.bool, device=unused.device)
    keep = torch.cat([ones(band), ~unused, ones(extra)])
    columns = torch.nonzero(keep).flatten()
    used = int(keep[band : band + shared].sum())
    return GroupPlan(
        group.rows, group.kv_blocks, group.k_slot[:, columns], group.q_pos,
        group.k_pos[:, :, columns], group.masked[:, :, columns], (band, used, extra),
        group.window, group.k_slot[0, band : band + shared][~unused] if used else None,
        group.q_slot,
    )  # fmt: skip


def find_band(used: Tensor, rows: Tensor, waste: float) -> tuple[int, int] | None:
    """(lo, width) of the band of offsets (key block - query block) that at least 1 - waste of
    these rows use, around the most used offset; None where no offset is that common."""
    shift = used.shape[0]  # offsets run from -(query blocks - 1) up
    offsets = torch.arange(used.shape[1], device=used.device)[None, :] - rows[:, None]
    counts = torch.bincount(offsets[used[rows]] + shift)
    common = (counts >= (1 - waste) * rows.numel()).tolist()
    if not any(common):
        return None
    peak = int(counts.argmax())
    if not common[peak]:
        return None
    lo = hi = peak
    while lo > 0 and common[lo - 1]:
        lo -= 1
    while hi + 1 < len(common) and common[hi + 1]:
        hi += 1
    return lo - shift, hi - lo + 1


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive integers in a sorted list, as (first, count)."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs


def _band_group(part: Pattern, frame: Frame, used: Tensor, window: Window, count: int, waste):
    """Rows window.first .. + count - 1: the band, the blocks most of them use besides it
    (shared) and each row's remaining blocks (extra)."""
    device = used.device
    rows = window.first + torch.arange(count, device=device)
    band = rows[:, None] + window.lo + torch.arange(window.width, device=device)
    outside = used[rows].clone()
    outside.scatter_(1, band, False)
    is_shared = outside.float().mean(dim=0) >= 1 - waste
    shared = torch.nonzero(is_shared).flatten()
    in_band = (shared[None, :] >= band[:, :1]) & (shared[None, :] <= band[:, -1:])
    extra_flags = outside & ~is_shared[None, :]
    width = int(extra_flags.sum(dim=1).max())
    order = torch.argsort(extra_flags.to(torch.int8), dim=1, descending=True, stable=True)
    extra = order[:, :width]
    extra_used = extra_flags.gather(1, extra)
    kv_blocks = torch.cat([band, shared.expand(count, -1), extra], dim=1)
    usable = torch.cat([torch.ones_like(band, dtype=torch.bool), ~in_band, extra_used], dim=1)
    return _group(part, frame, rows, kv_blocks, usable, window, shared if shared.numel() else None)


def _banded(
    layout: BlockLayout, used: Tensor, waste: float
) -> tuple[list[tuple[Window, int]], Tensor]:
    """The band windows of a layout with their row counts, and which rows they cover."""
    rows, wide, _ = _wide_rows(used)
    covered = torch.zeros(used.shape[0], dtype=torch.bool, device=used.device)
    if layout.block_q != layout.block_k or not rows.numel():
        return [], covered
    narrow = rows[~wide]  # global rows read (nearly) every block (see wide_queries, which the
    # CPU path uses to split them at the query)
    band = find_band(used, narrow, waste) if narrow.numel() else None
    if band is None:
        return [], covered
    lo, width = band
    inside = narrow[(narrow + lo >= 0) & (narrow + lo + width <= used.shape[1])]
    covered[inside] = True
    return [(Window(first, lo, width), count) for first, count in _runs(inside.tolist())], covered


@per_shape(maxsize=256)
def plan(part: Pattern, frame: Frame, waste: float, split_queries: bool = False) -> list[GroupPlan]:
    """The row groups of a part's layout in its frame: band groups where consecutive rows share a
    band of key blocks, and row groups (``BlockLayout.row_groups``) gathered whole for the rest
    (global rows, the first and last rows of a band, patterns without one).

    With ``split_queries`` (the CPU path, which merges groups that share output rows), the
    queries that read most keys leave their blocks for a query group of their own, last in the
    list (``wide_queries``); the rest of their blocks plan as ordinary rows."""
    layout = build_layout(part, frame)
    state = layout.state
    split = _split(part, frame, state != EMPTY) if split_queries else None
    if split is not None:  # the split rows read what their other queries read
        keep = torch.ones_like(state, dtype=torch.bool)
        keep[split.rows] = split.narrow_used
        state = torch.where(keep, state, EMPTY)
        layout = BlockLayout(state, layout.block_q, layout.block_k)
    used = state != EMPTY
    windows, covered = _banded(layout, used, waste)
    plans = [_band_group(part, frame, used, w, count, waste) for w, count in windows]
    rest = BlockLayout(torch.where(covered[:, None], EMPTY, state), layout.block_q, layout.block_k)
    for group in rest.row_groups(waste):
        plans.append(_group(part, frame, group.rows, group.kv_blocks, group.used))
    if split is None:
        return plans
    hidden = torch.zeros(frame.q.slots, dtype=torch.bool, device=state.device)
    hidden[split.wide_slots] = True  # their pairs are the query group's
    plans = [_hide(g, hidden[g.query_slots(frame.q.block)]) for g in plans]
    blocks = torch.nonzero(split.wide_used).flatten()[None]
    everything = torch.ones_like(blocks, dtype=torch.bool)
    queries = split.wide_slots[None]
    return [*plans, _group(part, frame, split.rows[:1], blocks, everything, q_slot=queries)]


def _wide_rows(used: Tensor) -> tuple[Tensor, Tensor, float]:
    """The query blocks that read any key block, which of them read more than twice the typical
    number (the median), and that number."""
    counts = used.sum(dim=1)
    rows = torch.nonzero(counts).flatten()
    typical = float(counts[rows].float().median()) if rows.numel() else 0.0
    return rows, counts[rows] > 2 * typical, typical


def _split(part: Pattern, frame: Frame, used: Tensor) -> WideSplit | None:
    """``split_wide_queries`` for the wide rows of ``_wide_rows``."""
    rows, wide, typical = _wide_rows(used)
    wide_rows = rows[wide]
    return split_wide_queries(part, frame, wide_rows, typical) if wide_rows.numel() else None


def _hide(group: GroupPlan, hidden: Tensor) -> GroupPlan:
    """The group with the queries ``hidden`` (R, bq) masked from every key."""
    if not bool(hidden.any()):
        return group
    return replace(group, masked=group.masked | hidden[:, :, None])


@per_shape(maxsize=256)
def part_block(
    part: Pattern, q_len: int, kv_len: int, block: int, waste: float, device: torch.device
) -> int:
    """The block a part runs at, from the backend's ``block``:

    - in a residue frame (stride s) whose groups hold more than one and at most 4 blocks of
      keys, the group's length: each group is then one dense (or causal) block read as a view.
      At 64-blocks, strided's groups of 128 keys at 8K ran as a 1-block band plus a gathered
      block: two kernel calls and a merge;
    - half the block, not below 32, where its plan computes at least 3% fewer pairs: a band
      narrow against the block (dilated at 8K: 65 keys a query, of which 64-blocks compute 192,
      32-blocks 96), or a wide one (local's 513 keys: 576 at 64, 544 at 32). The CPU kernel
      runs about as fast per pair at 32 as at 64, so local's and Longformer's bands, which a
      threshold of 3/4 used to leave at 64, run no slower at 32
      (measured: eval/results/design-notes-cpu.md#part-block-half);
    - otherwise ``block``.
    """
    stride = part.stride
    if isinstance(stride, int) and stride > 1:
        group = -(-kv_len // stride)
        if block < group <= 4 * block:
            return group
    half = block // 2
    if half < 32 or half % 8:
        return block

    def computed(size: int) -> int:
        frame = build_frame(stride, q_len, kv_len, size, size, device)
        return sum(g.masked.numel() for g in plan(part, frame, waste))

    return half if 100 * computed(half) <= 97 * computed(block) else block
