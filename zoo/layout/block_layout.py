"""Block layouts: which key blocks each query block needs, built from block bounds alone.

The layout of a pattern in a frame is an int8 matrix [query blocks, key blocks] of EMPTY, PARTIAL
and FULL, from the pattern's ``block_state`` on the blocks' position ranges. It costs
O((n / block)^2) small integer operations, never O(n^2) pair evaluations: 1M entries at 64K tokens
with blocks of 64, the same size as the dense block matrix that FlexAttention's ``BlockMask`` builds
for its backward pass anyway. A pattern whose states are not exact (a composition) is asked again
on squares of 16 slots a side of the blocks it calls PARTIAL: (block_q / 16) x (block_k / 16)
states more for each (a side whose block is no multiple of 16 over 16 is not cut).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.shape_cache import per_shape
from ..patterns.base import EMPTY, FULL, PARTIAL, Pattern, Spans
from .frames import Frame, build_frame


def used_first(flags: Tensor) -> Tensor:
    """Indices that put each row's True entries first, in increasing order (a stable sort)."""
    return torch.argsort(flags.to(torch.int8), dim=-1, descending=True, stable=True)


def used_first_unsorted(flags: Tensor) -> Tensor:
    """``used_first``'s indices by counting, not sorting, for a compiled graph: Inductor's
    argsort made cold compiles of block masks take minutes on CUDA (pytorch/pytorch#182060)."""
    hit = flags.to(torch.int64)
    before = hit.cumsum(-1) - hit  # the True entries before each one
    j = torch.arange(hit.shape[-1], device=hit.device)
    rank = torch.where(hit == 1, before, hit.sum(-1, keepdim=True) + j - before)
    return torch.empty_like(rank).scatter_(-1, rank, j.expand_as(rank))


@dataclass(frozen=True, eq=False)
class RowGroup:
    """Query blocks that need about as many key blocks, padded to one width for a batched gather."""

    rows: Tensor  # [R] query block indices
    kv_blocks: Tensor  # [R, W] key block indices (0 where the slot is unused)
    used: Tensor  # [R, W] False for the padding slots of shorter rows


@dataclass(frozen=True, eq=False)
class BlockLayout:
    state: Tensor  # [query blocks, key blocks] int8: EMPTY, PARTIAL or FULL
    block_q: int
    block_k: int
    # Counted when the layout is built (once per shape, outside any traced graph): counting
    # later would read a tensor's value inside the graph.
    computed_blocks: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "computed_blocks", int((self.state != EMPTY).sum()))

    def density(self) -> float:
        """Computed blocks as a fraction of all blocks."""
        return self.computed_blocks / max(self.state.numel(), 1)

    def row_groups(self, waste: float = 0.25) -> list[RowGroup]:
        """Rows grouped so that no row is padded by more than ``waste`` of its group's width.

        Rows with no key block are left out (their output is zero). Global rows of Longformer or
        BigBird need every key block while the others need a few; one width for all would make the
        whole layout dense.
        """
        used = self.state != EMPTY
        counts = used.sum(dim=1)
        order = torch.argsort(counts, descending=True, stable=True)
        sorted_counts = counts[order].tolist()
        # Each row's key blocks first, in increasing order (a stable sort of the used flags).
        kv_order = used_first(used)
        groups, start = [], 0
        while start < len(sorted_counts) and sorted_counts[start] > 0:
            width = sorted_counts[start]
            end = start
            while end < len(sorted_counts) and sorted_counts[end] >= width * (1 - waste):
                end += 1
            rows = order[start:end]
            slot_used = torch.arange(width, device=counts.device) < counts[rows, None]
            kv = torch.where(slot_used, kv_order[rows, :width], 0)
            groups.append(RowGroup(rows, kv, slot_used))
            start = end
        return groups


@per_shape(maxsize=256)
def build_layout(part: Pattern, frame: Frame) -> BlockLayout:
    """The layout of one part (see ``Pattern.parts``) in its frame. Where the part's states are
    not exact (``Pattern.exact_states``: a composition), each block it calls PARTIAL is asked
    again on its squares of ``_SQUARE`` slots a side: EMPTY where every square is, FULL where
    every square is (a causal axial pattern's blocks that its members each cut, together
    empty). Not a layout drawn per head ([1, H, ...] states), nor one whose blocks are no
    multiple of 16 over 16 on either side."""
    state = part.block_state(frame.q.spans().column(), frame.k.spans().row())
    if not part.exact_states and state.dim() == 2:
        state = _settled(part, frame, state)
    return BlockLayout(state, frame.q.block, frame.k.block)


