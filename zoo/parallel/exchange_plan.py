"""The exchange plan: which key/value rows each rank fetches from each other rank.

Every rank's chunks (``zoo.parallel.shards``) are cut into blocks of at most ``block`` positions
that start at each chunk's first position, so that no block straddles two ranks. A rank needs a
key block where the pattern's ``block_state`` (specialised at the GLOBAL length, so random blocks
and global tokens are those of the whole sequence) says that some query block of the rank reads
it: never an EMPTY block. The plan is built from the block states alone, the same on every rank,
so no rank has to tell another what it needs: a rank sends what the plan says its peers need.
A rank always keeps all of its own keys; it fetches the needed blocks of the others'.

Wide query rows are computed where their keys are. A query block that reads more than half of
another rank's key blocks (Longformer's global token, BigBird's first and last blocks) would
make its rank fetch nearly every shard, bytes that grow with the length. Instead the rank may
ship those query blocks (its "wide rows") to every other rank whose keys they read; each of
those ranks returns a partial output and log-sum-exp of them against its own keys, and the rank
merges the partials (``zoo.parallel.wide``). A rank ships when the key rows that only its wide
blocks read cost more bytes than shipping them: ``ship_ratio`` is what one shipped query row
costs (the query, and its partial back from each owner) in key/value rows; None ships nothing.
For ``full`` every query block is wide and nothing is saved, so it fetches as a ring does.

The calls. A rank computes its narrow (not wide) rows in a few ordinary calls (``CallPlan``), one
per chunk it holds, and with overlap one per chunk and class of rows (``calls``): interior
rows, whose query blocks read no other rank's key block (the inside of a window's shard: all but
a halo's worth of rows at each end), run against its own keys while the exchange is in flight;
edge rows wait for the fetched keys. Without overlap a chunk's rows run in one call
(``serial_calls``): a split costs a copy of the call's queries and of the output. Each call reads
the run of keys, in position order, from the first its rows' blocks read to the last: under a
causal pattern that is every key up to its chunk's end, so the call is causal attention aligned
to the last keys, which dense kernels run without a mask (``AtPositions.kind``), also for the
two chunks of a head-tail shard.

Where the pattern differs per head (BigBird's random blocks), a fetched row travels for the
key/value heads whose query heads read it (``fetch_heads``); the other heads' slots of it stay
zero, which no call of theirs reads.

What this costs per rank, for a shard of s positions and blocks of b: a window of w keys fetches
ceil(w / b) blocks from each neighbour (a halo), global tokens their blocks once, a global query
block its b rows to each rank and their partials back, a random block its block for the heads
that drew it, and ``full`` every other rank's whole shard: (world - 1) * s rows, what a ring
passes round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.shape_cache import per_shape
from ..patterns.base import EMPTY, FULL, PARTIAL, Pattern, Spans
from .shards import ShardLayout

PLAN_BLOCK = 64  # positions per block of the plan: the unit in which keys are fetched
# The share of a rank's rows it may ship. Wide rows are the few that read nearly every key
# (global tokens); shipping more would move a real part of the rank's work onto the ranks it
# ships to, and undo a balanced order: under causal, head-tail's late chunk (half a shard)
# reads every earlier key, and shipped it made the rank it went to the slowest.
MAX_SHIPPED = 0.25


@dataclass(frozen=True, eq=False)
class CallPlan:
    """One ordinary call of a rank: some of its query rows against a run of the keys it holds,
    ``[first, stop)`` of its own keys (``interior``: the call needs nothing fetched) or of the
    keys it attends, own and fetched (``RankPlan.kv_positions``)."""

    interior: bool
    rows: Tensor  # [r] rows of the shard, sorted, all of one chunk
    first: int
    stop: int


@dataclass(frozen=True, eq=False)
class RankPlan:
    """What one rank receives and how it lays out the keys it attends."""

    rank: int
    q_positions: Tensor  # [shard] global positions of its queries (and own keys), increasing
    kv_positions: Tensor  # [m] global positions of the keys it attends: own and fetched, sorted
    fetch: dict[int, Tensor]  # owner rank -> [n] rows of the owner's shard it receives, sorted
    # The keys it attends as slices, in position order: (-1, first, count) of its own shard,
    # (p, first, count) of the rows it receives from rank p.
    pieces: tuple[tuple[int, int, int], ...]
    wide_rows: Tensor  # [g] rows of its shard it ships (its wide query rows), sorted; often none
    ship_to: tuple[int, ...]  # the ranks it ships them to, each returning their partials
    calls: tuple[CallPlan, ...]  # its narrow rows' calls with overlap, interior ones first
    serial_calls: tuple[CallPlan, ...]  # the same rows without overlap: a call per chunk
    # owner rank -> [heads, n] which heads read each row of ``fetch``: 1 head where the pattern
    # is the same for every head, else each query head (a row is sent for those heads only).
    fetch_heads: dict[int, Tensor]

    @property
    def received_rows(self) -> int:
        """Key/value rows it fetches."""
        return sum(int(rows.numel()) for rows in self.fetch.values())

    @property
    def interior_rows(self) -> int:
        """How many query rows it computes while the exchange is in flight."""
        return sum(call.rows.numel() for call in self.calls if call.interior)

    @property
    def wide_positions(self) -> Tensor:
        return self.q_positions[self.wide_rows]


@dataclass(frozen=True, eq=False)
class ExchangePlan:
    """The plan of every rank (compared by identity; built once per shape)."""

    layout: ShardLayout
    block: int
    ranks: tuple[RankPlan, ...]

    def sends(self, rank: int) -> dict[int, Tensor]:
        """peer -> rows of ``rank``'s shard that the peer receives from it."""
        return {peer.rank: peer.fetch[rank] for peer in self.ranks if rank in peer.fetch}

    @property
    def ships(self) -> bool:
        """Whether any rank ships wide query rows (the same answer on every rank)."""
        return any(r.ship_to for r in self.ranks)

    def shippers(self, rank: int) -> dict[int, int]:
        """peer -> how many wide query rows ``rank`` receives from it (to return their partials)."""
        return {r.rank: r.wide_rows.numel() for r in self.ranks if rank in r.ship_to}


