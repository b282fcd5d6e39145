"""Composition: union, intersection and difference of patterns, in all three views.

``a | b`` and ``a & b`` build them in Python; ``union:``, ``intersection:`` and ``causal:``
build them in registry.yaml. Block states combine conservatively: a union takes the larger state, an
intersection the smaller, so EMPTY and FULL stay exact claims.

A union whose members are sparse in different token orders (a local band and a strided pattern,
say) splits into disjoint ``parts()``: the first order's members as they are, each later order's
members minus everything before them. A backend computes each part in its own order and merges the
partial softmaxes exactly (see ``zoo.backends.merge``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce

import torch
from torch import Tensor

from ..core.shape_cache import per_shape
from .base import EMPTY, FULL, PARTIAL, Pattern, Spans


def memo_parts(pattern: Pattern, split: Callable[[], tuple[Pattern, ...]]) -> tuple[Pattern, ...]:
    """The parts, split once per pattern. ``zoo.layout.block_layout.specialized`` splits them
    outside any traced graph; a graph then reads these objects, which per-shape builders can take,
    instead of making new ones (see ``zoo.core.shape_cache``)."""
    parts = getattr(pattern, "_parts", None)
    if parts is None:
        parts = split()
        object.__setattr__(pattern, "_parts", parts)
    return parts


def remember_members(pattern: Pattern, members: tuple[Pattern, ...]) -> None:
    """Whether any member is chosen by content (``routed``) or drawn per head (``per_head``),
    found once when the composition is built: the members are frozen, and the calls ask often,
    under ``torch.compile`` too, where each recursive ``any`` over the members was traced anew."""
    object.__setattr__(pattern, "_routed", any(m.routed for m in members))
    object.__setattr__(pattern, "_per_head", any(m.per_head for m in members))


def order_key(order: object) -> tuple[bool, str]:
    """Sorts token orders: int strides first, by value; then other orders (a grid's ``Tiles``)."""
    return (not isinstance(order, int), f"{order:020d}" if isinstance(order, int) else repr(order))


def common_block(children: tuple[Pattern, ...]) -> int | None:
    """The members' ``constant_block`` in common: squares of a size each member's divides (0:
    any), None if a member has none. A union or intersection of patterns constant on squares is
    constant on the squares they share."""
    sizes = [c.constant_block for c in children]
    return None if None in sizes else math.gcd(*sizes)


def _flatten(kind: type, children: tuple[Pattern, ...]) -> tuple[Pattern, ...]:
    flat: list[Pattern] = []
    for child in children:
        flat.extend(child.children if isinstance(child, kind) else (child,))
    return tuple(flat)


@dataclass(frozen=True)
class Union(Pattern):
    """Pairs allowed by any member."""

    exact_states = False

    children: tuple[Pattern, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "children", _flatten(Union, self.children))
        remember_members(self, self.children)

    @property
    def stride(self) -> int:  # type: ignore[override]
        strides = {child.stride for child in self.children}
        return strides.pop() if len(strides) == 1 else 1

    @property
    def constant_block(self) -> int | None:
        return common_block(self.children)

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return reduce(torch.logical_or, (c.allowed(q_pos, kv_pos) for c in self.children))

    def allowed_at(self, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        hits = (c.allowed_at(b, h, q_pos, kv_pos) for c in self.children)
        return reduce(torch.logical_or, hits)

    @property
    def routed(self) -> bool:
        return self._routed

    def bind(self, inputs: object) -> Pattern:
        return Union(tuple(c.bind(inputs) for c in self.children)) if self.routed else self

    @property
    def per_head(self) -> bool:
        return self._per_head

    def for_heads(self, heads: int) -> Pattern:
        return Union(tuple(c.for_heads(heads) for c in self.children)) if self.per_head else self

    def head(self, h: int) -> Pattern:
        return Union(tuple(c.head(h) for c in self.children)) if self.per_head else self

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        return reduce(torch.maximum, (c.block_state(q, k) for c in self.children))

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        return reduce(torch.logical_or, _dense_together(self.children, q_len, kv_len))

    def causal_form(self) -> Pattern:
        return Union(tuple(c.causal_form() for c in self.children))

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        return Union(tuple(c.specialize(q_len, kv_len, device) for c in self.children))

    @property
    def kind(self) -> str:
        kinds = {c.kind for c in self.children}
        return "full" if "full" in kinds else kinds.pop() if kinds == {"causal"} else "sparse"

    def parts(self) -> tuple[Pattern, ...]:
        return memo_parts(self, self._split)

    def _split(self) -> tuple[Pattern, ...]:
        by_stride: dict[int, list[Pattern]] = {}
        for piece in itertools.chain.from_iterable(c.parts() for c in self.children):
            by_stride.setdefault(piece.stride, []).append(piece)
        ordered = sorted(by_stride.items(), key=lambda item: order_key(item[0]))
        groups = [g[0] if len(g) == 1 else Union(tuple(g)) for _, g in ordered]
        parts = [groups[0]]
        for i, group in enumerate(groups[1:], start=1):
            earlier = groups[0] if i == 1 else Union(tuple(groups[:i]))
            parts.append(Difference(group, earlier))
        return tuple(parts)


@dataclass(frozen=True)
class Intersection(Pattern):
    """Pairs allowed by every member."""

    exact_states = False

    children: tuple[Pattern, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "children", _flatten(Intersection, self.children))
        remember_members(self, self.children)

    @property
    def stride(self) -> int:  # type: ignore[override]
        # Sparse in any member's order: a grid's tiles (where a 2-D window meets the call's
        # causal mask), else the largest stride. No max(key=): traced code reads this too.
        orders = [child.stride for child in self.children]
        tiles = [order for order in orders if not isinstance(order, int)]
        return tiles[0] if tiles else max(orders)

    @property
    def constant_block(self) -> int | None:
        return common_block(self.children)

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return reduce(torch.logical_and, (c.allowed(q_pos, kv_pos) for c in self.children))

    def allowed_at(self, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        hits = (c.allowed_at(b, h, q_pos, kv_pos) for c in self.children)
        return reduce(torch.logical_and, hits)

    @property
    def routed(self) -> bool:
        return self._routed

    def bind(self, inputs: object) -> Pattern:
        """Members chosen by content choose under causal rules when a causal member bounds them
        (MoBA then ranks only the blocks up to the query's own)."""
        if not self.routed:
            return self
        if any(c.kind == "causal" for c in self.children):
            inputs = inputs.made_causal()  # type: ignore[attr-defined]
        return Intersection(tuple(c.bind(inputs) for c in self.children))

    @property
    def per_head(self) -> bool:
        return self._per_head

    def for_heads(self, heads: int) -> Pattern:
        if not self.per_head:
            return self
        return Intersection(tuple(c.for_heads(heads) for c in self.children))

    def head(self, h: int) -> Pattern:
        return Intersection(tuple(c.head(h) for c in self.children)) if self.per_head else self

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        return reduce(torch.minimum, (c.block_state(q, k) for c in self.children))

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        return reduce(torch.logical_and, _dense_together(self.children, q_len, kv_len))

    def causal_form(self) -> Pattern:
        return Intersection(tuple(c.causal_form() for c in self.children))

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        return Intersection(tuple(c.specialize(q_len, kv_len, device) for c in self.children))

    @property
    def kind(self) -> str:
        kinds = {c.kind for c in self.children}
        return (
            "full" if kinds == {"full"} else "causal" if kinds <= {"full", "causal"} else "sparse"
        )

    def parts(self) -> tuple[Pattern, ...]:
        return memo_parts(self, self._split)

    def _split(self) -> tuple[Pattern, ...]:
        # Intersection distributes over the disjoint parts of each member.
        combos = itertools.product(*(c.parts() for c in self.children))
        return tuple(combo[0] if len(combo) == 1 else Intersection(combo) for combo in combos)


@dataclass(frozen=True)
class Difference(Pattern):
    """Pairs allowed by ``include`` and not by ``exclude``; computed in ``include``'s order."""

    exact_states = False

    include: Pattern
    exclude: Pattern

    def __post_init__(self) -> None:
        remember_members(self, (self.include, self.exclude))

    @property
    def stride(self) -> int:  # type: ignore[override]
        return self.include.stride

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        return self.include.allowed(q_pos, kv_pos) & ~self.exclude.allowed(q_pos, kv_pos)

    def allowed_at(self, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        include = self.include.allowed_at(b, h, q_pos, kv_pos)
        return include & ~self.exclude.allowed_at(b, h, q_pos, kv_pos)

    @property
    def routed(self) -> bool:
        return self._routed

    def bind(self, inputs: object) -> Pattern:
        if not self.routed:
            return self
        return Difference(self.include.bind(inputs), self.exclude.bind(inputs))

    @property
    def per_head(self) -> bool:
        return self._per_head

    def for_heads(self, heads: int) -> Pattern:
        if not self.per_head:
            return self
        return Difference(self.include.for_heads(heads), self.exclude.for_heads(heads))

    def head(self, h: int) -> Pattern:
        if not self.per_head:
            return self
        return Difference(self.include.head(h), self.exclude.head(h))

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        # An exclude that takes nothing from a block leaves include's state, FULL included
        # (strided's keys by residue less its band: FULL off the diagonal in the stride's order).
        include, exclude = self.include.block_state(q, k), self.exclude.block_state(q, k)
        cut = torch.where(exclude == EMPTY, include, torch.clamp(include, max=PARTIAL))
        return torch.where(exclude == FULL, EMPTY, cut).to(torch.int8)

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        include, exclude = _dense_together((self.include, self.exclude), q_len, kv_len)
        return include & ~exclude

    def causal_form(self) -> Pattern:
        return Difference(self.include.causal_form(), self.exclude.causal_form())

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        return Difference(
            self.include.specialize(q_len, kv_len, device),
            self.exclude.specialize(q_len, kv_len, device),
        )


# ``a | b`` and ``a & b`` (Pattern.__or__ and __and__) build these.
Pattern._union = Union
Pattern._intersection = Intersection


@per_shape(maxsize=64)
def dense_on(pattern: Pattern, q_len: int, kv_len: int, device: torch.device) -> Tensor:
    """A fixed pattern's dense view on a device, built once per shape."""
    return pattern.dense(q_len, kv_len).to(device)


def _dense_together(members: tuple[Pattern, ...], q_len: int, kv_len: int) -> list[Tensor]:
    """The members' dense masks on one device. A choice by content's (MoBA's) is made for the
    call where the call's tensors are, and beside one a fixed member's is built there once per
    shape (``dense_on``): no host work of q_len x kv_len and no copy to the device per call.
    Without one, each is made as its member makes it, and moved to the device of any not on the
    CPU."""
    chosen = {i: m.dense(q_len, kv_len) for i, m in enumerate(members) if m.routed}
    if chosen:
        device = next(iter(chosen.values())).device
        return [chosen[i] if m.routed else dense_on(m, q_len, kv_len, device)
                for i, m in enumerate(members)]  # fmt: skip
    masks = [m.dense(q_len, kv_len) for m in members]
    device = next((m.device for m in masks if m.device.type != "cpu"), masks[0].device)
    return [m.to(device) for m in masks]