def _settled(part: Pattern, frame: Frame, state: Tensor) -> Tensor:
    """``state`` with its PARTIAL blocks EMPTY or FULL where all their squares are."""
    squares = _Squares(frame)
    if not squares.cut:
        return state
    q_blocks, k_blocks = torch.nonzero(state == PARTIAL, as_tuple=True)
    if q_blocks.numel() == 0:
        return state
    state = state.clone()
    for qb, kb in zip(q_blocks.split(8192), k_blocks.split(8192), strict=True):
        each = squares.states(part, qb, kb)[0].flatten(1)
        for settled in (EMPTY, FULL):
            alike = (each == settled).all(1)
            state[qb[alike], kb[alike]] = settled
    return state


@per_shape(maxsize=256)
def specialized(pattern: Pattern, q_len: int, kv_len: int, device: torch.device) -> Pattern:
    """``pattern.specialize`` once per shape, so that cached layouts are found again; its
    ``parts()`` are split here too, so that a traced graph reads them rather than making them."""
    pattern = pattern.specialize(q_len, kv_len, device)
    pattern.parts()
    return pattern


@per_shape(maxsize=256)
def with_heads(pattern: Pattern, heads: int) -> Pattern:
    """``pattern.for_heads(heads)`` once per (specialised) pattern and number of query heads, so
    that a per-head pattern's layouts and masks are found again (``Pattern.per_head``)."""
    pattern = pattern.for_heads(heads)
    pattern.parts()
    return pattern


@per_shape(maxsize=1024)
def head_layout(pattern: Pattern, h: int) -> Pattern:
    """``pattern.head(h)`` once per pattern drawn per head and head, so that the plans of each
    head's layout are found again (``Pattern.head``)."""
    pattern = pattern.head(h)
    pattern.parts()
    return pattern


def allowed_pairs(pattern: Pattern, q_len: int, kv_len: int, block: int = 128) -> int:
    """The exact number of allowed pairs, counted block by block: full blocks by size, empty
    blocks never, partial blocks (of a multiple of 16 slots a side, over 16) cut into squares of
    16 x 16 slots that are counted the same way, and only the partial squares (or blocks) counted
    pair by pair. Each disjoint part of the pattern is counted in its own token order, where its
    blocks are sparse. Counted on the CPU once per shape, whatever mode the caller is in
    (``explain`` under fake tensors)."""
    if not isinstance(pattern, Pattern):
        raise TypeError(
            f"allowed_pairs takes a zoo Pattern, got {pattern!r} ({type(pattern).__name__}); "
            f"for a variant by name, zoo.functional.resolve_pattern(name, causal, params) makes one"
        )
    return _allowed_pairs(pattern, q_len, kv_len, block)


def allowed_pairs_bounds(
    pattern: Pattern, q_len: int, kv_len: int, block: int = 128
) -> tuple[int, int]:
    """Bounds on ``allowed_pairs`` from the block states alone, no pair evaluated: the pairs of
    the full blocks at least, those of the full and partial blocks at most. Cheap where the exact
    count is not (a pattern of many partial blocks at 128K tokens), and enough to tell that a
    count differs from another. Counted on the CPU once per shape, as ``allowed_pairs``."""
    if not isinstance(pattern, Pattern):
        raise TypeError(
            f"allowed_pairs_bounds takes a zoo Pattern, got {pattern!r} ({type(pattern).__name__})"
        )
    return _allowed_pairs_bounds(pattern, q_len, kv_len, block)


@per_shape(maxsize=256)
def _allowed_pairs_bounds(pattern: Pattern, q_len: int, kv_len: int, block: int) -> tuple[int, int]:
    low = high = 0
    for _, _, state in _part_states(pattern, q_len, kv_len, block):
        full, partial = int((state == FULL).sum()), int((state == PARTIAL).sum())
        low, high = low + full * block * block, high + (full + partial) * block * block
    return low, min(high, q_len * kv_len)