def block_spans(layout: ShardLayout, chunks: tuple[int, ...], block: int) -> Spans:
    """Spans of the blocks of ``chunks`` (each cut into blocks from its first position)."""
    lo = torch.cat([torch.arange(c * layout.chunk, (c + 1) * layout.chunk, block) for c in chunks])
    hi = torch.minimum(lo + block, (lo // layout.chunk + 1) * layout.chunk) - 1
    return Spans(lo, hi, 1, torch.ones_like(lo, dtype=torch.bool))


def block_states(
    pattern: Pattern, layout: ShardLayout, rank: int, block: int, device: torch.device
) -> Tensor:
    """[heads, query blocks of ``rank``, key blocks of the whole sequence] EMPTY / PARTIAL /
    FULL: one head where the pattern is the same for every head, else each query head's (spans
    on ``device``, the pattern's)."""
    every_chunk = tuple(range(layout.world * layout.chunks_per_rank))
    q = block_spans(layout, layout.chunks_of(rank), block)
    k = block_spans(layout, every_chunk, block)
    state = pattern.block_state(spans_on(q, device).column(), spans_on(k, device).row()).cpu()
    return state.reshape(-1, *state.shape[-2:])  # [1, H, ...] of a layout drawn per head


@per_shape(maxsize=64)
def exchange_plan(
    pattern: Pattern,
    layout: ShardLayout,
    block: int,
    device: torch.device,
    ship_ratio: float | None = None,
) -> ExchangePlan:
    """The plan of every rank for ``pattern`` specialised at ``layout.length`` on ``device``
    (see the module docstring); its index tensors live on the CPU."""
    block = max(1, min(block, layout.chunk))
    keys, key_owner = plan_keys(layout, block)
    plans = []
    for rank in range(layout.world):
        reads_per_head = block_states(pattern, layout, rank, block, device) != EMPTY
        reads = reads_per_head.any(dim=0)  # [q blocks, k blocks]: some head reads
        q = block_spans(layout, layout.chunks_of(rank), block)
        wide, ship_to = _wide_blocks(reads_per_head, key_owner, rank, q, keys, ship_ratio)
        needed_per_head = reads_per_head[:, ~wide].any(dim=1)  # [heads, k blocks]
        positions = layout.positions(rank)
        wide_rows = _rows_of(q, wide, positions)
        calls = [planned_calls(reads, wide, key_owner != rank, rank, layout, q, keys, split)
                 for split in (True, False)]  # fmt: skip
        wanted = wanted_rows(needed_per_head, keys, layout, rank)
        plans.append(rank_plan(rank, layout, wanted, wide_rows, ship_to, *calls))
    return ExchangePlan(layout, block, tuple(plans))


@per_shape(maxsize=64)
def plan_keys(layout: ShardLayout, block: int) -> tuple[Spans, Tensor]:
    """(the plan's key blocks over the whole sequence, [key blocks] the rank holding each)."""
    keys = block_spans(layout, tuple(range(layout.world * layout.chunks_per_rank)), block)
    chunk_owner = torch.tensor(
        [layout.owner(c)[0] for c in range(layout.world * layout.chunks_per_rank)]
    )
    return keys, chunk_owner[keys.lo // layout.chunk]


def _positions_in(lo: Tensor, hi: Tensor) -> Tensor:
    """lo[0] .. hi[0], lo[1] .. hi[1], ...: the positions of the spans, one tensor."""
    sizes = hi - lo + 1
    first_of_span = (torch.cumsum(sizes, 0) - sizes).repeat_interleave(sizes)
    return lo.repeat_interleave(sizes) + torch.arange(int(sizes.sum())) - first_of_span


def wanted_rows(
    needed_per_head: Tensor, keys: Spans, layout: ShardLayout, rank: int
) -> dict[int, tuple[Tensor, Tensor]]:
    """chunk of another rank -> (the global positions ``rank`` fetches from it, [heads,
    positions] the heads that read each), from ``needed_per_head`` [heads, key blocks]."""
    needed, wanted = needed_per_head.any(dim=0), {}
    sizes = keys.hi - keys.lo + 1
    for chunk in range(layout.world * layout.chunks_per_rank):
        if layout.owner(chunk)[0] == rank:
            continue
        first, last = chunk * layout.chunk, (chunk + 1) * layout.chunk
        in_chunk = needed & (keys.lo >= first) & (keys.lo < last)
        if in_chunk.any():
            heads = needed_per_head[:, in_chunk].repeat_interleave(sizes[in_chunk], dim=1)
            wanted[chunk] = (_positions_in(keys.lo[in_chunk], keys.hi[in_chunk]), heads)
    return wanted


def fetched_rows(wanted: dict, layout: ShardLayout) -> dict[int, Tensor]:
    """owner rank -> the rows of its shard in ``wanted`` (``wanted_rows``), sorted."""
    fetch: dict[int, list[Tensor]] = {}
    for chunk, (positions, _) in sorted(wanted.items()):  # a peer's rows: chunk order
        owner, row0 = layout.owner(chunk)
        fetch.setdefault(owner, []).append(positions - chunk * layout.chunk + row0)
    return {owner: torch.cat(rows) for owner, rows in sorted(fetch.items())}


def planned_calls(
    reads: Tensor, wide: Tensor, others: Tensor, rank: int, layout: ShardLayout, q: Spans,
    keys: Spans, split: bool,
) -> list[tuple[bool, Tensor, int | None, int | None]]:  # fmt: skip
    """(interior, rows, first and last global key position read, or None) of each call of the
    rank. ``split``: per chunk it holds, its interior query blocks (reading no key block of
    ``others``), then per chunk its other narrow blocks; else per chunk its narrow blocks."""
    interior = ~wide & ~reads[:, others].any(dim=1)
    chunk_of = q.lo // layout.chunk
    positions = layout.positions(rank)
    kinds = ((True, interior), (False, ~wide & ~interior)) if split else ((False, ~wide),)
    calls = []
    for is_interior, kind in kinds:
        for chunk in layout.chunks_of(rank):
            blocks = kind & (chunk_of == chunk)
            if not blocks.any():
                continue
            read = reads[blocks].any(dim=0)
            hull = (None, None)
            if read.any():
                hull = (int(keys.lo[read].min()), int(keys.hi[read].max()))
            calls.append((is_interior, _rows_of(q, blocks, positions), *hull))
    return calls


def _rows_of(q: Spans, blocks: Tensor, positions: Tensor) -> Tensor:
    """The rows of a rank's shard (global ``positions``) in its query blocks ``blocks`` (mask)."""
    return torch.searchsorted(positions, _positions_in(q.lo[blocks], q.hi[blocks]))


def _wide_blocks(
    reads_per_head: Tensor, key_owner: Tensor, rank: int, q: Spans, keys: Spans,
    ship_ratio: float | None,
) -> tuple[Tensor, tuple[int, ...]]:  # fmt: skip
    """([q blocks] which of the rank's query blocks it ships, the ranks it ships them to), from
    ``reads_per_head`` [heads, q blocks, k blocks].

    Candidates: the blocks that read more than half of some other rank's key blocks (a partial
    computed densely then costs at most twice what the pattern reads). Taking them widest first,
    up to ``MAX_SHIPPED`` of the rank's rows, the rank ships the set that saves the most bytes:
    the key rows that only shipped blocks read, per head (a row travels for the heads that read
    it), less ``ship_ratio`` key rows per shipped query row and rank shipped to. None where no
    set saves anything (``full``: every block is wide and shipping all saves less than it
    costs)."""
    reads = reads_per_head.any(dim=0)
    nothing = torch.zeros(reads.shape[0], dtype=torch.bool), ()
    if ship_ratio is None:
        return nothing
    others = key_owner != rank
    candidate = torch.zeros(reads.shape[0], dtype=torch.bool)
    for owner in set(key_owner.tolist()) - {rank}:
        of_owner = key_owner == owner
        candidate |= reads[:, of_owner].sum(dim=1) * 2 > int(of_owner.sum())
    widest = sorted(torch.nonzero(candidate).flatten().tolist(),
                    key=lambda b: -int((reads[b] & others).sum()))  # fmt: skip
    key_rows, q_rows = keys.hi - keys.lo + 1, q.hi - q.lo + 1
    heads = reads_per_head.shape[0]
    narrow_readers = reads_per_head.sum(dim=1)  # [heads, k blocks] unshipped blocks reading
    read_by_shipped = torch.zeros_like(narrow_readers, dtype=torch.bool)
    best, best_count, shipped_rows = 0.0, 0, 0
    for count, block in enumerate(widest, start=1):
        if shipped_rows + int(q_rows[block]) > MAX_SHIPPED * int(q_rows.sum()):
            break
        narrow_readers -= reads_per_head[:, block].long()
        read_by_shipped |= reads_per_head[:, block]
        shipped_rows += int(q_rows[block])
        unread = read_by_shipped & (narrow_readers == 0) & others  # [heads, k blocks]
        saved = float((unread * key_rows).sum()) / heads  # in rows of every head
        owners = int(key_owner[read_by_shipped.any(dim=0) & others].unique().numel())
        if saved - ship_ratio * shipped_rows * owners > best:
            best, best_count = saved - ship_ratio * shipped_rows * owners, count
    if not best_count:
        return nothing
    wide = torch.zeros(reads.shape[0], dtype=torch.bool)
    wide[widest[:best_count]] = True
    ship_to = tuple(sorted(set(key_owner[reads[wide].any(dim=0) & others].tolist())))
    return wide, ship_to


def rank_plan(
    rank: int,
    layout: ShardLayout,
    wanted: dict[int, Tensor],
    wide_rows: Tensor,
    ship_to: tuple[int, ...],
    calls: list[tuple[bool, Tensor, int | None, int | None]],
    serial_calls: list[tuple[bool, Tensor, int | None, int | None]],
) -> RankPlan:
    """The rank's plan from the positions it fetches per chunk of another rank (and the heads
    that read each)."""
    heads: dict[int, list[Tensor]] = {}
    for chunk, (_, readers) in sorted(wanted.items()):
        heads.setdefault(layout.owner(chunk)[0], []).append(readers)
    fetched = fetched_rows(wanted, layout)
    fetch_heads = {owner: torch.cat(readers, dim=1) for owner, readers in sorted(heads.items())}
    next_row = dict.fromkeys(fetched, 0)  # each peer's rows arrive as one tensor, sorted
    pieces, positions = [], []
    for chunk in range(layout.world * layout.chunks_per_rank):
        owner, row0 = layout.owner(chunk)
        if owner == rank:
            pieces.append((-1, row0, layout.chunk))
            positions.append(torch.arange(chunk * layout.chunk, (chunk + 1) * layout.chunk))
        elif chunk in wanted:
            count = wanted[chunk][0].numel()
            pieces.append((owner, next_row[owner], count))
            next_row[owner] += count
            positions.append(wanted[chunk][0])
    own, attended = layout.positions(rank), torch.cat(positions)

    def planned(calls) -> tuple[CallPlan, ...]:
        made = []
        for interior, rows, lo, hi in calls:
            held = own if interior else attended
            first, stop = 0, held.numel()  # rows that read no key: any run, all masked
            if lo is not None:
                first = int(torch.searchsorted(held, lo))
                stop = int(torch.searchsorted(held, hi, right=True))
            made.append(CallPlan(interior, rows, first, stop))
        return tuple(made)

    return RankPlan(
        rank, own, attended, fetched, tuple(pieces), wide_rows, ship_to, planned(calls),
        planned(serial_calls), fetch_heads,
    )  # fmt: skip


def pairs_per_rank(
    pattern: Pattern, layout: ShardLayout, rank: int, block: int, device: torch.device
) -> float:
    """The (query, key) pairs the pattern allows for ``rank``'s queries over the whole sequence,
    per head (the mean over heads where the pattern differs per head): full blocks counted by
    size, partial blocks by evaluating the pattern on them, empty blocks never."""
    block = max(1, min(block, layout.chunk))
    q = block_spans(layout, layout.chunks_of(rank), block)
    k = block_spans(layout, tuple(range(layout.world * layout.chunks_per_rank)), block)
    state = pattern.block_state(spans_on(q, device).column(), spans_on(k, device).row()).cpu()
    state = state.reshape(-1, *state.shape[-2:])  # [heads (1 where shared), q blocks, k blocks]
    q_size, k_size = q.hi - q.lo + 1, k.hi - k.lo + 1
    total = float(((state == FULL) * q_size[:, None] * k_size[None, :]).sum())
    heads, qb, kb = torch.nonzero(state == PARTIAL, as_tuple=True)
    offsets = torch.arange(block)
    for part in torch.split(torch.arange(heads.numel()), 1024):
        q_pos, k_pos = q.lo[qb[part], None] + offsets, k.lo[kb[part], None] + offsets
        q_ok, k_ok = offsets < q_size[qb[part], None], offsets < k_size[kb[part], None]
        head = heads[part].to(device)[:, None, None]
        hit = pattern.allowed_at(
            head * 0, head, q_pos.to(device)[:, :, None], k_pos.to(device)[:, None, :]
        ).cpu()
        total += float((hit & q_ok[:, :, None] & k_ok[:, None, :]).sum())
    return total / state.shape[0]


def spans_on(spans: Spans, device: torch.device) -> Spans:
    return Spans(spans.lo.to(device), spans.hi.to(device), 1, spans.complete.to(device))
