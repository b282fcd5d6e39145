"""Benchmark figures of variants whose pairs are chosen by content (``moba``): the allowed pairs
and the cost of the choice, on a point's own inputs (neither exists before the inputs do).

The pairs are counted without any (query, key) grid: from the bound pattern's block choice
(``ChosenBlocks``, alone or met with ``causal``) by block arithmetic, a few rows of queries at a
time; any other bound layout by ``allowed_at`` on bounded chunks of query rows. Either way no
tensor has more than ``CHUNK_ELEMENTS`` elements beyond the choice itself (n * top_k block
indices), at any length.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zoo.functional import resolve_pattern
from zoo.mechanisms.dispatch import is_mechanism
from zoo.patterns import RouteInputs
from zoo.patterns.base import Pattern
from zoo.patterns.compose import Intersection
from zoo.patterns.routed import ChosenBlocks

from .measure import median, time_runs

# The most elements a counting step holds at once (its slice of the choice, its widths): 32 MiB
# of int64, whatever the length.
CHUNK_ELEMENTS = 1 << 22


def is_routed(variant: str, params: dict) -> bool:
    """Whether a variant's pairs are chosen by content (a mechanism has no pairs to choose)."""
    return not is_mechanism(variant) and resolve_pattern(variant, False, dict(params)).routed


def chosen_pairs(variant: str, params: dict, causal: bool, q: Tensor, k: Tensor) -> int:
    """Allowed (query, key) pairs per sequence and head, averaged over them, for these q, k.

    The choice is made once on the whole q, as the zoo makes it in a call (so the count is that
    call's, not one of a choice made in pieces); counting it adds O(CHUNK_ELEMENTS) memory."""
    with torch.no_grad():
        pattern = resolve_pattern(variant, causal, dict(params))
        bound = pattern.bind(RouteInputs(q.detach(), k.detach(), None, causal))
        batch, heads, q_len = q.shape[:3]
        total = count_bound_pairs(bound, batch, heads, q_len, k.shape[2], q.device)
    return round(total / (batch * heads))


def count_bound_pairs(
    pattern: Pattern, batch: int, heads: int, q_len: int, kv_len: int, device: torch.device
) -> int:
    """Allowed pairs of a bound pattern summed over its sequences and heads: what
    ``pattern.dense(q_len, kv_len)`` (broadcast to (batch, heads, q_len, kv_len)) would sum to,
    without building it. ``device``: where the bound layout's tensors are."""
    split = _chosen_blocks(pattern)
    if split is not None:
        return _count_chosen_blocks(*split, q_len, kv_len)
    return _count_by_rows(pattern, batch, heads, q_len, kv_len, device)


def _chosen_blocks(pattern: Pattern) -> tuple[ChosenBlocks, bool] | None:
    """(the choice, whether it is met with causal) where the bound pattern is a ``ChosenBlocks``
    alone or intersected with ``full``/``causal`` members (what ``causal=True`` makes of moba);
    None for any other layout."""
    if isinstance(pattern, ChosenBlocks):
        chosen, others = pattern, []
    elif isinstance(pattern, Intersection):
        blocks = [c for c in pattern.children if isinstance(c, ChosenBlocks)]
        if len(blocks) != 1:
            return None
        chosen, others = blocks[0], [c for c in pattern.children if c is not blocks[0]]
    else:
        return None
    if isinstance(chosen.offset, Tensor) or chosen.picks.dim() != 4:
        return None
    if any(c.routed or c.per_head or c.kind not in ("full", "causal") for c in others):
        return None
    return chosen, any(c.kind == "causal" for c in others)


def _count_chosen_blocks(pattern: ChosenBlocks, causal: bool, q_len: int, kv_len: int) -> int:
    """Sum over (sequence, head, query, chosen block) of the block's keys that the query may
    attend: keys lo .. min(hi, kv_len - 1), and under causal only those at or before the query's
    position (i + offset, bottom-right aligned as ``causal``'s dense view). Query rows go a chunk
    at a time: the picks' slice and their widths stay within CHUNK_ELEMENTS."""
    picks = pattern.picks  # (B, H, Lq, k), ``blocks`` in an empty slot
    batch, heads, rows, width = picks.shape
    if rows != q_len:
        raise ValueError(f"the choice has {rows} query rows, the call {q_len}")
    size = pattern.block_size
    step = max(1, CHUNK_ELEMENTS // max(1, batch * heads * width))
    total = torch.zeros((), dtype=torch.int64, device=picks.device)
    for start in range(0, q_len, step):
        chunk = picks[:, :, start : start + step].long()  # (B, H, rows, k)
        lo = chunk * size
        last = (lo + size).clamp(max=kv_len) - 1  # the last key of each block (a short last one)
        if causal:
            position = torch.arange(start, start + chunk.shape[2], device=picks.device)
            last = torch.minimum(last, (position + pattern.offset)[:, None])
        keys = (last - lo + 1).clamp(min=0)
        total += torch.where(chunk < pattern.blocks, keys, 0).sum()
    return int(total)


def _count_by_rows(
    pattern: Pattern, batch: int, heads: int, q_len: int, kv_len: int, device: torch.device
) -> int:
    """Any other bound layout: ``allowed_at`` on a chunk of query rows against every key at a
    time, (batch, heads, rows, kv_len) within CHUNK_ELEMENTS (time O(n^2), memory bounded)."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    keys = torch.arange(kv_len, device=device)[None, :]
    step = max(1, CHUNK_ELEMENTS // (batch * heads * max(kv_len, 1)))
    total = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, q_len, step):
        rows = torch.arange(start, min(start + step, q_len), device=device)
        hit = pattern.allowed_at(b, h, (rows + kv_len - q_len)[:, None], keys)
        total += hit.expand(batch, heads, -1, -1).sum(dtype=torch.int64)
    return int(total)


def selection_ms(variant: str, params: dict, causal: bool, q: Tensor, k: Tensor) -> float:
    """Median time of the choice alone (``bind``: block means, scores, top-k), per call."""
    pattern = resolve_pattern(variant, causal, dict(params))
    inputs = RouteInputs(q.detach(), k.detach(), None, causal)
    with torch.no_grad():
        times = time_runs(lambda: pattern.bind(inputs), q.device, 1, 5, None)
    return median(times)
