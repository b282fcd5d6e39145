"""``full`` and ``causal``: the two dense patterns that fused kernels run without any mask.

::

    full (4x4)   causal (4x4)
    x x x x      x . . .
    x x x x      x x . .
    x x x x      x x x .
    x x x x      x x x x

``causal`` allows key position j for query position i when j <= i; with q_len != kv_len the
diagonal is aligned to the bottom right (see ``zoo.patterns.base``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Pattern, Spans, state_from
from .compose import Intersection
from .families import register_pattern


@register_pattern("full")
@dataclass(frozen=True)
class Full(Pattern):
    """Every query attends to every key."""

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return torch.ones_like(q_pos + kv_pos, dtype=torch.bool)

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        every = torch.ones_like(q.lo + k.lo, dtype=torch.bool)
        return state_from(every, every, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool)

    @property
    def constant_block(self) -> int:
        return 0  # any size

    @property
    def kind(self) -> str:
        return "full"


@register_pattern("causal")
@dataclass(frozen=True)
class Causal(Pattern):
    """Query position i attends to key positions j <= i (a decoder's mask)."""

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return kv_pos <= q_pos

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        return state_from(k.lo <= q.hi, k.hi <= q.lo, q, k)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)

    @property
    def kind(self) -> str:
        return "causal"


def made_causal(pattern: Pattern) -> Pattern:
    """``pattern`` made causal: its causal form (``Pattern.causal_form``) intersected with
    ``Causal``, what ``causal=True`` and a registry entry's ``causal:`` build; the causal form
    alone where it is causal in itself (``Pattern.causal_in_itself``: a graph)."""
    form = pattern.causal_form()
    return form if form.causal_in_itself else Intersection((form, Causal()))
