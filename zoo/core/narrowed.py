"""A narrow that is free in the backward where it spans the whole dimension."""

from __future__ import annotations

from torch import Tensor


def narrowed(x: Tensor, dim: int, start: int, count: int) -> Tensor:
    """``x.narrow(dim, start, count)``, or x itself where that is all of it: a narrow's backward
    writes its gradient into a new zero tensor of x's size, even when it spans x (one more
    buffer of x's size at the backward's peak)."""
    return x if start == 0 and count == x.shape[dim] else x.narrow(dim, start, count)
