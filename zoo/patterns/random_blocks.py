"""``random``: each query block attends to a few key blocks drawn at random, with a fixed seed.

Positions are cut into blocks of ``block_size`` (the last one shorter when the length is not a
multiple). For every query block, ``num_blocks`` distinct key blocks are drawn uniformly (Floyd's
algorithm) among its candidates; with fewer candidates than that, the query block sees them all.
The draw uses a CPU ``torch.Generator`` seeded with ``seed``: the same seed and lengths give the
same blocks on every device, in training and in evaluation. Query positions before 0 (more
queries than keys) get no random block.

Candidates (``among``):

- ``"all"`` (the default of the ``random`` variant, which has no window to avoid): every key
  block. Inside a union a draw may then land on a block that the union reads anyway.
- ``"outside"``: the key blocks that the rest of a BigBird union does not already read: not
  within ``window_neighbors`` blocks of the query block (``block_local``'s window, ``|i - j| <=
  window_neighbors``) and not one of the ``global_blocks`` global blocks placed by
  ``global_position`` (``zoo.patterns.global_blocks``). Every query block then gets exactly
  ``num_blocks`` extra blocks wherever enough candidates exist, as in the paper's ITC form and
  Hugging Face's ``_bigbird_block_rand_mask_with_head``, which draw among the blocks outside the
  window and the globals. This is the default of the ``bigbird`` variant: with ``"all"``, a
  middle row of 16 blocks of 64 (1K tokens) got 2.0 distinct extra blocks on average instead of
  3, 2.7 to 2.9 at 2K to 8K. A row with fewer candidates than ``num_blocks`` (a short sequence,
  the first rows of a causal one) gets all of them; its other table slots hold -1 (no block).
  (Hugging Face draws from a "plan" that keeps long sequences' random blocks among the first
  2r + 5 blocks; the zoo draws among all candidates. Given the same table, the two attend the
  same pairs: ``tests/patterns/test_bigbird_hf.py``.)

Per head (``per_head``). BigBird and Hugging Face draw one table per head
(``_bigbird_block_rand_mask_with_head``). With ``per_head=True`` (the default of the ``bigbird``
variant, ``random_per_head``) query head h draws its own table with seed ``seed + h`` (mod 2**32),
by the same rules as the shared table, so head 0's table is the shared one and a head's table does
not depend on how many heads there are. It is still a fixed pattern (chosen by position, not by
content, unlike ``zoo.patterns.routed``): ``specialize`` gives a ``RandomBlocks`` whose views are
head 0's (what pictures show, and ``zoo.dense_mask`` unless given ``heads``), and
``for_heads(H)`` (``Pattern.for_heads``, which ``zoo.attention`` applies once per shape and
number of query heads) gives the layout of H heads: ``table`` [H, blocks, r], ``allowed_at``
reads the head, ``block_state`` is [1, H, query blocks, key blocks] and ``dense`` [1, H, q_len,
kv_len], the (batch, heads) form of a routed layout with a batch of one, which backends take
where they take routed layouts. Under
grouped-query attention the table is per *query* head: the query heads that share a key/value
head draw their own blocks (HF's BigBird has no grouped heads; per query head keeps the paper's
per-head draw). A cache for generation keeps the union of what its heads read.

The shared table (``per_head=False``, the ``random`` variant's default and ``random_per_head:
false`` for ``bigbird``) serves the fast path: one layout for every head. ``blocked`` then runs
one plan with one kernel call per row group for all heads (per head: each head's layout,
``Pattern.head``, on its own plan, built once per shape, a kernel call per head and group); sdpa
and the reference take one [Lq, Lk] mask (per head: [H, Lq, Lk], H times the memory); flex one
``BlockMask`` for all heads (per head: one per head, each built once per shape); and only the
shared table goes on to xFormers' planner (xFormers declines a layout per head). ``bigbird``
draws per head by default because that is BigBird as published and as Hugging Face implements
it (``tests/patterns/test_bigbird_hf.py`` compares all heads in one call), and every backend
that takes it computes it forward and backward (``tests/patterns/test_random_per_head.py``,
and the registry-wide tests of ``tests/backends``).

Non-causal form: the draw depends on the seed and the key length (queries are aligned to the keys'
end, see ``zoo.patterns.base``): query block i chooses among all key blocks, so a longer sequence
gives block i other blocks than a shorter one. Causal form (``causal=True``, see
``Pattern.causal_form``): query block i chooses its blocks among the blocks 0 .. i, its own
included (``"outside"``: less its window and the global blocks at the start, the causal form of
``global_blocks``), with the same seed, and the choice depends on the seed and i only. A prefix
of a longer sequence therefore sees exactly the blocks it saw alone, which is what decoding with
a cache needs (``zoo.decoding.cache``); a block with no more than ``num_blocks`` candidates at or
before it sees them all::

    block_size=2, num_blocks=1, seed=0 (6x6), one possible draw
    . . x x . .
    . . x x . .
    x x . . . .
    x x . . . .
    . . . . x x
    . . . . x x
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.arguments import SEED_MAX, check_int, check_seed
from .base import Pattern, Spans, state_from
from .families import register_pattern
from .global_blocks import check_position, global_block_indices

AMONG = ("all", "outside")


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


def draw_outside(
    num_blocks: int, count: int, seed: int, window: int, avoid: tuple[int, ...], causal: bool
) -> Tensor:
    """[num_blocks, count]: row i holds ``count`` distinct blocks drawn uniformly among the blocks
    0 .. num_blocks - 1 (``causal``: 0 .. i) that are neither within ``window`` blocks of i nor in
    ``avoid``, sorted; a row with fewer candidates holds them all, then -1 (no block). Causal: row
    i depends on the seed, i, ``window`` and ``avoid`` only (the stream is read row by row)."""
    rows = torch.arange(num_blocks)
    limit = rows + 1 if causal else torch.full((num_blocks,), num_blocks)  # candidates < limit
    near = rows[:, None] + torch.arange(-window, window + 1)[None, :]
    globals_ = torch.tensor(avoid, dtype=torch.long).expand(num_blocks, len(avoid))
    taken = torch.cat([near, globals_], dim=1)
    beyond = num_blocks + 1  # sorts after every block; never <= a rank's block
    taken = torch.where((taken >= 0) & (taken < limit[:, None]), taken, beyond).sort(1).values
    repeat = torch.zeros_like(taken, dtype=torch.bool)
    repeat[:, 1:] = taken[:, 1:] == taken[:, :-1]
    taken = torch.where(repeat, beyond, taken).sort(1).values  # distinct, ascending
    size = limit - (taken < beyond).sum(1)  # candidates per row
    ranks = _floyd(_uniform(num_blocks, count, seed), size.clamp(min=count), count)
    every = torch.arange(count).expand(num_blocks, count)
    short = torch.where(every < size[:, None], every, -1)  # all candidates, then no block
    ranks = torch.where((size < count)[:, None], short, ranks)
    # The rank-th candidate: step over the taken blocks at or below it, in ascending order.
    blocks = ranks.clone()
    for column in range(taken.shape[1]):
        blocks += (taken[:, column : column + 1] <= blocks).long()
    return torch.where(ranks >= 0, blocks, -1)


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


# The seeds torch's CPU generator tells apart: head h draws with (seed + h) mod SEED_SPAN.
SEED_SPAN = SEED_MAX + 1


@register_pattern("random")
@dataclass(frozen=True)
class Random(Pattern):
    """Per query block, ``num_blocks`` key blocks drawn with ``seed``; see the module docstring.

    ``per_head``: False (the default here) draws one table shared by every head, the fast path
    (one layout for all heads); True draws one per query head, head h with ``seed + h``, as
    BigBird and Hugging Face do (the ``bigbird`` variant's default)."""

    block_size: int = 64
    num_blocks: int = 3
    seed: int = 0
    among: str = "all"  # or "outside": the blocks that the next three leave (module docstring)
    window_neighbors: int = 0
    global_blocks: int = 0
    global_position: str = "first_last"
    per_head: bool = False  # one table per query head (module docstring)

    _causal = False  # the causal form draws among the blocks at or before each query block

    @property
    def constant_block(self) -> int:
        return self.block_size

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size)
        check_int("num_blocks", self.num_blocks)
        check_seed("seed", self.seed)
        if self.among not in AMONG:
            choices = ", ".join(map(repr, AMONG))
            raise ValueError(f"among must be one of {choices}, got {self.among!r}")
        check_int("window_neighbors", self.window_neighbors, minimum=0)
        check_int("global_blocks", self.global_blocks, minimum=0)
        check_position("global_position", self.global_position)
        if not isinstance(self.per_head, bool):
            raise TypeError(f"per_head must be True or False, got {self.per_head!r}")

    def _table(self, blocks: int, causal: bool, seed: int | None = None) -> Tensor:
        seed = self.seed if seed is None else seed
        if self.among == "all":
            if causal:
                return draw_causal_blocks(blocks, self.num_blocks, seed)
            return draw_blocks(blocks, blocks, self.num_blocks, seed)
        # Causal: the global blocks of global_blocks' causal form, those at the start.
        count, position = self.global_blocks, self.global_position
        if causal and position == "first_last":
            count, position = (count + 1) // 2, "first"
        avoid = global_block_indices(count, position, blocks)
        return draw_outside(blocks, self.num_blocks, seed, self.window_neighbors, avoid, causal)

    def head_tables(self, blocks: int, heads: int) -> Tensor:
        """[heads, blocks, r]: head h's table drawn with seed (seed + h) mod 2**32."""
        draws = [
            self._table(blocks, self._causal, (self.seed + h) % SEED_SPAN) for h in range(heads)
        ]
        return torch.stack(draws)

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        # Bottom-right alignment puts the last query at position kv_len - 1, so both sides have
        # the same number of blocks and the draw depends on kv_len alone.
        num_blocks = (kv_len - 1) // self.block_size + 1
        table = self._table(num_blocks, causal=self._causal).to(device)
        return RandomBlocks(self.block_size, table, self if self.per_head else None)

    def causal_form(self) -> Pattern:
        return CausalRandom(
            self.block_size, self.num_blocks, self.seed, self.among, self.window_neighbors,
            self.global_blocks, self.global_position, self.per_head,
        )  # fmt: skip

    def _needs_lengths(self, *args: object) -> Tensor:
        raise TypeError("a random pattern needs its lengths first: call specialize(q_len, kv_len)")

    allowed = block_state = dense = _needs_lengths  # type: ignore[assignment]


