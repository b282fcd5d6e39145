"""Grouped-query heads as extra query rows: the query heads that share a key/value head stacked
along the query dimension, so that a kernel without grouped heads (PyTorch's memory-efficient
SDPA kernel, which takes a mask; the CPU kernel with log-sum-exp) reads each key/value head once,
and no key or value is copied per query head (SDPA's math fallback for grouped heads with a mask
repeats every key and value ``groups`` times). A mask or flag shared by the heads is repeated
per query head instead: the caller weighs that copy."""

from __future__ import annotations

from torch import Tensor


def fold_groups(x: Tensor, groups: int) -> Tensor:
    """(N, H, M, ...) -> (N, H / groups, groups * M, ...): the query heads that share a key/value
    head as extra query rows, head by head. A mask or flag shared by the heads (dim 1 of size 1)
    is repeated over the rows instead."""
    if groups == 1:
        return x
    if x.shape[1] == 1:
        return x.repeat(1, 1, groups, *([1] * (x.dim() - 3)))
    return x.unflatten(1, (-1, groups)).flatten(2, 3)


def unfold_groups(x: Tensor, groups: int) -> Tensor:
    """The inverse of ``fold_groups`` for per-head tensors."""
    if groups == 1:
        return x
    return x.unflatten(2, (groups, -1)).flatten(1, 2)
