"""A projection's width split into heads and joined back: the layout every module hands the
attention call (batch, heads, length, head_dim).

Plain reshapes, not einops' ``rearrange``: under ``torch.compile`` dynamo traces einops' pattern
parser (some sixty Python functions per call) in every compile of every module call."""

from __future__ import annotations

from torch import Tensor


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(batch, length, heads * head_dim) -> (batch, heads, length, head_dim)."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def join_heads(x: Tensor) -> Tensor:
    """(batch, heads, length, head_dim) -> (batch, length, heads * head_dim)."""
    return x.transpose(1, 2).flatten(2)
