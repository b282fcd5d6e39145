"""``graph``: attention along the edges of a graph given with each call ("attention as a GNN").

Tokens are the nodes of a graph, token i node i; query node u attends to key node v when the
graph has the edge u -> v (``edge_index`` columns (u, v); the forms it takes are in
``zoo.patterns.graph_edges``)::

    edges 0->1, 1->2, 2->0, 3->1     self_loops=True         + global_nodes=(3,)
    (4 nodes)                          keys 0 1 2 3             keys 0 1 2 3
                                   q0      x x . .          q0      x x . x
                                   q1      . x x .          q1      . x x x
                                   q2      x . x .          q2      x . x x
                                   q3      . x . x          q3      x x x x

- ``self_loops`` (default True): every node also attends to itself, so no row is empty unless
  asked (``self_loops=False``: a node without an out-edge gets a zero output).
- ``global_nodes``: node indices that attend to every node and that every node attends to.
- ``undirected``: each edge counts in both directions.
- causal (``causal=True``): only the edges u -> v with v <= u, in the caller's node numbering
  (a node attends to itself and to lower-numbered nodes it has an edge to); global nodes and
  self-loops obey it too. The pattern keeps this rule itself, so it holds in any node order.
- ``reorder`` (default True): the call runs in reverse Cuthill-McKee order of each graph
  (``zoo.patterns.node_order``), where the adjacency clusters into blocks, and returns the outputs
  in the caller's order. Skipped when composed with other patterns (their positions are the
  caller's) or with a positional score bias (alibi, t5).

The graph is data, given per call, so the pattern is bound to a call (the protocol of
``zoo.patterns.routed``): ``bind`` reads ``RouteInputs.edge_index`` and returns a
``GraphLayout``, whose views carry a leading graph dimension (1, or one per sequence) and which
every backend that runs routed layouts runs. Every view is built from the edge list, in
O(E + L * (1 + len(global_nodes))) memory, never L^2, except ``dense`` (tests and pictures).
Queries and keys are the same nodes: q_len must equal kv_len.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..core.arguments import check_int
from .base import Pattern, Spans, state_from
from .families import register_pattern
from .graph_edges import graph_edges
from .routed import RouteInputs


@dataclass(frozen=True)
class Graph(Pattern):
    """The edges of the call's graph (see the module docstring); bind it to a call's inputs."""

    self_loops: bool = True
    global_nodes: tuple[int, ...] = ()
    undirected: bool = False
    reorder: bool = True
    causal: bool = False

    def __post_init__(self) -> None:
        for name in ("self_loops", "undirected", "reorder", "causal"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        nodes = self.global_nodes
        if isinstance(nodes, int):
            nodes = (nodes,)
        if not isinstance(nodes, tuple | list):
            raise TypeError(f"global_nodes must be a tuple of node indices, got {nodes!r}")
        nodes = tuple(check_int(f"global_nodes[{i}]", g, minimum=0) for i, g in enumerate(nodes))
        object.__setattr__(self, "global_nodes", nodes)

    @property
    def routed(self) -> bool:
        return True

    @property
    def causal_in_itself(self) -> bool:
        return self.causal

    def causal_form(self) -> Pattern:
        return replace(self, causal=True)

    def specialize(self, q_len: int, kv_len: int, device: torch.device | None = None) -> Pattern:
        if q_len != kv_len:
            raise ValueError(
                f"variant 'graph' attends among the nodes of one graph: q_len must equal kv_len, "
                f"got q_len={q_len}, kv_len={kv_len}"
            )
        for g in self.global_nodes:
            if g >= kv_len:
                raise ValueError(
                    f"global_nodes names node {g}, but the sequence has {kv_len} nodes "
                    f"(0 .. {kv_len - 1})"
                )
        return self

    def bind(self, inputs: object) -> Pattern:
        if not isinstance(inputs, RouteInputs):
            raise TypeError(f"graph binds to RouteInputs, got {type(inputs).__name__}")
        if inputs.edge_index is None:
            raise ValueError(
                "variant 'graph' needs the call's graph: pass edge_index=(2, E) node pairs (or "
                "one graph per sequence, or a sparse adjacency) to zoo.attention or to "
                "MultiHeadAttention.forward"
            )
        if torch.compiler.is_compiling():  # fullgraph=True raises here, with this sentence
            torch._dynamo.graph_break(
                msg="variant 'graph' builds its layout from the call's edge_index, data that "
                "torch.compile cannot trace into a static structure: it compiles with graph "
                "breaks (fullgraph=False), as docs/using-in-a-model.md says"
            )
        n, device = inputs.k.shape[2], inputs.k.device
        which, query, key, graphs = graph_edges(inputs.edge_index, inputs.q.shape[0], n)
        which, query, key = which.to(device), query.to(device), key.to(device)
        if self.undirected:
            which, query, key = which.repeat(2), torch.cat([query, key]), torch.cat([key, query])
        nodes = torch.arange(n, device=device)
        per_graph = torch.arange(graphs, device=device).repeat_interleave(n)
        pieces = [(which, query, key)]
        if self.self_loops:
            pieces.append((per_graph, nodes.repeat(graphs), nodes.repeat(graphs)))
        for g in self.global_nodes:  # row g and column g, in every graph
            anchor = torch.full_like(per_graph, g)
            pieces += [(per_graph, anchor, nodes.repeat(graphs))]
            pieces += [(per_graph, nodes.repeat(graphs), anchor)]
        which, query, key = (torch.cat(column) for column in zip(*pieces, strict=True))
        if self.causal or inputs.causal:
            keep = key <= query
            which, query, key = which[keep], query[keep], key[keep]
        is_global = torch.zeros(n, dtype=torch.bool, device=device)
        is_global[list(self.global_nodes)] = True
        keys = torch.unique((which * n + query) * n + key)  # sorted
        return GraphLayout(n, graphs, keys, is_global, self.reorder)

    def _needs_inputs(self, *args: object) -> Tensor:
        raise TypeError(
            "a graph's pairs come with each call: bind it (pattern.bind(RouteInputs(q, k, "
            "edge_index=...))), or call zoo.attention(q, k, v, variant='graph', edge_index=...)"
        )

    allowed = block_state = dense = _needs_inputs  # type: ignore[assignment]


@register_pattern("graph")
def graph(
    self_loops: bool = True,
    global_nodes: tuple[int, ...] = (),
    undirected: bool = False,
    reorder: bool = True,
) -> Graph:
    """Attention along the edges of the call's graph (``edge_index``)."""
    return Graph(self_loops, global_nodes, undirected, reorder)  # Graph checks global_nodes


