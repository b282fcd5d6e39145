"""Patterns chosen by content: a layout computed from a call's q and k, per sequence and head.

A fixed pattern's pairs depend on positions alone. A *routed* pattern (MoBA, NSA's selected
branch) chooses key blocks for each query from q and k, so its layout exists only for one call's
inputs. The protocol extends ``Pattern`` in one step:

- ``routed`` is True, and ``bind(RouteInputs)`` makes the choice, returning a ``ChosenBlocks``.
- A ``ChosenBlocks`` answers the three views with leading (batch, heads) dimensions:
  ``allowed_at(b, h, q_pos, kv_pos)``, ``block_state -> [B, H, q blocks, k blocks]`` and
  ``dense -> [B, H, q_len, kv_len]``. These broadcast against a fixed pattern's views
  (``[q blocks, k blocks]``, ``[q_len, kv_len]``), so ``moba | sliding_window`` and
  ``moba & causal`` compose with no new code, and a fixed pattern is the special case of a
  layout that is the same for every sequence and head.

Backends see only bound patterns (``zoo.attention`` binds after the rotary encoding turns q and k)
and treat ``pattern.routed`` as "the layout has (batch, heads) dimensions": the reference builds
the dense (B, H, Lq, Lk) mask, ``blocked`` gathers each sequence and head's key blocks, ``flex``
builds a per-sequence, per-head ``BlockMask``. A fixed pattern drawn per query head
(``Pattern.per_head``, ``Pattern.for_heads``) has the same leading dimensions with a batch of one,
and runs on those paths (``blocked``: head by head, each head's layout a fixed pattern), without
being ``routed``: its layout is cached per shape and number of heads.

The choice gets no gradient (it is made under ``torch.no_grad``); the attention over the chosen
keys does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .base import Pattern, Spans, state_from

COUNT_CHUNK = 1 << 24  # choice entries counted at once in block_state (64 MB of int32)


@dataclass(frozen=True)
class RouteInputs:
    """What a routed pattern chooses from: q (B, H, Lq, D) and k (B, H_kv, Lk, D) as attention
    sees them, the key padding (B, Lk) bool or None (True = padding), and whether the choice is
    made under causal rules (a causal member of an intersection sets it); and the call's graph,
    ``edge_index`` (the ``graph`` pattern's edges, ``zoo.patterns.graph_edges``), or None.

    ``q_pos`` (B, Lq), the queries' positions, for a call against a ``KVCache`` whose slot j
    holds position j, each sequence at its own length: row b's queries sit at q_pos[b], which
    must be consecutive (q_pos[b, 0] + i). None: bottom-right alignment, q_pos = i + Lk - Lq.

    ``block_sums(block)``: where the caller keeps them (a ``KVCache``), the float32 sums of k's
    unpadded keys per block of ``block`` and their counts (``zoo.decoding.block_sums``), so that a
    choice by block means need not read every key; None (or a None answer): computed from k.
    """

    q: Tensor
    k: Tensor
    key_padding_mask: Tensor | None = None
    causal: bool = False
    q_pos: Tensor | None = None
    edge_index: object = None
    block_sums: Callable[[int], tuple[Tensor, Tensor] | None] | None = None

    def offset(self) -> int | Tensor:
        """Query i's position minus i: kv_len - q_len, or (B,) one per sequence (``q_pos``)."""
        if self.q_pos is None:
            return self.k.shape[2] - self.q.shape[2]
        # Its own storage, of stride 1: a column view of q_pos, captured by a compiled flex
        # mask_mod, failed Inductor's CPU lowering ("All the buffers in the score and mask
        # subgraph should be in kernel_group.args.input_buffers"). .contiguous() and .clone()
        # keep a (1,) view's stride; this does not.
        return self.q_pos[:, 0].clone(memory_format=torch.contiguous_format)

    def made_causal(self) -> RouteInputs:
        return self if self.causal else replace(self, causal=True)


def top_blocks(scores: Tensor, top_k: int, available: Tensor, forced: Tensor) -> Tensor:
    """(..., min(top_k, blocks)) int32: the indices of the ``forced`` blocks, then of the best by
    ``scores``, up to ``top_k`` in all, among the ``available`` ones only (forced ones too); ties
    go to the lower index. A slot left empty (fewer available blocks than ``top_k``) holds
    ``blocks``, one past the last index (``ChosenBlocks.picks``).

    Forced blocks rank first (+inf) and count toward ``top_k``; with fewer available blocks than
    ``top_k`` every available one is chosen. Masks broadcast against ``scores``."""
    blocks = scores.shape[-1]
    scores = torch.where(forced, float("inf"), scores.float())
    scores = torch.where(available, scores, float("-inf"))
    # A stable descending sort puts the lower index first among equal scores.
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    best, ranked = order.indices[..., :top_k], order.values[..., :top_k]
    # (A NaN score is kept, as an available block: NaN > -inf is False, NaN != -inf True.)
    return torch.where(ranked != float("-inf"), best, blocks).to(torch.int32)


def picks_mask(picks: Tensor, blocks: int) -> Tensor:
    """(..., blocks) bool: True at each block index in ``picks`` (..., k) (``blocks``, an empty
    slot, sets nothing)."""
    mask = torch.zeros(*picks.shape[:-1], blocks + 1, dtype=torch.bool, device=picks.device)
    return mask.scatter_(-1, picks.long(), True)[..., :blocks]


@dataclass(frozen=True, eq=False)
class ChosenBlocks(Pattern):
    """Key blocks of ``block_size`` chosen per query, for one call (compared by identity).

    ``picks[b, h, i]`` lists the key blocks that query i (index, not position) of sequence b,
    head h attends in full (block j: keys j * block_size .. (j + 1) * block_size - 1), each at
    most once; a slot holding ``blocks`` (the number of key blocks) is empty. The choice is kept
    as these indices, n * k entries, never as a (queries, blocks) mask, which is n^2 / block
    (537 MB of bools at 128K tokens, 16 heads, blocks of 512): each view builds what it needs a
    slice of queries at a time. ``offset`` is query i's position minus i: kv_len - q_len, the
    bottom-right alignment of ``zoo.patterns.base``, or a (B,) tensor, one per sequence, for a
    call against a cache (``RouteInputs.q_pos``), which ``allowed_at`` serves (``block_state``
    takes an int).
    """

    block_size: int
    picks: Tensor  # (B, H, Lq, k) int32 key block indices; ``blocks`` in an empty slot
    blocks: int  # key blocks the choice was made among (ceil(kv_len / block_size) in a call)
    offset: int | Tensor

    @property
    def routed(self) -> bool:
        return True

    def mask(self, rows: Tensor | slice = slice(None)) -> Tensor:
        """(B, H, R, blocks) bool: the choice at these query rows, as a mask."""
        return picks_mask(self.picks[:, :, rows], self.blocks)

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        raise TypeError(
            "blocks chosen by content differ per sequence and head: use allowed_at(b, h, ...)"
        )

    def allowed_at(self, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        _, heads, q_len, width = self.picks.shape
        index = q_pos - (self.offset[b] if isinstance(self.offset, Tensor) else self.offset)
        # Clamps keep padding slots' indices in range; the result there is ignored. A column
        # in range never equals an empty slot's ``blocks``.
        row = index.clamp(0, q_len - 1)
        column = (kv_pos // self.block_size).clamp(0, self.blocks - 1)
        if torch.compiler.is_compiling():  # flex's mask_mod: scalar indices
            picks = [self.picks[b, h, row, slot] for slot in range(width)]
        else:
            # Flat gathers, one per slot: on CPU far faster than four broadcast index tensors
            # (measured: eval/results/design-notes-cpu.md#routed-flat-gather).
            flat, first = self.picks.flatten(), ((b * heads + h) * q_len + row) * width
            picks = [flat.take(first + slot) for slot in range(width)]
        hit = torch.zeros_like(column, dtype=torch.bool) if not picks else picks[0] == column
        for pick in picks[1:]:
            hit = hit | (pick == column)
        return hit & (index >= 0) & (index < q_len)

    def _row_counts(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """A 2-D prefix sum of the choice at ``rows`` (query indices 0 .. Lq, any order, repeats
        allowed): (table (B, H, R, blocks + 1) int32, each of ``rows``' row in it), where
        table[..., row, j] counts the chosen (query, block) pairs among the queries before that
        row and the blocks before j.

        The queries are cut into segments at the rows, each slice of queries added to its
        segment (``index_add``), the segments summed in order: the table is as large as the
        rows asked for, and nothing as large as the choice's mask is made."""
        batch, heads, q_len, _ = self.picks.shape
        blocks = self.blocks
        order = rows.argsort()
        cuts = rows[order]  # sorted
        # Query i belongs to segment #{cuts <= i}; the prefix at cuts[j] is segments 0 .. j.
        segment = torch.searchsorted(cuts, torch.arange(q_len, device=rows.device), right=True)
        shape = (batch, heads, cuts.numel() + 1, blocks + 1)
        table = self.picks.new_zeros(shape, dtype=torch.int32)
        step = max(1, COUNT_CHUNK // max(1, batch * heads * blocks))
        for first in range(0, q_len, step):
            part = slice(first, min(first + step, q_len))
            table[..., 1:].index_add_(2, segment[part], self.mask(part).to(torch.int32))
        table.cumsum_(2).cumsum_(3)  # row j: the prefix at cuts[j]; the last row unused
        return table, order.argsort()  # rows[i] is cuts[order.argsort()[i]]

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        """[B, H, q blocks, k blocks]: FULL where every query of the kernel block chose every
        pattern block that the kernel key block touches. Counted over the whole position range
        of each span, a superset of a regrouped span's positions (strided frames), so EMPTY and
        FULL stay true claims in any token order."""
        q_len, blocks = self.picks.shape[2], self.blocks
        if isinstance(self.offset, Tensor):
            raise TypeError(
                "block_state needs one query offset for every sequence; blocks chosen against a "
                "cache (an offset per sequence) answer allowed_at only"
            )
        q0, q1 = (q.lo - self.offset).clamp(0, q_len - 1), (q.hi - self.offset).clamp(0, q_len - 1)
        k0 = (k.lo // self.block_size).clamp(0, blocks - 1)
        k1 = (k.hi // self.block_size).clamp(0, blocks - 1)
        if q.aligned == 1:
            # One query per span (the runs by key block, which ask a slice of queries at a
            # time): each span's picks against the key spans, a pick slot at a time, so that
            # nothing is as wide as the blocks (only the spans asked: k0 .. k1 blocks each).
            picks = self.picks[:, :, q0.flatten()].view(*self.picks.shape[:2], *q0.shape, -1)
            count = torch.zeros((), dtype=torch.int16, device=picks.device)
            for slot in range(picks.shape[-1]):  # an empty slot (``blocks``) is past every k1
                pick = picks[..., slot]
                count = count + ((pick >= k0) & (pick <= k1)).to(torch.int16)
            return state_from(count > 0, count == k1 - k0 + 1, q, k)
        spans = q0.numel()
        sums, where = self._row_counts(torch.cat((q0.reshape(-1), q1.reshape(-1) + 1)))
        first = where[:spans].view(q0.shape)  # q0's rows in sums
        after = where[spans:].view(q1.shape)  # q1 + 1's
        count = _at(sums, after, k1 + 1) - _at(sums, first, k1 + 1) - _at(sums, after, k0)
        count = count + _at(sums, first, k0)
        area = (q1 - q0 + 1) * (k1 - k0 + 1)
        return state_from(count > 0, count == area, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        """(B, H, q_len, kv_len): each chosen block widened to its keys."""
        return self.mask().repeat_interleave(self.block_size, dim=-1)[..., :kv_len]


def _at(table: Tensor, row: Tensor, column: Tensor) -> Tensor:
    """table[:, :, row, column] for a (B, H, R, C) table, ``row`` and ``column`` broadcast."""
    index = row * table.shape[-1] + column
    # One gather over a flat index: on CPU far faster than table[:, :, row, column]
    # (measured: eval/results/design-notes-cpu.md#routed-prefix-sums-gather).
    flat = table.flatten(2)
    picked = flat.gather(2, index.flatten().expand(*flat.shape[:2], -1))
    return picked.view(*flat.shape[:2], *index.shape)
