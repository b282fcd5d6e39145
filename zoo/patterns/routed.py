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
    """(..., blocks) bool: the ``forced`` blocks, then the best by ``scores`` up to ``top_k`` in
    all, among the ``available`` ones only (forced ones too); ties go to the lower index.

    Forced blocks rank first (+inf) and count toward ``top_k``; with fewer available blocks than
    ``top_k`` every available one is chosen. Masks broadcast against ``scores``."""
    scores = torch.where(forced, float("inf"), scores.float())
    scores = torch.where(available, scores, float("-inf"))
    # A stable descending sort puts the lower index first among equal scores.
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :top_k]
    chosen = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return chosen.scatter_(-1, best, True) & available


@dataclass(frozen=True, eq=False)
class ChosenBlocks(Pattern):
    """Key blocks of ``block_size`` chosen per query, for one call (compared by identity).

    ``chosen[b, h, i, j]`` is True when query i (index, not position) of sequence b, head h attends
    to every key of block j (keys j * block_size .. (j + 1) * block_size - 1). ``offset`` is
    query i's position minus i: kv_len - q_len, the bottom-right alignment of
    ``zoo.patterns.base``, or a (B,) tensor, one per sequence, for a call against a cache
    (``RouteInputs.q_pos``), which ``allowed_at`` serves (``block_state`` takes an int).
    """

    block_size: int
    chosen: Tensor  # (B, H, Lq, key blocks) bool
    offset: int | Tensor

    @property
    def routed(self) -> bool:
        return True

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        raise TypeError(
            "blocks chosen by content differ per sequence and head: use allowed_at(b, h, ...)"
        )

    def allowed_at(self, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        _, heads, q_len, blocks = self.chosen.shape
        index = q_pos - (self.offset[b] if isinstance(self.offset, Tensor) else self.offset)
        # Clamps keep padding slots' indices in range; the result there is ignored.
        row = index.clamp(0, q_len - 1)
        column = (kv_pos // self.block_size).clamp(0, blocks - 1)
        if torch.compiler.is_compiling():  # flex's mask_mod: scalar indices
            return self.chosen[b, h, row, column] & (index >= 0) & (index < q_len)
        # One flat gather: on CPU far faster than four broadcast index tensors
        # (measured: eval/results/design-notes-cpu.md#routed-flat-gather).
        flat = ((b * heads + h) * q_len + row) * blocks + column
        return self.chosen.flatten().take(flat) & (index >= 0) & (index < q_len)

    def _row_counts(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """A 2-D prefix sum of the choice at ``rows`` (query indices 0 .. Lq, any order, repeats
        allowed): (table (B, H, R, blocks + 1) int32, each of ``rows``' row in it), where
        table[..., row, j] counts the chosen (query, block) pairs among the queries before that
        row and the blocks before j.

        With few rows against the queries (kernel blocks of queries: flex, the union path) the
        table holds the rows asked for only: the queries cut into segments at them, each slice
        of queries added to its segment (``index_add``), the segments summed in order, so no
        tensor as large as the choice is made; a prefix sum over every query would be n^2 /
        block elements. Where the rows are about as many as the queries (one query per span:
        the runs by key block), every query's row, built in place in one int32 table."""
        chosen = self.chosen
        batch, heads, q_len, blocks = chosen.shape
        if 2 * rows.numel() >= q_len + 1:  # as many rows as queries: every query's
            table = chosen.new_zeros((batch, heads, q_len + 1, blocks + 1), dtype=torch.int32)
            table[:, :, 1:, 1:] = chosen
            return table.cumsum_(2).cumsum_(3), rows
        order = rows.argsort()
        cuts = rows[order]  # sorted
        # Query i belongs to segment #{cuts <= i}; the prefix at cuts[j] is segments 0 .. j.
        segment = torch.searchsorted(cuts, torch.arange(q_len, device=rows.device), right=True)
        table = chosen.new_zeros((batch, heads, cuts.numel() + 1, blocks + 1), dtype=torch.int32)
        step = max(1, COUNT_CHUNK // max(1, batch * heads * blocks))
        for first in range(0, q_len, step):
            part = slice(first, min(first + step, q_len))
            table[..., 1:].index_add_(2, segment[part], chosen[:, :, part].to(torch.int32))
        table.cumsum_(2).cumsum_(3)  # row j: the prefix at cuts[j]; the last row unused
        return table, order.argsort()  # rows[i] is cuts[order.argsort()[i]]

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        """[B, H, q blocks, k blocks]: FULL where every query of the kernel block chose every
        pattern block that the kernel key block touches. Counted over the whole position range
        of each span, a superset of a regrouped span's positions (strided frames), so EMPTY and
        FULL stay true claims in any token order."""
        _, _, q_len, blocks = self.chosen.shape
        if isinstance(self.offset, Tensor):
            raise TypeError(
                "block_state needs one query offset for every sequence; blocks chosen against a "
                "cache (an offset per sequence) answer allowed_at only"
            )
        q0, q1 = (q.lo - self.offset).clamp(0, q_len - 1), (q.hi - self.offset).clamp(0, q_len - 1)
        k0 = (k.lo // self.block_size).clamp(0, blocks - 1)
        k1 = (k.hi // self.block_size).clamp(0, blocks - 1)
        if q.aligned == 1 and k.aligned is not None and self.block_size % k.aligned == 0:
            # One query per span, each key span inside one chosen block (the runs by key
            # block): the state is the choice itself, read at (q0, k0), no counting.
            flat = self.chosen.flatten(2)
            index = q0 * blocks + k0  # (query spans, key spans), broadcast
            picked = flat.gather(2, index.flatten().expand(*flat.shape[:2], -1))
            picked = picked.view(*flat.shape[:2], *index.shape)
            return state_from(picked, picked, q, k)
        spans = q0.numel()
        sums, where = self._row_counts(torch.cat((q0.reshape(-1), q1.reshape(-1) + 1)))
        width = blocks + 1
        flat = sums.flatten(2)
        first = where[:spans].view(q0.shape)  # q0's rows in sums
        after = where[spans:].view(q1.shape)  # q1 + 1's

        def at(row: Tensor, column: Tensor) -> Tensor:  # sums[:, :, row, column], broadcast
            index = row * width + column
            # One gather over a flat index: on CPU far faster than sums[:, :, row, column]
            # (measured: eval/results/design-notes-cpu.md#routed-prefix-sums-gather).
            picked = flat.gather(2, index.flatten().expand(*flat.shape[:2], -1))
            return picked.view(*flat.shape[:2], *index.shape)

        count = (at(after, k1 + 1) - at(first, k1 + 1) - at(after, k0)) + at(first, k0)
        area = (q1 - q0 + 1) * (k1 - k0 + 1)
        return state_from(count > 0, count == area, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        """(B, H, q_len, kv_len): each chosen block widened to its keys."""
        return self.chosen.repeat_interleave(self.block_size, dim=-1)[..., :kv_len]