@dataclass(frozen=True, eq=False)
class GraphLayout(Pattern):
    """A graph bound to one call (compared by identity). ``keys`` are its allowed pairs,
    (graph * L + query) * L + key, sorted, in the caller's node numbering; ``order``, when set,
    puts node ``order[g, t]`` at slot t, and the views then answer for slots."""

    nodes: int
    graphs: int  # 1 (one graph for the batch) or the batch size
    keys: Tensor  # (pairs,) int64, sorted
    is_global: Tensor  # (L,) bool
    reorder: bool
    order: Tensor | None = None  # (graphs, L) node at each slot
    slot: Tensor | None = None  # (graphs, L) slot of each node

    @property
    def routed(self) -> bool:
        return True

    def in_order(self, order: Tensor, slot: Tensor) -> GraphLayout:
        """The same pairs, with the views answering for slots of ``order`` (graphs or 1, L)."""
        return replace(self, order=order, slot=slot)

    def pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """(graph, query node, key node) of every allowed pair, in the caller's numbering."""
        n = self.nodes
        return self.keys // (n * n), self.keys // n % n, self.keys % n

    def slot_pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        """(graph, query slot, key slot) of every allowed pair: ``pairs`` in this layout's order."""
        g, q, k = self.pairs()
        if self.slot is None:
            return g, q, k
        slot = self.slot.expand(self.graphs, -1)
        return g, slot[g, q], slot[g, k]

    def listed_pairs(self, batch: int) -> tuple[Tensor, Tensor, Tensor]:
        """``slot_pairs`` for each of ``batch`` sequences (one graph shared by all, or its own)."""
        g, q, k = self.slot_pairs()
        if self.graphs > 1:
            return g, q, k
        seq = torch.arange(batch, device=g.device).repeat_interleave(g.numel())
        return seq, q.repeat(batch), k.repeat(batch)

    def allowed(self, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        if self.graphs > 1:
            raise TypeError("one graph per sequence: use allowed_at(b, h, ...)")
        return self.allowed_at(torch.zeros_like(q_pos), None, q_pos, kv_pos)

    def allowed_at(self, b: Tensor, h: Tensor, q_pos: Tensor, kv_pos: Tensor) -> Tensor:
        n = self.nodes
        inside = (q_pos >= 0) & (q_pos < n) & (kv_pos >= 0) & (kv_pos < n)
        q, k = q_pos.clamp(0, n - 1), kv_pos.clamp(0, n - 1)  # padding slots: ignored
        graph = b if self.graphs > 1 else torch.zeros_like(b)
        if self.order is not None:
            order = self.order.expand(self.graphs, -1)
            q, k = order[graph, q], order[graph, k]
        if self.keys.numel() == 0:
            return inside & False
        key = (graph * n + q) * n + k
        found = torch.searchsorted(self.keys, key).clamp(max=self.keys.numel() - 1)
        return inside & (self.keys[found] == key)

    def block_state(self, q: Spans, k: Spans) -> Tensor:
        """(graphs, 1, q blocks, k blocks): blocks counted from the pairs, FULL where a block's
        pairs are all there. Blocks of consecutive slots only (the natural frame); in another
        frame every nonempty block is PARTIAL, a true claim."""
        q_lo, k_lo = q.lo.flatten(), k.lo.flatten()
        shape = (self.graphs, q_lo.numel(), k_lo.numel())
        if q.step != 1 or k.step != 1 or q.box is not None or k.box is not None:
            some = torch.ones(shape, dtype=torch.bool, device=q_lo.device)
            return state_from(some, ~some, q, k)[:, None]
        g, sq, sk = self.slot_pairs()
        row = torch.searchsorted(q_lo, sq, right=True) - 1
        column = torch.searchsorted(k_lo, sk, right=True) - 1
        count = torch.zeros(shape, dtype=torch.long, device=q_lo.device)
        count.index_put_((g, row, column), torch.ones_like(g), accumulate=True)
        area = (q.hi - q.lo + 1).clamp(min=0) * (k.hi - k.lo + 1).clamp(min=0)
        return state_from(count > 0, count == area, q, k)[:, None]

    def dense(self, q_len: int, kv_len: int) -> Tensor:
        """(graphs, 1, L, L) bool, in slot order when the layout has one."""
        mask = torch.zeros(self.graphs, 1, q_len, kv_len, dtype=torch.bool)
        g, q, k = (t.cpu() for t in self.slot_pairs())
        mask[g, 0, q, k] = True
        return mask.to(self.keys.device)


def reads_graph(pattern: Pattern) -> bool:
    """Whether the pattern, or a member of it, is a ``graph`` (which reads ``edge_index``)."""
    if isinstance(pattern, Graph | GraphLayout):
        return True
    members = [*getattr(pattern, "children", ())]
    members += [getattr(pattern, name) for name in ("include", "exclude") if hasattr(pattern, name)]
    return any(reads_graph(m) for m in members)
