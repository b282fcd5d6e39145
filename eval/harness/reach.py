"""What a cell's attention pattern lets each position reach through the model's depth.

One layer lets query i read position j where the pattern allows the pair (i, j), in any of its
heads (a pattern drawn per head, BigBird's random blocks, reaches through the union of its
heads). The residual stream keeps each position's own information, so ``depth`` stacked layers
let i read j where a chain i -> m_1 -> ... -> j of at most ``depth`` allowed pairs joins them:
the reach is (M | I)^depth in boolean arithmetic, M the one-layer mask. A causal window of w keys
before the query reaches depth x w positions back; a global token reads and is read by every
position, so with one, two layers reach every pair.

How it is known (``Reach.basis``):

* ``exact``: a pattern fixed by position. Full and causal masks are their own composition (no
  arithmetic); any other mask is composed on the dense mask, ``depth - 1`` boolean matrix
  products, sparse where the mask is (train lengths are 64 to 4096 tokens: one dense product at
  1024 tokens takes about 0.1 s on one core, at 4096 about 1.5 s). A mechanism (linear,
  Performer, Linformer, Nystrom) mixes every key into every query: full reach, or causal.
* ``content``: a pattern that chooses its keys by content (MoBA; the NSA module), whose pairs
  cannot be known from positions. Its mask here is every pair it *may* choose (full, or causal):
  a position outside that is out of reach; one inside is reachable only if the model learns to
  choose it, "content-dependent", never known to be reachable.
* ``graph``: the graph variant reads each input's own graph (the batch's ``edge_index``), so its
  mask is built per sequence (``for_graph``).
* ``unknown``: a variant or module the harness cannot read; ``note`` says why.

Padding: padded keys are never read, so the reach of a sequence of n real tokens runs through
its first n positions alone (``matrix(n)``), not through the padding after them.
"""

from __future__ import annotations

import functools
import json
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

EXACT, CONTENT, GRAPH, UNKNOWN = "exact", "content", "graph", "unknown"
# A mask with fewer allowed pairs than this share of all is composed as a sparse matrix.
SPARSE_SHARE = 0.005


def compose(mask: Tensor, depth: int) -> Tensor:
    """(M | I)^depth in boolean arithmetic for a square (n, n) bool mask: [i, j] is True where a
    chain of at most ``depth`` allowed pairs leads from query i to position j. Full and causal
    masks are returned as they are (their composition is themselves)."""
    n = mask.shape[-1]
    step = mask | torch.eye(n, dtype=torch.bool)
    if depth <= 1 or bool(step.all()) or torch.equal(step, torch.ones(n, n).tril().bool()):
        return step
    if int(step.sum()) < SPARSE_SHARE * n * n:  # (R M)^T = M^T R^T, both sparse
        with warnings.catch_warnings():  # torch's note that sparse products are in beta
            warnings.simplefilter("ignore", UserWarning)
            pairs = step.T.float().to_sparse()
            out = pairs
            for _ in range(depth - 1):
                out = torch.sparse.mm(pairs, out).coalesce()
            return out.to_dense().T > 0
    ones = step.float()
    out = ones
    for _ in range(depth - 1):
        out = ((out @ ones) > 0).float()
    return out.bool()


