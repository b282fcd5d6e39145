"""``random``: each query block attends to a few key blocks drawn at random, with a fixed seed.

Positions are cut into blocks of ``block_size`` (the last one shorter when the length is not a
multiple). For every query block, ``num_blocks`` distinct key blocks are drawn uniformly (Floyd's
algorithm); with fewer key blocks than that, the query block sees them all. The draw uses a CPU
``torch.Generator`` seeded with ``seed``: the same seed and lengths give the same blocks on every
device, in training and in evaluation. Query positions before 0 (more queries than keys) get no
random block.

Non-causal form: the draw depends on the seed and the key length (queries are aligned to the keys'
end, see ``zoo.patterns.base``): query block i chooses among all key blocks, so a longer sequence
gives block i other blocks than a shorter one. Causal form (``causal=True``, see
``Pattern.causal_form``): query block i chooses its blocks among the blocks 0 .. i, its own
included, with the same seed, and the choice depends on the seed and i only. A prefix of a
longer sequence therefore sees exactly the blocks it saw alone, which is what decoding with a
cache needs (``zoo.decoding.cache``); a block with no more than ``num_blocks`` blocks at or before
it sees them all::

    block_size=2, num_blocks=1, seed=0 (6x6), one possible draw
    . . x x . .
    . . x x . .
    x x . . . .
    x x . . . .
    . . . . x x
    . . . . x x
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.arguments import check_int, check_seed
from .base import Pattern, Spans, state_from
from .families import register_pattern


def draw_blocks(num_q_blocks: int, num_k_blocks: int, count: int, seed: int) -> Tensor:
    """[num_q_blocks, min(count, num_k_blocks)] distinct key blocks per row, uniformly drawn."""
    count = min(count, num_k_blocks)
    candidates = torch.full((num_q_blocks,), num_k_blocks, dtype=torch.long)
    return _floyd(_uniform(num_q_blocks, count, seed), candidates, count)


def draw_causal_blocks(num_blocks: int, count: int, seed: int) -> Tensor:
    """[num_blocks, count]: row i holds ``count`` distinct blocks among 0 .. i, uniformly drawn;
    a row with i + 1 <= count holds all of 0 .. i, its last block repeated to fill the row. Row i
    depends on the seed and i only: the generator's stream is read row by row, so a table of more
    rows starts with the rows of a shorter one."""
    rows = torch.arange(num_blocks)
    chosen = _floyd(_uniform(num_blocks, count, seed), (rows + 1).clamp(min=count), count)
    every = torch.arange(count).clamp(max=rows[:, None])  # 0 .. i, then i again
    return torch.where((rows < count)[:, None], every, chosen)


def _uniform(rows: int, count: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(rows, max(count, 1), generator=generator, dtype=torch.float64)


def _floyd(uniform: Tensor, candidates: Tensor, count: int) -> Tensor:
    """Per row, ``count`` distinct ints from 0 .. candidates - 1 (Floyd's algorithm), sorted."""
    chosen = torch.empty(uniform.shape[0], count, dtype=torch.long)
    for t in range(count):  # a uniform draw from 0..j, or j itself on a repeat
        j = candidates - count + t
        draw = torch.minimum((uniform[:, t] * (j + 1)).long(), j)
        repeat = (chosen[:, :t] == draw[:, None]).any(dim=1)
        chosen[:, t] = torch.where(repeat, j, draw)
    return chosen.sort(dim=1).values


@register_pattern("random")
@dataclass(frozen=True)
class Random(Pattern):
    """Per query block, ``num_blocks`` key blocks drawn with ``seed``; see the module docstring."""

    block_size: int = 64
    num_blocks: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size)
        check_int("num_blocks", self.num_blocks)
        check_seed("seed", self.seed)

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        # Bottom-right alignment puts the last query at position kv_len - 1, so both sides have
        # the same number of blocks and the draw depends on kv_len alone.
        num_blocks = (kv_len - 1) // self.block_size + 1
        table = draw_blocks(num_blocks, num_blocks, self.num_blocks, self.seed)
        return RandomBlocks(self.block_size, table.to(device))

    def causal_form(self) -> Pattern:
        return CausalRandom(self.block_size, self.num_blocks, self.seed)

    def _needs_lengths(self, *args: object) -> Tensor:
        raise TypeError("a random pattern needs its lengths first: call specialize(q_len, kv_len)")

    allowed = block_state = dense = _needs_lengths  # type: ignore[assignment]


@dataclass(frozen=True)
class CausalRandom(Random):
    """The causal form of ``Random``: query block i draws among blocks 0 .. i (module docstring)."""

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        num_blocks = (kv_len - 1) // self.block_size + 1
        table = draw_causal_blocks(num_blocks, self.num_blocks, self.seed)
        return RandomBlocks(self.block_size, table.to(device))

    def causal_form(self) -> Pattern:
        return self


@dataclass(frozen=True, eq=False)
class RandomBlocks(Pattern):
    """A ``Random`` pattern with its blocks drawn for one key length (compared by identity)."""

    block_size: int
    table: Tensor  # [blocks, drawn key blocks per query block]

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        q_block = q_pos // self.block_size
        k_block = kv_pos // self.block_size
        last = self.table.shape[0] - 1
        row = q_block.clamp(0, last)
        # One comparison per drawn column, no reduction: FlexAttention compiles a mask_mod as a
        # pointwise function of scalar indices, and a reduction inside it is miscompiled.
        hit = self.table[row, 0] == k_block
        for column in range(1, self.table.shape[1]):
            hit = hit | (self.table[row, column] == k_block)
        return hit & (q_block >= 0) & (q_block <= last)

    def _drawn_prefix_sums(self) -> Tensor:
        """2-D prefix sums of the [blocks, blocks] drawn-or-not matrix, for rectangle counts."""
        if "_sums" not in self.__dict__:
            n = self.table.shape[0]
            drawn = torch.zeros(n + 1, n + 1, dtype=torch.int32, device=self.table.device)
            drawn[1:, 1:].scatter_(1, self.table, 1)
            self.__dict__["_sums"] = drawn.cumsum(0).cumsum(1)
        return self.__dict__["_sums"]

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        b, last = self.block_size, self.table.shape[0] - 1
        sums = self._drawn_prefix_sums()
        # The rectangle of pattern blocks that the two kernel blocks touch; clamps only keep the
        # indices of empty spans in range (state_from marks those EMPTY anyway).
        q0, q1 = (torch.clamp(q.lo, min=0) // b).clamp(0, last), (q.hi // b).clamp(0, last)
        k0, k1 = (k.lo // b).clamp(0, last), (k.hi // b).clamp(0, last)
        count = sums[q1 + 1, k1 + 1] - sums[q0, k1 + 1] - sums[q1 + 1, k0] + sums[q0, k0]
        area = (q1 - q0 + 1) * (k1 - k0 + 1)
        some = (q.hi >= 0) & (count > 0)
        return state_from(some, some & (count == area) & (q.lo >= 0), q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        b, offset = self.block_size, kv_len - q_len
        mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
        for q_block, row in enumerate(self.table.tolist()):
            rows = slice(max(q_block * b - offset, 0), max((q_block + 1) * b - offset, 0))
            for k_block in row:
                mask[rows, k_block * b : (k_block + 1) * b] = True
        return mask
