"""Which global positions each rank holds under context parallelism, and the helpers that cut a
whole sequence into a rank's shard and put the shards back together.

The global sequence of length L = world * shard is cut into chunks. ``contiguous`` (the default):
one chunk per rank, rank r holds positions [r * shard, (r + 1) * shard). ``head_tail`` (the load
balance of PyTorch's ``context_parallel`` and Megatron): 2 * world chunks of shard / 2, rank r
holds chunk r and chunk 2 * world - 1 - r, in that order, so that under a causal pattern every
rank computes about as many pairs (the first rank's early queries read few keys, its late ones
many)::

    world 2, L 8        contiguous           head_tail
    positions           0 1 2 3 | 4 5 6 7    0 1 | 2 3 | 4 5 | 6 7
    rank 0 holds        0 1 2 3              0 1 6 7
    rank 1 holds        4 5 6 7              2 3 4 5
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ORDERS = ("contiguous", "head_tail")


@dataclass(frozen=True)
class ShardLayout:
    """The chunks of a sequence of ``world * shard`` positions and the rank that holds each."""

    world: int
    shard: int  # positions per rank
    order: str  # one of ORDERS

    @property
    def length(self) -> int:
        return self.world * self.shard

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.order == "head_tail" else 1

    @property
    def chunk(self) -> int:
        """Positions per chunk."""
        return self.shard // self.chunks_per_rank

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The global chunks that ``rank`` holds, in the order of its shard (increasing)."""
        if self.order == "head_tail":
            return (rank, 2 * self.world - 1 - rank)
        return (rank,)

    def owner(self, chunk: int) -> tuple[int, int]:
        """(rank, first row in that rank's shard) of a global chunk."""
        if self.order == "head_tail" and chunk >= self.world:
            return 2 * self.world - 1 - chunk, self.chunk
        return chunk, 0

    def positions(self, rank: int) -> Tensor:
        """[shard] the global positions of ``rank``'s rows, increasing."""
        return torch.cat(
            [torch.arange(c * self.chunk, (c + 1) * self.chunk) for c in self.chunks_of(rank)]
        )


def check_order_name(order: object) -> None:
    """Raise ValueError for a ``cp_order`` that names no order (a call without cp_group too)."""
    problem = _unknown_order(order)
    if problem is not None:
        raise ValueError(problem)


def _unknown_order(order: object) -> str | None:
    return None if order in ORDERS else f"cp_order must be one of {ORDERS}, got {order!r}"


def check_order(order: object, shard: int) -> str | None:
    """The reason ``order`` cannot cut shards of ``shard`` rows, or None."""
    unknown = _unknown_order(order)
    if unknown is not None:
        return unknown
    if order == "head_tail" and shard % 2:
        return (
            f"cp_order='head_tail' cuts each rank's shard into two halves, but the shard length is "
            f"{shard}, odd; pad the sequence to a multiple of 2 * world size (and pass the padding "
            "as key_padding_mask), or use cp_order='contiguous'"
        )
    return None


def shard(x: Tensor, rank: int, world: int, *, dim: int = -2, order: str = "contiguous") -> Tensor:
    """Rank ``rank``'s shard of a whole sequence ``x`` along ``dim`` (length divisible by
    ``world``; by 2 * world for ``head_tail``), as ``zoo.attention(..., cp_group=...)`` takes it:
    dim -2 for q, k, v (B, H, L, D), dim 1 for a key padding mask (B, L) or an input (B, L, dim)."""
    if order not in ORDERS:  # not a length to pad: the order itself is unknown
        raise ValueError(f"shard: order must be one of {ORDERS}, got {order!r}")
    if not 0 <= rank < world:
        raise ValueError(
            f"shard: rank {rank} is not one of the {world} ranks of the group (0 to {world - 1})"
        )
    length = x.shape[dim]
    parts = 2 * world if order == "head_tail" else world
    if length % parts:
        raise ValueError(
            f"shard: x has length {length} along dim {dim}, which cp_order={order!r} cannot cut "
            f"into {world} equal shards; pad it to a multiple of {parts}"
        )
    layout = ShardLayout(world, length // world, order)
    index = layout.positions(rank).to(x.device)
    return x.index_select(dim, index)


def unshard(shards: list[Tensor], *, dim: int = -2, order: str = "contiguous") -> Tensor:
    """The whole sequence from every rank's shard (rank order): the inverse of ``shard``."""
    # The join reorders by positions made from the first shard's length and the order: shards it
    # does not describe would come back with rows dropped or out of place, without an error.
    lengths = [part.shape[dim] for part in shards]
    if order not in ORDERS:
        raise ValueError(f"unshard: order must be one of {ORDERS}, got {order!r}")
    if not shards or len(set(lengths)) > 1:
        raise ValueError(
            f"unshard: the shards have lengths {lengths} along dim {dim}; pass every rank's "
            "shard, in rank order, each of the same length (as shard cuts them)"
        )
    if order == "head_tail" and lengths[0] % 2:
        raise ValueError(
            f"unshard: order='head_tail' joins shards of two equal halves, but the shards have "
            f"{lengths[0]} rows along dim {dim}, odd; were they cut with order='contiguous'?"
        )
    world = len(shards)
    layout = ShardLayout(world, shards[0].shape[dim], order)
    joined = torch.cat(shards, dim=dim)
    where = torch.cat([layout.positions(r) for r in range(world)])
    return joined.index_select(dim, torch.argsort(where).to(joined.device))
