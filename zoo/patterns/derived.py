"""Block states derived from ``allowed``: the view a pattern gets when it defines only ``allowed``.

Every pair of positions in each (query block, key block) is evaluated, as FlexAttention's
``create_block_mask`` does: EMPTY where no pair is allowed, FULL where every pair is (and both
blocks are complete), PARTIAL otherwise, so the derived states are exact. The cost is the evaluation
of ``allowed`` on all q_len x kv_len pairs, once per shape (block layouts are cached per shape,
``zoo.layout.block_layout.build_layout``), in chunks of ``CHUNK`` pairs: at 64K tokens, 4.3e9
evaluations, which an analytic ``block_state`` replaces by one expression per block pair (measured:
eval/results/derived-block-states-cpu.md). Blocks of a 2-D tiled order (spans with a ``box``) are
evaluated over their whole position range [lo, hi], a superset of their positions: EMPTY and FULL
stay exact, PARTIAL may be said of an EMPTY block.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from .spans import Spans, state_from


class Pattern(Protocol):
    """What the derivation reads of a pattern (``zoo.patterns.base.Pattern`` has it): its
    elementwise view."""

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor: ...


CHUNK = 1 << 22  # pairs evaluated at once (a few tens of MB of bool and int64 temporaries)


def derived_block_state(pattern: Pattern, q: Spans, k: Spans) -> Tensor:
    """EMPTY / PARTIAL / FULL of each block pair (q and k spans broadcast against each other),
    from ``pattern.allowed`` on every pair of positions in it."""
    shape = torch.broadcast_shapes(q.lo.shape, k.lo.shape)
    q_lo, q_count, q_step = _progression(q, shape)
    k_lo, k_count, k_step = _progression(k, shape)
    any_allowed = torch.zeros(q_lo.numel(), dtype=torch.bool, device=q_lo.device)
    all_allowed = torch.ones_like(any_allowed)
    done = (q_count * k_count).clamp(min=1).cumsum(0)  # position pairs up to each block pair
    start = 0
    while start < q_lo.numel():  # block pairs in chunks of about CHUNK position pairs
        before = int(done[start - 1]) if start else 0
        stop = min(int(torch.searchsorted(done, before + CHUNK)) + 1, q_lo.numel())
        part = slice(start, stop)
        some, every = _evaluate(
            pattern, (q_lo[part], q_count[part], q_step), (k_lo[part], k_count[part], k_step)
        )
        any_allowed[part], all_allowed[part] = some, every
        start = stop
    return state_from(any_allowed.view(shape), all_allowed.view(shape), q, k)


def _progression(spans: Spans, shape: torch.Size) -> tuple[Tensor, Tensor, int]:
    """Each block's first position, number of positions and step, flattened to ``shape``'s
    pairs; a block over a 2-D grid (``box``) as its whole range [lo, hi]."""
    step = 1 if spans.box is not None else spans.step
    lo, hi = spans.lo.expand(shape).reshape(-1), spans.hi.expand(shape).reshape(-1)
    count = torch.where(hi >= lo, (hi - lo) // step + 1, 0)
    # An empty block is evaluated at a position of the sequence (its result is ignored): allowed
    # may index a table by position.
    some = lo[count > 0]
    lo = torch.where(count > 0, lo, some.min() if some.numel() else 0)
    return lo, count, step


def _evaluate(pattern: Pattern, q: tuple, k: tuple) -> tuple[Tensor, Tensor]:
    """(some allowed, all allowed) of each block pair, q and k given as (first positions,
    counts, step), evaluated in slices of query positions small enough for CHUNK pairs."""
    (q_lo, q_count, q_step), (k_lo, k_count, k_step) = q, k
    width = int(k_count.max()) if k_count.numel() else 0
    height = int(q_count.max()) if q_count.numel() else 0
    k_offsets = torch.arange(max(width, 1), device=k_lo.device)
    k_valid = k_offsets < k_count[:, None]
    k_pos = k_lo[:, None] + k_step * _within(k_offsets, k_count)  # (P, width)
    some = torch.zeros(q_lo.numel(), dtype=torch.bool, device=q_lo.device)
    every = torch.ones_like(some)
    rows = max(1, CHUNK // max(1, width * q_lo.numel()))
    for first in range(0, max(height, 1), rows):
        q_offsets = torch.arange(first, min(first + rows, max(height, 1)), device=q_lo.device)
        q_pos = q_lo[:, None] + q_step * _within(q_offsets, q_count)  # (P, rows)
        q_valid = q_offsets < q_count[:, None]
        hit = pattern.allowed(q_pos[:, :, None], k_pos[:, None, :])  # (P, rows, width)
        valid = q_valid[:, :, None] & k_valid[:, None, :]
        some |= (hit & valid).flatten(1).any(dim=1)
        every &= (hit | ~valid).flatten(1).all(dim=1)
    return some, every


def _within(offsets: Tensor, count: Tensor) -> Tensor:
    """(P, n) offsets clamped to each block's last position: the padding of a block narrower
    than the chunk's widest repeats a position of its own rather than one past the sequence
    (``allowed`` may index a table by position; the padding's results are ignored)."""
    return torch.minimum(offsets[None, :], (count[:, None] - 1).clamp(min=0))
