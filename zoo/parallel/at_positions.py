"""``AtPositions``: a pattern of the whole sequence seen through one rank's rows.

Under context parallelism a rank attends its queries, at known global positions, against the keys
it holds and fetched, at known global positions, sorted. Wrapping the global pattern so that the
call's indices map to those positions lets one ordinary call run on every backend (reference,
sdpa, blocked, flex), sparse where they are sparse:

- ``allowed(i, j) = pattern.allowed(Q[i'], K[j])``, where i' undoes the call's bottom-right query
  alignment (query i sits at i + m - s among m keys and s queries, ``zoo.patterns.base``);
- ``block_state`` maps each block's index range [lo, hi] to the hull [pos[lo], pos[hi]] of its
  positions (increasing, so the hull holds them all) and asks the pattern about the hull. A hull is
  a superset of the block's positions, so EMPTY (no pair of the hull allowed) and FULL (every pair
  allowed) hold for the block too; PARTIAL is always safe (the mask decides).

The wrapper runs in the natural order (``stride`` 1) with one part: a strided pattern's regrouped
order is one of global positions, which a rank's rows do not form. Its blocks are then less sparse
in the blocked backend than the one-process call's, never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from ..core.device_build import on_host
from ..patterns.base import Pattern, Spans

_FAR = 2**62  # the bound of a block with no valid slot, as zoo.layout.frames writes it


@dataclass(frozen=True, eq=False)
class AtPositions(Pattern):
    """``pattern`` (specialised at the global length) with query index i at ``q_positions[i]``
    and key index j at ``kv_positions[j]`` (both increasing, on the pattern's device)."""

    pattern: Pattern
    q_positions: Tensor  # [s]
    kv_positions: Tensor  # [m], m >= s
    heads: int | None = None  # query heads of a pattern drawn per head or routed (``dense``)
    batch: int | None = None  # sequences of a routed pattern (for ``dense``)

    @property
    def offset(self) -> int:
        """Where the call aligns query 0: m - s (bottom right)."""
        return self.kv_positions.numel() - self.q_positions.numel()

    def _q(self, q_pos: Tensor) -> Tensor:
        return self.q_positions[(q_pos - self.offset).clamp(0, self.q_positions.numel() - 1)]

    def _k(self, kv_pos: Tensor) -> Tensor:
        return self.kv_positions[kv_pos.clamp(0, self.kv_positions.numel() - 1)]

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return self.pattern.allowed(self._q(q_pos), self._k(kv_pos))

    def allowed_at(self, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return self.pattern.allowed_at(b, h, self._q(q_pos), self._k(kv_pos))

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        q_lo, q_hi = (q.lo - self.offset), (q.hi - self.offset)
        return self.pattern.block_state(
            _hull(q, q_lo, q_hi, self.q_positions), _hull(k, k.lo, k.hi, self.kv_positions)
        )

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        device = self.q_positions.device
        q = torch.arange(q_len, device=device) + (kv_len - q_len)
        k = torch.arange(kv_len, device=device)
        if self.heads is None:
            return self.allowed(q[:, None], k[None, :])
        h = torch.arange(self.heads, device=device)[:, None, None]
        if self.pattern.routed:  # (B, H, q_len, kv_len), as a routed pattern's dense is
            b = torch.arange(self.batch, device=device)[:, None, None, None]
            return self.allowed_at(b, h[None], q[None, None, :, None], k[None, None, None, :])
        zero = torch.zeros((), dtype=torch.long, device=device)
        return self.allowed_at(zero, h, q[None, :, None], k[None, None, :])[None]

    @property
    def per_head(self) -> bool:
        return self.pattern.per_head

    @property
    def routed(self) -> bool:
        return self.pattern.routed

    @property
    def one_call(self) -> bool:
        return self.pattern.routed  # a chunk's choice, made for this call

    def head(self, h: int) -> Pattern:
        return AtPositions(self.pattern.head(h), self.q_positions, self.kv_positions)

    @cached_property
    def kind(self) -> str:
        # Full attention stays full under any positions. Causal attention stays causal where
        # the keys are one run of positions and the queries its last ones (a contiguous shard
        # and every key before it): the call's bottom-right alignment is then causality at
        # global positions, which dense kernels run without a mask. Elsewhere it is a pattern.
        if self.pattern.kind == "full":
            return "full"
        if self.pattern.kind == "causal" and _run_ending_in(self.kv_positions, self.q_positions):
            return "causal"
        return "sparse"


def _run_ending_in(keys: Tensor, queries: Tensor) -> bool:
    """Whether ``keys`` are consecutive positions and ``queries`` their last ones."""
    m, s = keys.numel(), queries.numel()
    with on_host():
        if m == 0 or s > m or int(keys[-1] - keys[0]) != m - 1:
            return False
        return bool(torch.equal(keys[m - s :], queries))


def _hull(spans: Spans, lo: Tensor, hi: Tensor, positions: Tensor) -> Spans:
    """The spans with each non-empty block's index range [lo, hi] as the positions' hull."""
    last = positions.numel() - 1
    some = spans.nonempty
    new_lo = torch.where(some, positions[lo.clamp(0, last)], _FAR)
    new_hi = torch.where(some, positions[hi.clamp(0, last)], -_FAR)
    return Spans(new_lo, new_hi, 1, spans.complete)


def at_global(bias, wrapper: AtPositions):
    """An encoding's score bias read at global positions, through the wrapper's mapping."""

    def biased(h: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return bias(h, wrapper._q(q_pos), wrapper._k(k_pos))

    return biased
