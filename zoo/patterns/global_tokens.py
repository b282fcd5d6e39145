"""``global``: chosen positions attend to every key, and every query attends to them.

``global_tokens`` counts in blocks of ``block_size`` positions (one position by default): an int n
makes the first n blocks global, a list names block indices. BigBird's two global blocks of 64 are
``global_tokens=2, block_size=64``; Longformer's [CLS] token is ``global_tokens=1``::

    global_tokens=1 (5x5)     global_tokens=[0, 3]
    x x x x x                 x x x x x
    x x . . .                 x x . x .
    x . x . .                 x . x x .
    x . . x .                 x x x x x
    x . . . x                 x . . x x

(Pictures with the diagonal are this pattern united with ``local``; alone, a non-global query sees
the global keys only.) An int n means the first n blocks, so a shorter sequence (a short prompt)
has fewer global keys. A listed block must exist among the keys: one that starts at or beyond
``kv_len`` is an error, not a silent change of pattern.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.arguments import check_int, check_int_list
from .base import Pattern, Spans, query_positions, state_from
from .families import register_pattern


def _ranges(blocks: tuple[int, ...], block_size: int) -> tuple[tuple[int, int], ...]:
    """Sorted block indices as merged [start, stop) position ranges."""
    merged: list[list[int]] = []
    for b in blocks:
        if merged and merged[-1][1] == b * block_size:
            merged[-1][1] += block_size
        else:
            merged.append([b * block_size, (b + 1) * block_size])
    return tuple((start, stop) for start, stop in merged)


def _count_in(lo: Tensor, hi: Tensor, step: int, start: int, stop: int) -> Tensor:
    """How many of the positions lo, lo + step, ..., hi lie in [start, stop)."""
    first = lo + torch.clamp(start - lo + step - 1, min=0) // step * step
    last = torch.clamp(hi, max=stop - 1)
    return torch.where(last >= first, (last - first) // step + 1, 0)


@register_pattern("global")
@dataclass(frozen=True)
class Global(Pattern):
    """Queries and keys at the global positions see and are seen by everything."""

    global_tokens: int | tuple[int, ...] = 1
    block_size: int = 1

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size)
        if isinstance(self.global_tokens, list | tuple):
            blocks = check_int_list("global_tokens", self.global_tokens)
            object.__setattr__(self, "global_tokens", blocks)
        else:
            blocks = tuple(range(check_int("global_tokens", self.global_tokens)))
        object.__setattr__(self, "_ranges", _ranges(blocks, self.block_size))

    @property
    def constant_block(self) -> int:
        return self.block_size

    def _is_global(self, pos: Tensor) -> Tensor:
        hits = [(pos >= start) & (pos < stop) for start, stop in self._ranges]
        out = hits[0]
        for hit in hits[1:]:
            out = out | hit
        return out

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return self._is_global(q_pos) | self._is_global(kv_pos)

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        def global_count(s: Spans) -> tuple[Tensor, Tensor]:
            count = sum(_count_in(s.lo, s.hi, s.step, a, b) for a, b in self._ranges)
            size = torch.clamp((s.hi - s.lo) // s.step + 1, min=0)
            return count, size

        q_count, q_size = global_count(q)
        k_count, k_size = global_count(k)
        some = (q_count > 0) | (k_count > 0)
        every = (q_count == q_size) | (k_count == k_size)
        return state_from(some, every, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
        q_pos = query_positions(q_len, kv_len)
        for start, stop in self._ranges:
            mask[:, start:stop] = True
            mask[(q_pos >= start) & (q_pos < stop)] = True
        return mask

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        start = self._ranges[-1][1] - self.block_size  # the last global block's first position
        if isinstance(self.global_tokens, tuple) and start >= kv_len:  # a listed block
            raise ValueError(
                f"global_tokens={self.global_tokens!r} (block_size={self.block_size}) puts a "
                f"global position at {start}, beyond the {kv_len} keys; use positions below "
                f"{kv_len}"
            )
        return self
