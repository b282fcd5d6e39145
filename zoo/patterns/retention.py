"""What a key-value cache must keep, read from a causal pattern's own block states.

Generation writes keys in position order. When the next query sits at position n, key j is still
needed if some query at n or later may attend it. ``block_state`` answers that for the whole future
at once: the state of the query span [n, max_len - 1] against the one-position span [j, j] is EMPTY
exactly when no later query may attend j (a family may say PARTIAL for EMPTY, never the reverse, so
the answer errs towards keeping). A binary search over n gives each key's last reader,
``last_needed[j]`` (j - 1 when not even query j attends it), in O(max_len log max_len) small
integer operations, for any pattern, without a case per family.

From the last readers follow two stores:

- a ring buffer for the keys that die before the sequence ends: the longest such life, ``window``
  positions after the key's own, is its width (plus one slot for the current key). A causal
  sliding window of w keeps w + 1 keys, block-local (b, 0 neighbours) b, dilated w * d + 1.
- pinned slots for the keys read until the end beyond that window: the global tokens of Longformer
  and BigBird, every key of full and causal attention, and of strided or random patterns, whose
  later queries may still reach any earlier key::

    sliding window w=2, max_len=8: last_needed = [2, 3, 4, 5, 6, 7, 7, 7]
    query n=5 sees keys 3 4 5  -> ring of 3 slots, position j in slot j % 3
    global token 0 + window 2:  last_needed = [7, 3, 4, ...] -> slot 0 pinned, the same ring

A pattern chosen by content (``routed``: MoBA) may choose any earlier block at any later step, so
its cache pins every position, slot j holding position j (the routed pattern then scores the
cache's keys in position order, ``zoo.decoding.decode``).

A pattern that differs per query head (``Pattern.per_head``), drawn for its heads
(``for_heads``), answers block states per head ([1, H, ...]); a key's last reader is the last
over every head, so the cache keeps the union of what the heads read (one store for all heads,
as the keys are shared by the query heads of a key/value head anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .base import EMPTY, Pattern, Spans


@dataclass(frozen=True, eq=False)
class Retention:
    """Where each position's key lives in a cache: pinned slots first, then the ring.

    A pinned position takes its own slot; any other position j takes ring slot j % ring (a key
    no query reads lands there too, harmlessly: it only replaces a key older than the window);
    with no ring, it is not kept. The stores hold O(pinned + ring) values, whatever max_len.
    """

    max_len: int
    window: int  # the ring holds positions n - window .. n when query n runs
    ring: int  # slots len(pinned) .. len(pinned) + ring - 1
    pinned: Tensor  # (P,) the pinned positions, increasing; slot i holds pinned[i]
    # Known on the host: the pinned positions are 0 .. P - 1 (full and causal attention pin
    # every position but the last), so a slot needs no search among them.
    prefix: bool = False

    @property
    def slots(self) -> int:
        return self.pinned.numel() + self.ring

    def with_spare(self, spare: int) -> Retention:
        """The same stores with ``spare`` more ring slots, where there is a ring: the keys of the
        last ``spare`` tokens stay beyond the window, so lengths may be set back by that many
        more (``KVCache.lengths``). A cache without a ring keeps every key it reads anyway."""
        return replace(self, ring=self.ring + spare) if self.ring else self

    def keeps_below(self, length: int) -> bool:
        """Whether every position below ``length`` has a slot, known on the host: any position
        has one where there is a ring; with none, the pinned prefix 0 .. P - 1 holds those below
        P."""
        return self.ring > 0 or (self.prefix and length <= self.pinned.numel())

    @property
    def kept_at_position(self) -> bool:
        """Whether a position that has a slot (``keeps_below``) is kept at slot = position: a
        pinned prefix 0 .. P - 1 and no ring, or one ring slot for the last position alone
        (P = max_len - 1 at slot P: full and causal attention)."""
        count = self.pinned.numel()
        return self.prefix and (self.ring == 0 or (self.ring == 1 and count == self.max_len - 1))

    def slot(self, positions: Tensor) -> Tensor:
        """The slot of each key position (-1: not kept), in the positions' shape; elementwise on
        the positions' device (no value read on the host, no tensor made from host data)."""
        count = self.pinned.numel()
        if count == 0:  # no pinned slot: the ring's, or none
            return positions % self.ring if self.ring else torch.full_like(positions, -1)
        if self.prefix and self.ring <= 1:  # position p < P at slot p, any later one at P or none
            return (
                positions.clamp(max=count) if self.ring else positions.where(positions < count, -1)
            )
        in_ring = count + positions % self.ring if self.ring else torch.full_like(positions, -1)
        if self.prefix:
            return torch.where(positions < count, positions, in_ring)
        pinned = self.pinned.to(positions)
        index = torch.searchsorted(pinned, positions.contiguous())
        return torch.where(pinned[index.clamp(max=count - 1)] == positions, index, in_ring)


def last_needed(pattern: Pattern, max_len: int) -> Tensor:
    """(max_len,) the last query position that may attend each key (j - 1 if none), for a causal
    pattern specialised to ``max_len`` (see the module docstring)."""
    keys = torch.arange(max_len)
    end = torch.full_like(keys, max_len - 1)
    complete = torch.ones(max_len, dtype=torch.bool)
    key_span = Spans(keys, keys, 1, complete)
    lo, hi = keys - 1, end.clone()  # invariant: last_needed in [lo, hi], lo >= j - 1
    while bool((lo < hi).any()):
        mid = (lo + hi + 1) // 2
        state = pattern.block_state(Spans(mid, end, 1, complete), key_span)
        read = state != EMPTY
        if read.dim() > 1:  # per head ([1, H, max_len]): read by any head
            read = read.reshape(-1, max_len).any(0)
        lo, hi = torch.where(read, mid, lo), torch.where(read, hi, mid - 1)
    return lo


def retention(pattern: Pattern, max_len: int) -> Retention:
    """The stores of a cache for ``pattern`` (causal, specialised to ``max_len``)."""
    if pattern.routed:  # any earlier key may be chosen later: keep all, in position order
        return keep_all(max_len)
    last = last_needed(pattern, max_len)
    keys = torch.arange(max_len)
    life = last - keys
    to_end = last == max_len - 1
    dying = life[~to_end & (life >= 0)]
    window = int(dying.max()) if dying.numel() else 0
    pinned = to_end & (life > window)
    ring = window + 1 if bool(((life >= 0) & ~pinned).any()) else 0
    pinned = keys[pinned]
    prefix = bool(torch.equal(pinned, torch.arange(pinned.numel())))
    return Retention(max_len, window, ring, pinned, prefix)


def keep_all(max_len: int) -> Retention:
    """Every position pinned, slot j holding position j: for a pattern chosen by content, or
    one per head whose heads are not known."""
    return Retention(max_len, 0, 0, torch.arange(max_len), prefix=True)
