"""``index_rows``: ``index_select`` along an inner dimension that copies whole rows.

ATen's CPU ``index_select`` along a dimension other than the first copies element by element:
keys (4 heads, 8192 slots, 64) at 24000 gathered slots took 15 ms against 1.4 ms for the same
rows selected on the first dimension of a (4 * 8192, 64) view (2 threads). The blocked backend
gathers key blocks, query blocks and token orders this way on every call.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def index_rows(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """``x.index_select(dim, index)``: the dimensions after ``dim`` are one row, those before it
    fold into the index, and one ``index_select`` on the first dimension of the (leading * n,
    row) view copies whole rows. A tensor that is not contiguous takes ``index_select`` itself
    (viewing it so would copy it whole)."""
    dim = dim % x.dim()
    if dim == 0 or not x.is_contiguous():
        return x.index_select(dim, index)
    lead, n = x.shape[:dim], x.shape[dim]
    count = math.prod(lead)
    offsets = torch.arange(count, device=x.device)[:, None] * n
    rows = x.view(count * n, -1).index_select(0, (offsets + index).flatten())
    return rows.view(*lead, index.numel(), *x.shape[dim + 1 :])
