"""The Pattern protocol: a set of allowed (query position, key position) pairs, in three views.

Positions. Keys sit at positions 0 .. kv_len-1. Queries are aligned to the *bottom right*, as in
FlashAttention: query i sits at position i + (kv_len - q_len). With q_len == kv_len this is the
ordinary diagonal; with fewer queries than keys (decoding with a cache) the last query is level
with the last key::

    q_len=2, kv_len=5, causal        q_len=5, kv_len=2, causal
          keys 0 1 2 3 4                   keys 0 1
    q0 (pos 3)   x x x x .           q0 (pos -3)  . .   <- no key: output is zero
    q1 (pos 4)   x x x x x           q1 (pos -2)  . .
                                     q2 (pos -1)  . .
                                     q3 (pos 0)   x .
                                     q4 (pos 1)   x x

The three views, held equal by the tests:
1. ``allowed(q_pos, kv_pos)``: elementwise on broadcastable int tensors of positions, with no
   ``.item()`` and no Python branching on tensor values, so FlexAttention can compile it. Positions
   outside the sequence (padding slots) may be passed; the result there is ignored.
2. ``block_state(q_spans, kv_spans)``: for blocks of positions, EMPTY, PARTIAL or FULL, computed
   from the blocks' position ranges alone. It may say PARTIAL where the truth is EMPTY or FULL
   (the mask then decides), never the reverse. A pattern that defines only ``allowed`` gets it
   derived by evaluating ``allowed`` on every pair once per shape (``zoo.patterns.derived``);
   the built-in families give it as formulas, one evaluation per block pair.
3. ``dense(q_len, kv_len)``: a [q_len, kv_len] bool tensor, built independently where that is
   natural; the oracle for tests and pictures.

Patterns chosen by content (``routed``, see ``zoo.patterns.routed``) are bound to a call's q and k
first (``bind``); the bound pattern's views then carry leading (batch, heads) dimensions, which
broadcast against a fixed pattern's in unions and intersections. A fixed pattern is the special
case: ``bind`` returns it unchanged and ``allowed_at`` ignores the batch and head.

A fixed pattern may still differ per query head (``per_head``: ``random`` with ``per_head``,
BigBird's per-head random blocks). ``for_heads(H)`` gives its layout for H query heads, once per
shape and number of heads (``zoo.layout.block_layout.with_heads``); that layout's views carry the
routed form's leading dimensions with a batch of one (``allowed_at`` reads the head,
``block_state`` [1, H, q blocks, k blocks], ``dense`` [1, H, q_len, kv_len]), so backends run it
where they run routed layouts, and ``routed`` stays False: it is chosen by position, cached per
shape, and a cache for generation keeps only what its heads read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from .derived import derived_block_state

# Block spans and their states live in spans.py, which derived.py imports too; named here for
# the modules that take them from the pattern protocol.
from .spans import EMPTY, FULL, PARTIAL, Box, Spans, state_from  # noqa: F401


def query_positions(q_len: int, kv_len: int, device: torch.device | str | None = None) -> Tensor:
    """Positions of the queries under bottom-right alignment (see the module docstring)."""
    return torch.arange(q_len, device=device) + (kv_len - q_len)


class Pattern:
    """Base class of every pattern. Subclasses are frozen dataclasses: hashable, so layouts cache.

    ``stride`` names the token order in which the pattern is block-sparse: 1 is the natural order;
    s > 1 means the pattern is sparse once tokens are regrouped by position mod s (strided and
    dilated patterns), which the ``blocked`` backend exploits.
    """

    stride: int = 1

    # What ``a | b`` and ``a & b`` build: ``Union`` and ``Intersection``, which
    # zoo.patterns.compose installs here when it is imported (importing any of zoo.patterns
    # imports it), so that this module need not import its compositions.
    _union: ClassVar[Callable[[tuple[Pattern, ...]], Pattern]]
    _intersection: ClassVar[Callable[[tuple[Pattern, ...]], Pattern]]

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        raise NotImplementedError

    def allowed_at(self, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        """``allowed`` for sequence ``b`` and query head ``h`` (broadcastable index tensors); a
        pattern chosen by content answers per sequence and head, a fixed one ignores them."""
        return self.allowed(q_pos, kv_pos)

    @property
    def routed(self) -> bool:
        """Whether its pairs are chosen by content (from q and k), not by position alone."""
        return False

    @property
    def one_call(self) -> bool:
        """Whether it was made for one call only (a choice by content already made): the
        per-shape caches must not keep it, or every call would leave its choice there."""
        return False

    @property
    def per_head(self) -> bool:
        """Whether its pairs differ per query head while fixed by position (not chosen by
        content): ``for_heads`` gives its layout for a number of heads."""
        return False

    def for_heads(self, heads: int) -> Pattern:
        """The pattern for ``heads`` query heads: a per-head pattern (``per_head``) draws its
        heads here, its views then carrying [1, H, ...] leading dimensions (see the module
        docstring); any other pattern is the same for every head and returns itself."""
        return self

    def head(self, h: int) -> Pattern:
        """Head ``h`` of a layout drawn per head (``for_heads``) as a pattern of one layout,
        with 2-D views and a plan of its own (the ``blocked`` backend runs such a layout head by
        head); any other pattern is the same for every head and returns itself."""
        return self

    def listed_pairs(self, batch: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """(sequence, query position, key position) of every allowed pair, for a layout that
        holds its pairs as a list (a graph): a mask is then filled from the list in O(pairs)
        instead of asking ``allowed_at`` key by key. None (the default): not a list."""
        return None

    def bind(self, inputs: object) -> Pattern:
        """The pattern for one call's inputs (a ``zoo.patterns.routed.RouteInputs``): a routed
        pattern chooses its blocks here; a fixed pattern is its own layout for any input."""
        return self

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        """Derived from ``allowed`` on every pair of each block (``zoo.patterns.derived``: exact,
        and n^2 evaluations once per shape); families override it with formulas on the spans."""
        return derived_block_state(self, q, k)

    # False where ``block_state`` may say PARTIAL for a block that is EMPTY or FULL, as a
    # composition's does (two members PARTIAL on a block may allow nothing together): a layout
    # then asks it again on squares of the blocks it calls PARTIAL (``build_layout``). True
    # asks nothing more; the states stay sound either way.
    exact_states: ClassVar[bool] = True

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        """Default dense view: ``allowed`` on the whole grid (families override with their own)."""
        q = query_positions(q_len, kv_len)
        return self.allowed(q[:, None], torch.arange(kv_len)[None, :])

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        """The pattern for these lengths on this device (random blocks are drawn here).

        Raises ValueError where the parameters do not fit the lengths.
        """
        return self

    def causal_form(self) -> Pattern:
        """The pattern to intersect with ``Causal`` when made causal (see ``made_causal``): itself,
        except where a family draws differently for a decoder (``Random``: each query block's
        blocks from the blocks at or before it, so that a prefix sees what it saw alone)."""
        return self

    @property
    def causal_in_itself(self) -> bool:
        """Whether the pattern keeps only causal pairs by itself, in the caller's token order,
        so that ``made_causal`` adds no ``Causal`` member (a graph, which may run in its own node
        order, where positions no longer say which pair is causal)."""
        return False

    def parts(self) -> tuple[Pattern, ...]:
        """Disjoint pieces whose union is this pattern, each block-sparse in its own ``stride``."""
        return (self,)

    @property
    def kind(self) -> str:
        """'full', 'causal' or 'sparse': dense kernels run the first two without a mask."""
        return "sparse"

    @property
    def constant_block(self) -> int | None:
        """A size b such that on each b x b square of positions (queries i*b .. i*b + b - 1
        against keys j*b .. j*b + b - 1) the pattern allows every pair or none; 0 where any
        size will do (full attention), None where there is none (a window's diagonal edge). A
        backend may then read the mask as one lookup per square (``zoo.backends.flex_lookup``)."""
        return None

    def mask_mod(self, q_len: int, kv_len: int):
        """The FlexAttention view: a function of (batch, head, query index, key index)."""
        offset = kv_len - q_len

        def pattern_mask(b, h, q_idx, kv_idx):
            return self.allowed_at(b, h, q_idx + offset, kv_idx)

        return pattern_mask

    def __or__(self, other: Pattern) -> Pattern:
        """The pairs either pattern allows."""
        return Pattern._union((self, other))

    def __and__(self, other: Pattern) -> Pattern:
        """The pairs both patterns allow."""
        return Pattern._intersection((self, other))