def _part_states(pattern: Pattern, q_len: int, kv_len: int, block: int):
    """Each disjoint part of the pattern with its frame and block states, on the CPU. A pattern
    of one layout per head or per sequence (heads drawn by ``for_heads``, a choice by content
    bound to one call) has no one count: it is refused, saying how to count each layout."""
    device = torch.device("cpu")
    for part in specialized(pattern, q_len, kv_len, device).parts():
        frame = build_frame(part.stride, q_len, kv_len, block, block, device)
        state = build_layout(part, frame).state
        if state.dim() != 2:
            each = "sequence and head" if pattern.routed else "head"
            how = "" if pattern.routed else ": count pattern.head(h) for each head h"
            raise ValueError(
                f"allowed_pairs counts the pairs of one layout; the {type(pattern).__name__} "
                f"given has one per {each} (block states of shape {tuple(state.shape)}){how}"
            )
        yield part, frame, state


@per_shape(maxsize=256)
def _allowed_pairs(pattern: Pattern, q_len: int, kv_len: int, block: int) -> int:
    total = 0
    for part, frame, state in _part_states(pattern, q_len, kv_len, block):
        total += int((state == FULL).sum()) * block * block
        q_blocks, k_blocks = torch.nonzero(state == PARTIAL, as_tuple=True)
        total += _partial_pairs(part, frame, q_blocks, k_blocks)
    return total


# The side of the squares a partial block is cut into before its pairs are counted one by one.
_SQUARE = 16


class _Squares:
    """A frame's blocks cut into squares of ``_SQUARE`` slots a side, on each side where its
    blocks are a multiple of that over it (else a side's block is its one run)."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.q_side, self.k_side = (_side(axis.block) for axis in (frame.q, frame.k))
        self.q_per, self.k_per = frame.q.block // self.q_side, frame.k.block // self.k_side

    @property
    def cut(self) -> bool:
        return self.q_per * self.k_per > 1

    @functools.cached_property
    def spans(self) -> tuple[Spans, Spans]:
        """The squares' query and key runs (made on first use)."""
        return self.frame.q.spans(self.q_side), self.frame.k.spans(self.k_side)

    def states(self, part: Pattern, q_blocks: Tensor, k_blocks: Tensor):
        """(the part's states of the squares of blocks (q_blocks[i], k_blocks[i]), (C, q_per,
        k_per); their query and key run indices, (C, q_per, 1) and (C, 1, k_per))."""
        within = torch.arange(max(self.q_per, self.k_per), device=q_blocks.device)
        qs = (q_blocks[:, None] * self.q_per + within[: self.q_per])[:, :, None]
        ks = (k_blocks[:, None] * self.k_per + within[: self.k_per])[:, None, :]
        q_runs, k_runs = self.spans
        state = part.block_state(_picked(q_runs, qs), _picked(k_runs, ks))
        return state.expand(q_blocks.shape[0], self.q_per, self.k_per), qs, ks


def _side(block: int) -> int:
    return _SQUARE if block > _SQUARE and block % _SQUARE == 0 else block


def _partial_pairs(part: Pattern, frame, q_blocks: Tensor, k_blocks: Tensor) -> int:
    """The allowed pairs of the PARTIAL blocks (q_blocks[i], k_blocks[i]) of the frame. Where
    its blocks cut into squares (``_Squares``), the pattern's ``block_state`` classifies the
    squares first: full ones count by size, empty ones not at all, and only the partial ones are
    counted pair by pair (a 2-D pattern's rows and columns cross a block in thin lines, so most
    of a partial block's squares are empty)."""
    squares = _Squares(frame)
    q_side, k_side = squares.q_side, squares.k_side
    q_pos, q_ok = frame.q.position.view(-1, q_side), frame.q.valid.view(-1, q_side)
    k_pos, k_ok = frame.k.position.view(-1, k_side), frame.k.valid.view(-1, k_side)
    total = 0
    for qs, ks in zip(q_blocks.split(1024), k_blocks.split(1024), strict=True):
        # the blocks' runs of slots, then the squares'
        if squares.cut:
            state, qs, ks = squares.states(part, qs, ks)
            total += int(torch.count_nonzero(state == FULL)) * q_side * k_side
            which = state == PARTIAL
            qs, ks = qs.expand_as(which)[which], ks.expand_as(which)[which]
        most = 1024 * squares.q_per * squares.k_per
        for q, k in zip(qs.split(most), ks.split(most), strict=True):
            hit = part.allowed(q_pos[q][:, :, None], k_pos[k][:, None, :])
            total += int(torch.count_nonzero(hit & q_ok[q][:, :, None] & k_ok[k][:, None, :]))
    return total


def _picked(spans: Spans, index: Tensor) -> Spans:
    """The spans at ``index``, shaped as it is."""
    return spans.map(lambda t: t[index])
