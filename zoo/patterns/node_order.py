"""Node orders for graphs: reverse Cuthill-McKee, so that a graph's adjacency clusters into blocks.

A graph's nodes come in the caller's order, which may be any order at all; its adjacency is then
scattered over every block pair. Cuthill-McKee numbers the nodes breadth-first from a peripheral
node, each node's unnumbered neighbours by increasing degree, which keeps every edge between
nearby levels: the adjacency becomes a band. Reversed (RCM), the band fills in less (George &
Liu). A shuffled 4-neighbour grid::

    caller's order (blocks of 4)     RCM order
    x . . x | . x . . | ...          x x x . | . . . . | ...
    . x x . | x . . . |              x x . x | x . . . |
    ...       ...                    ...

Written here in numpy, not taken from SciPy (``scipy.sparse.csgraph.reverse_cuthill_mckee``): the
zoo's only array dependencies are torch and numpy, and the GPU machines have no SciPy. Every step
is vectorised over a BFS level, so the cost is O(E log E) in numpy calls, times the graph's
diameter in Python steps; disconnected components (isolated nodes included) are numbered side
by side, each from its own peripheral node.

``NodeOrder`` carries one order per sequence and moves (B, H, L, D) tensors into it and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def _neighbours(frontier: np.ndarray, indptr: np.ndarray, targets: np.ndarray):
    """(parent index in frontier, neighbour) for every edge out of the frontier, by parent."""
    counts = indptr[frontier + 1] - indptr[frontier]
    total = int(counts.sum())
    parent = np.repeat(np.arange(frontier.size), counts)
    starts = np.repeat(indptr[frontier] - np.cumsum(counts) + counts, counts)
    return parent, targets[starts + np.arange(total)]


def _levels(roots: np.ndarray, n: int, indptr: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """BFS level of every node from ``roots`` (one per component, searched side by side)."""
    level = np.full(n, -1)
    level[roots] = 0
    frontier, depth = roots, 0
    while frontier.size:
        _, nbr = _neighbours(frontier, indptr, targets)
        nbr = np.unique(nbr[level[nbr] < 0])
        depth += 1
        level[nbr] = depth
        frontier = nbr
    return level


def _components(n: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Each node's component, named by its smallest node (labels propagated to a fixed point)."""
    label = np.arange(n)
    while True:
        new = label.copy()
        np.minimum.at(new, src, label[dst])
        new = new[new]  # pointer jumping: fewer rounds on long paths
        if np.array_equal(new, label):
            return label
        label = new


