"""Context parallelism for a pattern chosen by content (MoBA): the choice, then the plan, per call.

A routed pattern's blocks depend on the data, so no plan can be made from block states alone, the
same on every rank, as ``exchange_plan`` makes one. Instead, per call:

1. each rank sums its keys per block of the routed pattern's ``block_size`` (padded keys left
   out, in float32, as ``zoo.decoding.block_sums`` does for one process) and the ranks add
   their sums up (``all_reduce``): every rank then holds the sums and counts of every block of
   the whole sequence, (B, H_kv, blocks, D) and (B, blocks), a few KiB where the keys are MiB;
2. each rank binds the pattern, per chunk it holds, to that chunk's queries at their global
   positions and those sums (``RouteInputs.block_sums``): each query's blocks, as one process
   chooses them up to float32 rounding (the sums and scores are reduced over tensors of other
   shapes, and a block that two ranks share is added in another order), which can flip a
   choice within rounding of a tie;
3. the key blocks of the plan that some query block of the rank reads (from the bound
   pattern's block states) are what it fetches; the ranks exchange which blocks each needs
   (one ``all_gather`` of a flag per plan block), so that each knows what to send;
4. the calls are those of a fixed pattern (``exchange_plan.planned_calls``: interior rows
   during the exchange, a call per chunk), each through its chunk's bound pattern at global
   positions (``AtPositions``).

Only patterns whose routed parts choose from block sums can run so (MoBA and its compositions,
``moba | sliding_window``); the choice gets no gradient, as in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..decoding.block_sums import block_sums
from ..patterns import Pattern
from ..patterns.base import EMPTY
from ..patterns.compose import Difference, Intersection, Union
from ..patterns.moba import Moba
from ..patterns.routed import RouteInputs
from .exchange_plan import (
    RankPlan,
    block_spans,
    fetched_rows,
    plan_keys,
    planned_calls,
    rank_plan,
    spans_on,
    wanted_rows,
)
from .shards import ShardLayout


def routed_leaves(pattern: Pattern) -> list[Pattern]:
    """The routed patterns a composition is made of."""
    if isinstance(pattern, Union | Intersection):
        return [leaf for child in pattern.children for leaf in routed_leaves(child)]
    if isinstance(pattern, Difference):
        return routed_leaves(pattern.include) + routed_leaves(pattern.exclude)
    return [pattern] if pattern.routed else []


def unshardable_reason(pattern: Pattern) -> str | None:
    """Why a routed pattern cannot run sharded, or None where each routed part is MoBA's."""
    others = [type(p).__name__ for p in routed_leaves(pattern) if not isinstance(p, Moba)]
    if not others:
        return None
    return (
        f"its routed part {others[0]} chooses from more than the block sums of the keys, which "
        "is all the ranks share"
    )


@torch.no_grad()
def global_block_sums(
    k: Tensor, padding: Tensor | None, layout: ShardLayout, rank: int, block: int, group
) -> tuple[Tensor, Tensor]:
    """(B, H_kv, blocks, D) float32 sums of the unpadded keys of each block of ``block``
    positions of the whole sequence, and (B, blocks) their counts, from every rank's shard."""
    B, kv_heads, _, dim = k.shape
    blocks = -(-layout.length // block)
    sums = k.new_zeros(B, kv_heads, blocks, dim, dtype=torch.float32)
    counts = k.new_zeros(B, blocks, dtype=torch.float32)  # all_reduce: one dtype for both
    keep = torch.ones(B, k.shape[2], dtype=torch.bool, device=k.device)
    keep = keep if padding is None else ~padding
    for index, chunk in enumerate(layout.chunks_of(rank)):
        start = chunk * layout.chunk
        rows = slice(index * layout.chunk, (index + 1) * layout.chunk)
        lead = start % block  # zeros before the chunk, so that its blocks are the sequence's
        keys = torch.nn.functional.pad(k[:, :, rows], (0, 0, lead, 0))
        kept = torch.nn.functional.pad(keep[:, rows], (lead, 0))
        part, count = block_sums(keys, kept, block)
        at = torch.arange(start // block, start // block + part.shape[2], device=k.device)
        sums.index_add_(2, at, part)
        counts.index_add_(1, at, count.float())
    dist.all_reduce(sums, group=group)
    dist.all_reduce(counts, group=group)
    return sums, counts.round().long()


def bind_chunks(
    pattern: Pattern, q: Tensor, k: Tensor, padding: Tensor | None, causal: bool,
    layout: ShardLayout, rank: int, group,
) -> dict[int, Pattern]:  # fmt: skip
    """chunk -> ``pattern`` bound to the queries of that chunk of the rank (q: the rank's
    shard, turned by rope), at their global positions, choosing from every block's sums."""
    sizes = {leaf.block_size for leaf in routed_leaves(pattern)}
    every = {size: global_block_sums(k, padding, layout, rank, size, group) for size in sizes}
    bound = {}
    for index, chunk in enumerate(layout.chunks_of(rank)):
        rows = q[:, :, index * layout.chunk : (index + 1) * layout.chunk]
        end = (chunk + 1) * layout.chunk
        # Keys of the chunk's end as the call's length: the queries' positions are then the
        # chunk's, aligned to the last keys. Only its shape is read (the sums stand for keys).
        like = k.new_zeros(()).expand(k.shape[0], k.shape[1], end, k.shape[3])
        inputs = RouteInputs(rows, like, None, causal, block_sums=every.get)
        bound[chunk] = pattern.bind(inputs)
    return bound


def routed_plan(
    bound: dict[int, Pattern], layout: ShardLayout, rank: int, block: int, device: torch.device,
    group,
) -> tuple[RankPlan, dict[int, Tensor]]:  # fmt: skip
    """(this rank's plan, peer -> the rows of its shard it sends the peer) for the chunks'
    bound patterns: the key blocks some query block of the rank reads, from every other rank,
    told to the others in one ``all_gather``."""
    block = max(1, min(block, layout.chunk))
    keys, key_owner = plan_keys(layout, block)
    reads = []
    for chunk in layout.chunks_of(rank):
        q = block_spans(layout, (chunk,), block)
        state = bound[chunk].block_state(spans_on(q, device).column(), spans_on(keys, device).row())
        reads.append((state != EMPTY).flatten(0, -3).any(dim=0).cpu())  # [q blocks, k blocks]
    reads = torch.cat(reads)
    q = block_spans(layout, layout.chunks_of(rank), block)
    others = key_owner != rank
    needed = reads.any(dim=0) & others
    flags = needed.to(device=device, dtype=torch.uint8)
    every = [torch.empty_like(flags) for _ in range(layout.world)]
    dist.all_gather(every, flags, group=group)
    wide = torch.zeros(reads.shape[0], dtype=torch.bool)
    calls = [planned_calls(reads, wide, others, rank, layout, q, keys, split)
             for split in (True, False)]  # fmt: skip
    mine = rank_plan(rank, layout, wanted_rows(needed[None], keys, layout, rank),
                     torch.zeros(0, dtype=torch.long), (), *calls)  # fmt: skip
    sends = {}
    for peer, flag in enumerate(every):
        if peer != rank:
            theirs = fetched_rows(wanted_rows(flag.cpu().bool()[None], keys, layout, peer), layout)
            if rank in theirs:
                sends[peer] = theirs[rank]
    return mine, sends
