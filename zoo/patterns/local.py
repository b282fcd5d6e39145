"""``local``: a window around each query, the sliding window of decoders when made causal.

``window_size=w`` allows key position j for query position i when |i - j| <= w: w keys on each
side plus the query's own position, 2w + 1 in all (FlashAttention's ``window_size=(w, w)``). A pair
``(left, right)`` allows i - left <= j <= i + right. Made causal (``causal=True``), the window keeps
its left side: the query and the w keys before it::

    window_size=1 (5x5)     window_size=1, causal
    x x . . .               x . . . .
    x x x . .               x x . . .
    . x x x .               . x x . .
    . . x x x               . . x x .
    . . . x x               . . . x x
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.arguments import check_int
from .base import Pattern, Spans, state_from
from .families import register_pattern


def window_pair(window_size: object) -> tuple[int, int]:
    """``w`` or ``(left, right)`` as a (left, right) pair of non-negative ints."""
    if isinstance(window_size, list | tuple):
        if len(window_size) != 2:
            raise ValueError(
                f"window_size must be an int or a (left, right) pair, got {window_size!r}"
            )
        left, right = window_size
        return check_int("window_size[0]", left, minimum=0), check_int(
            "window_size[1]", right, minimum=0
        )
    w = check_int("window_size", window_size, minimum=0)
    return w, w


@register_pattern("local")
@dataclass(frozen=True)
class Local(Pattern):
    """Key position j is allowed for query position i when i - left <= j <= i + right."""

    window_size: int | tuple[int, int] = 128

    def __post_init__(self) -> None:
        object.__setattr__(self, "window_size", window_pair(self.window_size))

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        left, right = self.window_size
        return (kv_pos >= q_pos - left) & (kv_pos <= q_pos + right)

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        left, right = self.window_size
        nearest, farthest = q.lo - k.hi, q.hi - k.lo  # the range of i - j over the two blocks
        some = (farthest >= -right) & (nearest <= left)
        every = (nearest >= -right) & (farthest <= left)
        return state_from(some, every, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        left, right = self.window_size
        offset = kv_len - q_len
        ones = torch.ones(q_len, kv_len, dtype=torch.bool)
        return ones.tril(offset + right) & ones.triu(offset - left)