def _first_per_component(comp: np.ndarray, key: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Per component, the candidate node with the smallest (key, node id)."""
    nodes = np.flatnonzero(candidates)
    order = np.lexsort((nodes, key[nodes], comp[nodes]))
    nodes = nodes[order]
    first = np.r_[True, comp[nodes][1:] != comp[nodes][:-1]]
    return nodes[first]


def cuthill_mckee(src: np.ndarray, dst: np.ndarray, n: int) -> np.ndarray:
    """Reverse Cuthill-McKee order of an undirected graph of ``n`` nodes: ``order[t]`` is the node
    placed at slot t. Edges (src[i], dst[i]) count in both directions; self-loops and repeated
    edges are ignored."""
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    s, d = np.concatenate([src, dst]), np.concatenate([dst, src])
    pairs = np.unique((s * n + d)[s != d])
    s, d = pairs // n, pairs % n
    degree = np.bincount(s, minlength=n)
    indptr = np.concatenate([[0], np.cumsum(degree)])
    comp = _components(n, s, d)
    # George-Liu pseudo-peripheral nodes: from a min-degree node, move to a min-degree node of
    # the last BFS level while that lengthens the component's eccentricity.
    roots = _first_per_component(comp, degree, np.ones(n, dtype=bool))  # by component label
    depth = _levels(roots, n, indptr, d)
    for _ in range(8):
        ecc = _per_component_max(comp, depth)
        candidates = _first_per_component(comp, degree, depth == ecc[comp])
        new_depth = _levels(candidates, n, indptr, d)
        better = (_per_component_max(comp, new_depth) > ecc)[comp[roots]]
        if not better.any():
            break
        roots = np.where(better, candidates, roots)
        depth = _levels(roots, n, indptr, d)
    return _numbered(roots, comp, n, degree, indptr, d)[::-1].copy()


def _per_component_max(comp: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(n,) indexed by component label: the largest value in the component."""
    out = np.full(comp.size, -1)
    np.maximum.at(out, comp, values)
    return out


def _numbered(roots, comp, n, degree, indptr, targets) -> np.ndarray:
    """Cuthill-McKee numbering: by component (its smallest node first), then BFS level, then
    within a level by the parent's number, the node's degree and its id; a node is numbered by
    the first parent that reaches it."""
    level, rank = np.full(n, -1), np.zeros(n, dtype=np.int64)
    level[roots] = 0
    frontier = roots[np.argsort(comp[roots], kind="stable")]
    rank[frontier] = np.arange(frontier.size)
    depth = 0
    while frontier.size:
        parent, nbr = _neighbours(frontier, indptr, targets)
        fresh = level[nbr] < 0
        parent, nbr = parent[fresh], nbr[fresh]
        order = np.lexsort((nbr, degree[nbr], parent))
        nbr = nbr[order]
        _, first = np.unique(nbr, return_index=True)
        frontier = nbr[np.sort(first)]
        depth += 1
        level[frontier] = depth
        rank[frontier] = np.arange(frontier.size)
    return np.lexsort((rank, level, comp))


def bandwidth(src: Tensor | np.ndarray, dst: Tensor | np.ndarray, order=None) -> int:
    """max |slot(u) - slot(v)| over the edges, with nodes at the slots ``order`` gives them."""
    src, dst = np.asarray(src), np.asarray(dst)
    if order is None or src.size == 0:
        return int(np.abs(src - dst).max(initial=0))
    slot = np.empty(len(order), dtype=np.int64)
    slot[np.asarray(order)] = np.arange(len(order))
    return int(np.abs(slot[src] - slot[dst]).max())


def block_density(src: Tensor, dst: Tensor, n: int, block: int, order: Tensor | None = None):
    """Block pairs holding an edge / all block pairs, nodes at the slots of ``order``."""
    if order is not None:
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=order.device)
        src, dst = slot[src], slot[dst]
    blocks = -(-n // block)
    used = torch.unique(src // block * blocks + dst // block).numel()
    return used / blocks**2


@dataclass(frozen=True, eq=False)
class NodeOrder:
    """One node order per sequence (or one for all): ``order[b, t]`` is the caller's token at
    slot t of sequence b, ``slot[b, i]`` the slot of the caller's token i."""

    order: Tensor  # (B or 1, L) long
    slot: Tensor  # (B or 1, L) long

    @classmethod
    def of(cls, order: Tensor) -> NodeOrder:
        slot = torch.empty_like(order)
        slot.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
        return cls(order, slot)

    @staticmethod
    def _take(x: Tensor, index: Tensor, dim: int) -> Tensor:
        if index.shape[0] == 1:
            return x.index_select(dim, index[0])
        shape = [1] * x.dim()
        shape[0], shape[dim] = index.shape[0], index.shape[1]
        return x.gather(dim, index.view(shape).expand(*x.shape[:dim], -1, *x.shape[dim + 1 :]))

    def gather(self, x: Tensor, dim: int = 2) -> Tensor:
        """Tokens of ``x`` (caller's order along ``dim``, batch first) into the slots."""
        return self._take(x, self.order, dim)

    def scatter(self, x: Tensor, dim: int = 2) -> Tensor:
        """Slots of ``x`` back into the caller's order: exact (a gather, no arithmetic)."""
        return self._take(x, self.slot, dim)


def in_node_order(layout):
    """(the layout answering for the slots of its RCM order, that ``NodeOrder``): global nodes
    first (they touch every block anyway), then each graph's other nodes in reverse
    Cuthill-McKee order of its edges, taken as undirected, global nodes' edges left out."""
    n, graphs = layout.nodes, layout.graphs
    g, q, k = (t.cpu().numpy() for t in layout.pairs())
    glob = layout.is_global.cpu().numpy()
    plain = ~glob[q] & ~glob[k]
    # The graphs side by side as one graph of graphs * n nodes: components never cross them.
    order = cuthill_mckee(g[plain] * n + q[plain], g[plain] * n + k[plain], graphs * n)
    first = np.where(glob[order % n], 0, 1)
    order = order[np.lexsort((first, order // n))]  # per graph, its globals first, order kept
    order = torch.from_numpy(order.reshape(graphs, n) % n).to(layout.keys.device)
    node_order = NodeOrder.of(order)
    return layout.in_order(node_order.order, node_order.slot), node_order