@dataclass
class Reach:
    """A cell's reach at one length: ``mask`` the one-layer (L, L) mask (None when ``basis`` is
    unknown or graph), ``depth`` its layers."""

    basis: str
    depth: int
    mask: Tensor | None = None
    note: str = ""
    _cache: dict[int, Tensor] = field(default_factory=dict, repr=False)

    @property
    def known(self) -> bool:
        return self.basis in (EXACT, CONTENT, GRAPH)

    def matrix(self, n: int | None = None) -> Tensor:
        """The (n, n) reach of a sequence whose first n positions are real (all of them by
        default): paths through padding are cut, since padded keys are never read."""
        if self.mask is None:
            raise ValueError(f"no reach is known here ({self.basis}: {self.note})")
        whole = self.mask.shape[0]
        n = whole if n is None else n
        if n not in self._cache:
            if n < whole and self.causal:  # no path from the first n leaves them
                self._cache[n] = self.matrix()[:n, :n]
            else:
                self._cache[n] = compose(self.mask[:n, :n], self.depth)
        return self._cache[n]

    @functools.cached_property
    def causal(self) -> bool:
        """Whether the mask allows no pair (i, j) with j > i."""
        return self.mask is not None and not bool(self.mask.triu(1).any())

    def covers(self, n: int, needed: Tensor) -> Tensor:
        """(answers,) bool: for each row of ``needed`` (answers, n), whether some one of the first
        n positions reaches all its needed positions, in a sequence of n real tokens (a pooled
        answer). Decided without composing the n positions alone where it can be: the reach
        through the whole length bounds it from above (paths through padding only add), and a
        position that reads and is read by all n gives two layers every pair."""
        whole = self.matrix()[:n, :n]
        missed = (~whole).float() @ needed.float().T  # (n, answers): needs a position misses
        if not (missed == 0).any():
            return torch.zeros(needed.shape[0], dtype=torch.bool)
        step = self.mask[:n, :n]
        if self.depth >= 2 and bool((step.all(1) & step.all(0)).any()):
            return torch.ones(needed.shape[0], dtype=torch.bool)
        missed = (~self.matrix(n)).float() @ needed.float().T
        return (missed == 0).any(0)

    def for_graph(self, mask: Tensor) -> Tensor:
        """The reach of one sequence's graph mask (the graph basis), composed ``depth`` times."""
        return compose(mask, self.depth)


def pattern_reach(
    variant: str,
    params: dict[str, Any],
    length: int,
    causal: bool,
    depth: int,
    heads: int = 1,
) -> Reach:
    """The reach of ``variant`` with these parameters at ``length`` tokens, through ``depth``
    layers of ``heads`` heads (cached per distinct cell; the returned object caches its
    compositions)."""
    frozen = json.dumps(params, sort_keys=True, default=repr)
    return _reach(variant, frozen, int(length), bool(causal), int(depth), int(heads))


@functools.lru_cache(maxsize=256)
def _reach(variant: str, frozen: str, n: int, causal: bool, depth: int, heads: int) -> Reach:
    import zoo

    params = json.loads(frozen)
    every = torch.ones(n, n, dtype=torch.bool)
    if causal:
        every = every.tril()
    if variant in zoo.list_mechanisms():
        return Reach(EXACT, depth, every, f"{variant}: every key mixed into every query")
    if variant in zoo.list_modules():
        if variant == "nsa":
            return Reach(CONTENT, depth, every, "nsa: selected blocks chosen by content")
        return Reach(UNKNOWN, depth, note=f"{variant}: a module whose pairs are not known here")
    if variant not in zoo.list_variants():
        return Reach(UNKNOWN, depth, note=f"{variant}: not a variant of the zoo")
    from zoo.functional import resolve_pattern

    try:
        pattern = resolve_pattern(variant, causal, dict(params))
        if zoo.patterns.reads_graph(pattern):
            return Reach(GRAPH, depth, note=f"{variant}: each input's own graph")
        if pattern.routed:
            return Reach(CONTENT, depth, every, f"{variant}: keys chosen by content")
        pattern = pattern.specialize(n, n, torch.device("cpu"))
        if pattern.per_head:  # the union of its heads' masks: any head carries the information
            mask = pattern.for_heads(heads).dense(n, n).reshape(-1, n, n).any(0)
        else:
            mask = pattern.dense(n, n)
    except (ValueError, TypeError) as error:
        return Reach(UNKNOWN, depth, note=f"{variant}: {error}")
    return Reach(EXACT, depth, mask.bool())


def graph_mask(
    variant: str, params: dict[str, Any], length: int, causal: bool, edge_index: Tensor
) -> Tensor:
    """The one-layer (L, L) mask of a graph variant on one sequence's ``edge_index``."""
    import zoo

    mask = zoo.dense_mask(variant, length, causal=causal, edge_index=edge_index, **params)
    return mask.bool()