@dataclass(frozen=True)
class CausalRandom(Random):
    """The causal form of ``Random``: query block i draws among blocks 0 .. i (module docstring)."""

    _causal = True

    def causal_form(self) -> Pattern:
        return self


@dataclass(frozen=True, eq=False)
class RandomBlocks(Pattern):
    """A ``Random`` pattern with its blocks drawn for one key length (compared by identity).

    ``table`` is [blocks, r], one table for every head, or [H, blocks, r], one per query head
    (``for_heads``), whose views carry a heads axis: ``allowed_at`` reads the head,
    ``block_state`` is [1, H, query blocks, key blocks] and ``dense`` [1, H, q_len, kv_len].
    ``source``: the ``Random`` drawn per head that made it (None: shared by every head, or the
    tables were given per head); a [blocks, r] table with a source is head 0's, whose views serve
    one-layout views (pictures, ``zoo.dense_mask``) until ``for_heads`` draws the others. A
    [H, blocks, r] table may be given directly (Hugging Face's per-head draw, say): it then runs
    on calls with H query heads."""

    block_size: int
    table: Tensor  # [blocks, r] or [H, blocks, r]; -1: no block
    source: Random | None = None

    @property
    def per_head(self) -> bool:  # type: ignore[override]
        return self.source is not None or self.table.dim() == 3

    @property
    def constant_block(self) -> int:
        return self.block_size

    @property
    def heads(self) -> int | None:
        """The number of query heads the tables were drawn for; None: one table (head 0's, or
        shared by every head)."""
        return self.table.shape[0] if self.table.dim() == 3 else None

    def for_heads(self, heads: int) -> Pattern:
        if self.heads is not None:
            if heads != self.heads:
                raise ValueError(
                    f"random blocks drawn for {self.heads} query heads, the call has {heads}"
                )
            return self
        if self.source is None:
            return self
        check_int("heads", heads)
        tables = self.source.head_tables(self.table.shape[0], heads).to(self.table.device)
        return RandomBlocks(self.block_size, tables, self.source)

    def head(self, h: int) -> Pattern:
        """Head h's table as a pattern of one layout (``Pattern.head``)."""
        return self if self.heads is None else RandomBlocks(self.block_size, self.table[h])

    def _hit(self, table: Tensor, q_pos: Tensor, kv_pos: Tensor, head: Tensor | None) -> Tensor:
        q_block = q_pos // self.block_size
        k_block = kv_pos // self.block_size
        last = table.shape[-2] - 1
        row = q_block.clamp(0, last)

        def at(column: int) -> Tensor:
            return table[row, column] if head is None else table[head, row, column]

        # One comparison per drawn column, no reduction: FlexAttention compiles a mask_mod as a
        # pointwise function of scalar indices, and a reduction inside it is miscompiled.
        hit = at(0) == k_block
        for column in range(1, table.shape[-1]):
            hit = hit | (at(column) == k_block)
        return hit & (q_block >= 0) & (q_block <= last)

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        if self.heads is not None:
            raise TypeError(
                "random blocks drawn per head differ per head: use allowed_at(b, h, ...)"
            )
        return self._hit(self.table, q_pos, kv_pos, None)

    def allowed_at(self, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        if self.heads is None:
            return self._hit(self.table, q_pos, kv_pos, None)
        return self._hit(self.table, q_pos, kv_pos, h)

    def _drawn_prefix_sums(self) -> Tensor:
        """2-D prefix sums of the [(H,) blocks, blocks] drawn-or-not matrix, a zero row and
        column first, for rectangle counts."""
        if "_sums" not in self.__dict__:
            drawn = torch.nn.functional.pad(self._drawn().to(torch.int32), (1, 0, 1, 0))
            sums = drawn.cumsum(-2, dtype=torch.int32).cumsum(-1, dtype=torch.int32)
            self.__dict__["_sums"] = sums
        return self.__dict__["_sums"]

    def _drawn(self) -> Tensor:
        """The [(H,) blocks, blocks] drawn-or-not matrix."""
        if "_drawn_blocks" not in self.__dict__:
            table = self.table if self.heads is not None else self.table[None]
            heads, n = table.shape[0], table.shape[1]
            # a last column takes the -1 slots (no block), then is cut off
            drawn = torch.zeros(heads, n, n + 1, dtype=torch.bool, device=table.device)
            drawn.scatter_(2, torch.where(table < 0, n, table), True)
            drawn = drawn[..., :n]
            self.__dict__["_drawn_blocks"] = drawn if self.heads is not None else drawn[0]
        return self.__dict__["_drawn_blocks"]

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        b, last = self.block_size, self.table.shape[-2] - 1
        # The rectangle of pattern blocks that the two kernel blocks touch; clamps only keep the
        # indices of empty spans in range (state_from marks those EMPTY anyway).
        q0, q1 = (torch.clamp(q.lo, min=0) // b).clamp(0, last), (q.hi // b).clamp(0, last)
        k0, k1 = (k.lo // b).clamp(0, last), (k.hi // b).clamp(0, last)
        reach = _reach(q, b), _reach(k, b)
        if None not in reach and reach[0] * reach[1] <= _MOST_READS:
            # Spans of a few pattern blocks each, known on the host (a lookup table's squares, a
            # natural order's kernel blocks): the rectangle's drawn blocks read one by one, not
            # through the prefix sums of every block pair.
            drawn = self._drawn()
            count = torch.zeros((), dtype=torch.int32, device=drawn.device)
            for dq, dk in itertools.product(range(reach[0]), range(reach[1])):
                i, j = (q0 + dq).clamp(max=last), (k0 + dk).clamp(max=last)
                hit = drawn[i, j] if self.heads is None else drawn[:, i, j]
                count = count + (hit & (q0 + dq <= q1) & (k0 + dk <= k1))
        else:
            sums = self._drawn_prefix_sums()
            if self.heads is None:
                count = sums[q1 + 1, k1 + 1] - sums[q0, k1 + 1] - sums[q1 + 1, k0] + sums[q0, k0]
            else:  # [H, ...]: one rectangle count per head
                count = (
                    sums[:, q1 + 1, k1 + 1] - sums[:, q0, k1 + 1] - sums[:, q1 + 1, k0]
                    + sums[:, q0, k0]
                )  # fmt: skip
        area = (q1 - q0 + 1) * (k1 - k0 + 1)
        some = (q.hi >= 0) & (count > 0)
        state = state_from(some, some & (count == area) & (q.lo >= 0), q, k)
        return state if self.heads is None else state[None]  # [1, H, ...]

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        if self.heads is not None:
            return torch.stack([self._dense(t, q_len, kv_len) for t in self.table])[None]
        return self._dense(self.table, q_len, kv_len)

    def _dense(self, table: Tensor, q_len: int, kv_len: int) -> Tensor:
        b, offset = self.block_size, kv_len - q_len
        mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
        for q_block, row in enumerate(table.tolist()):
            rows = slice(max(q_block * b - offset, 0), max((q_block + 1) * b - offset, 0))
            for k_block in (k for k in row if k >= 0):
                mask[rows, k_block * b : (k_block + 1) * b] = True
        return mask


# Pattern blocks a rectangle may hold before its drawn blocks are counted by prefix sums.
_MOST_READS = 16


def _reach(spans: Spans, block: int) -> int | None:
    """The most pattern blocks of ``block`` positions that one of ``spans`` touches, where the
    host knows it (``Spans.aligned``: each span lies in an aligned run of that many positions);
    else None."""
    run = spans.aligned
    if run is None:
        return None
    if block % run == 0:
        return 1
    if run % block == 0:
        return run // block
    return -(-(run - 1) // block) + 1
