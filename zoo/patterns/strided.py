"""``strided`` and ``dilated``: keys at multiples of a stride from the query.

``strided`` (Sparse Transformer, Child et al. 2019) allows key position j for query position i when
i - j is a multiple of ``stride``, plus an optional local band of ``window_size``. The Sparse
Transformer is causal (keys at i, i - s, i - 2s, ...); here the pattern is symmetric and
``causal=True`` keeps the keys behind the query::

    stride=3 (7x7)     stride=3, window_size=1, causal
    x . . x . . x      x . . . . . .
    . x . . x . .      x x . . . . .
    . . x . . x .      . x x . . . .
    x . . x . . x      x . x x . . .
    . x . . x . .      . x . x x . .
    . . x . . x .      . . x . x x .
    x . . x . . x      x . . x . x x

``dilated`` (the dilated sliding window of Longformer, Beltagy et al. 2020) allows the keys
j = i + m * dilation for |m| <= window_size: window_size keys on each side, ``dilation`` apart.

Both are sparse once tokens are regrouped by position mod the stride (``Residue.stride``): within a
group the strided pattern is full (or causal) and the dilated one is an ordinary band.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.arguments import check_int
from .base import Pattern, Spans, state_from
from .compose import Intersection
from .families import register_pattern
from .local import Local


@dataclass(frozen=True)
class Residue(Pattern):
    """Key position j is allowed for query position i when (i - j) % stride == 0."""

    stride: int = 2

    def __post_init__(self) -> None:
        check_int("stride", self.stride)

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return (q_pos - kv_pos) % self.stride == 0

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        s = self.stride
        if q.step % s == 0 and k.step % s == 0:  # every block holds one residue class
            same = (q.lo - k.lo) % s == 0
            return state_from(same, same, q, k)
        nearest, farthest = q.lo - k.hi, q.hi - k.lo
        some = (farthest // s) * s >= nearest  # a multiple of s lies in [nearest, farthest]
        every = torch.full_like(some, s == 1) | (nearest == farthest) & some
        return state_from(some, every, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        # Group queries and keys by position mod stride and fill each group's block.
        q_pos = torch.arange(q_len) + (kv_len - q_len)
        k_pos = torch.arange(kv_len)
        mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
        for r in range(self.stride):
            rows = torch.nonzero(q_pos % self.stride == r).flatten()
            cols = torch.nonzero(k_pos % self.stride == r).flatten()
            mask[rows[:, None], cols[None, :]] = True
        return mask


@register_pattern("strided")
def strided(stride: int = 64, window_size: int = 0) -> Pattern:
    """Keys at every multiple of ``stride`` from the query, plus |i - j| <= window_size."""
    residue = Residue(check_int("stride", stride))
    if check_int("window_size", window_size, minimum=0) == 0:
        return residue
    return residue | Local(window_size)


@register_pattern("dilated")
def dilated(window_size: int = 32, dilation: int = 2) -> Pattern:
    """Keys j = i + m * dilation for |m| <= window_size; ``dilation=1`` is the plain window."""
    check_int("window_size", window_size, minimum=0)
    if check_int("dilation", dilation) == 1:
        return Local(window_size)
    return Intersection((Residue(dilation), Local(window_size * dilation)))
