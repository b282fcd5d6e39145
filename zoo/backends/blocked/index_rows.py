"""``index_rows``: ``index_select`` along an inner dimension that copies whole rows.

ATen's CPU ``index_select`` along a dimension other than the first copies element by element,
far slower than selecting the same rows on the first dimension of a flattened view such as
(4 * 8192, 64) for keys (4, 8192, 64) (measured: eval/results/design-notes-cpu.md#index-rows).
The blocked backend gathers key blocks, query blocks and token orders this way on every call.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def index_rows(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """``x.index_select(dim, index)`` for ``index`` (K,), or, for ``index`` shaped like x's
    dimensions before ``dim`` then (K,), each leading entry its own K rows (a gather of whole
    rows). The dimensions after ``dim`` are one row, those before it fold into the index, and
    one ``index_select`` on the first dimension of the (leading * n, row) view copies whole
    rows. A tensor that is not contiguous takes ``index_select`` itself for a shared index
    (viewing it so would copy it whole), and is made contiguous for one index per entry."""
    dim = dim % x.dim()
    shared = index.dim() == 1
    # Compiled, inductor makes its own gather; the flat view would reach a kernel that reads its
    # input's layout (flex on CPU) as a 2-D buffer.
    if shared and (dim == 0 or not x.is_contiguous() or torch.compiler.is_compiling()):
        return x.index_select(dim, index)
    x = x.contiguous()
    lead, n = x.shape[:dim], x.shape[dim]
    count = math.prod(lead)
    offsets = torch.arange(count, device=x.device)[:, None] * n
    flat = offsets + index.reshape(-1, index.shape[-1])  # (count, K): shared rows broadcast
    rows = x.view(count * n, -1).index_select(0, flat.flatten())
    return rows.view(*lead, index.shape[-1], *x.shape[dim + 1 :])
