"""``block_local``: non-overlapping chunks, the "truncated" attention (LRA's local baseline).

The sequence is cut into chunks of ``block_size`` positions (chunk c holds positions c*b ..
c*b + b - 1; the last chunk is shorter when the length is not a multiple). Query position i attends
key position j when their chunks are at most ``neighbors`` apart: ``neighbors=0`` gives isolated
chunks, ``neighbors=1`` the three-block sliding window of BigBird::

    block_size=2, neighbors=0 (5x5)    block_size=2, neighbors=1
    x x . . .                          x x x x .
    x x . . .                          x x x x .
    . . x x .                          x x x x x
    . . x x .                          x x x x x
    . . . . x                          . . x x x
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.arguments import check_int
from .base import Pattern, Spans, query_positions, state_from
from .families import register_pattern


@register_pattern("block_local")
@dataclass(frozen=True)
class BlockLocal(Pattern):
    """Key position j is allowed for query position i when |i // b - j // b| <= neighbors."""

    block_size: int = 64
    neighbors: int = 0

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size)
        check_int("neighbors", self.neighbors, minimum=0)

    @property
    def constant_block(self) -> int:
        return self.block_size

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return (q_pos // self.block_size - kv_pos // self.block_size).abs() <= self.neighbors

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        b = self.block_size
        q_first, q_last, k_first, k_last = q.lo // b, q.hi // b, k.lo // b, k.hi // b
        gap = torch.clamp(torch.maximum(k_first - q_last, q_first - k_last), min=0)
        widest = torch.maximum(q_last - k_first, k_last - q_first)
        return state_from(gap <= self.neighbors, widest <= self.neighbors, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        # Build the chunk-level matrix, then expand each chunk to its positions.
        q_chunk = query_positions(q_len, kv_len) // self.block_size
        k_chunk = torch.arange(kv_len) // self.block_size
        first = int(min(q_chunk.min(), 0))
        last = int(max(q_chunk.max(), k_chunk.max()))
        chunks = torch.arange(first, last + 1)
        near = (chunks[:, None] - chunks[None, :]).abs() <= self.neighbors
        return near[q_chunk - first][:, k_chunk - first]
