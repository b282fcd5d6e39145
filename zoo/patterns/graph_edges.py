"""A call's graph, as ``zoo.attention(..., variant="graph", edge_index=...)`` takes it, checked.

Accepted forms of ``edge_index`` (edge i goes from query node ``edge_index[0, i]`` to key node
``edge_index[1, i]``: the query attends to the key, as row and column of a mask; PyTorch
Geometric's ``flow="source_to_target"`` message passing is the transpose, ``edge_index.flip(0)``):

- an int tensor (2, E): one graph for every sequence of the batch;
- an int tensor (B, 2, E), or a list of B int tensors (2, E_b): one graph per sequence;
- a sparse COO adjacency (L, L) or (B, L, L) (``torch.sparse_coo_tensor``): its nonzero
  entries' (row, column) are the edges, their values ignored.

Node indices run over 0 .. L-1, L the sequence length; repeated edges count once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.arguments import is_integer_dtype


def _checked(edges: object, name: str, nodes: int) -> Tensor:
    if not isinstance(edges, Tensor):
        raise TypeError(f"{name} must be an int tensor of shape (2, E), got {type(edges).__name__}")
    if not is_integer_dtype(edges.dtype):
        raise TypeError(f"{name} must hold integer node indices, got dtype {edges.dtype}")
    if edges.dim() != 2 or edges.shape[0] != 2:
        raise ValueError(
            f"{name} must have shape (2, E) (query nodes, key nodes), got {tuple(edges.shape)}"
        )
    edges = edges.long()
    bad = (edges < 0) | (edges >= nodes)
    if bool(bad.any()):
        row, column = (int(i) for i in torch.nonzero(bad)[0])
        side = "query" if row == 0 else "key"
        raise ValueError(
            f"{name}: edge {column} names {side} node {int(edges[row, column])}, but the "
            f"sequence has {nodes} nodes (0 .. {nodes - 1})"
        )
    return edges


def _from_sparse(adjacency: Tensor, nodes: int) -> list[Tensor] | Tensor:
    shape = tuple(adjacency.shape)
    if adjacency.dim() not in (2, 3) or shape[-2:] != (nodes, nodes):
        raise ValueError(
            f"edge_index as a sparse adjacency must have shape ({nodes}, {nodes}) or "
            f"(B, {nodes}, {nodes}), got {shape}"
        )
    indices = adjacency.coalesce().indices()
    if adjacency.dim() == 2:
        return indices
    return [indices[1:, indices[0] == b] for b in range(shape[0])]


def graph_count(edge_index: object) -> int:
    """How many graphs ``edge_index`` holds: one per sequence in a list, a (B, 2, E) tensor or a
    (B, L, L) sparse adjacency; else 1 (one graph for the whole batch)."""
    if isinstance(edge_index, list | tuple):
        return len(edge_index)
    if isinstance(edge_index, Tensor) and edge_index.dim() == 3:
        return edge_index.shape[0]
    return 1


def graph_edges(edge_index: object, batch: int, nodes: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """(sequence, query node, key node) of every edge, int64, and the number of graphs (1: one
    for the whole batch, else ``batch``). Raises naming the argument and the offending value."""
    if isinstance(edge_index, Tensor) and edge_index.layout == torch.sparse_coo:
        edge_index = _from_sparse(edge_index, nodes)
    if isinstance(edge_index, Tensor) and edge_index.dim() == 3:
        edge_index = list(edge_index.unbind(0))
    if isinstance(edge_index, list | tuple):
        if len(edge_index) != batch:
            raise ValueError(
                f"edge_index holds {len(edge_index)} graphs, but the batch has {batch} sequences; "
                "pass one graph per sequence, or one (2, E) tensor for all"
            )
        parts = [_checked(e, f"edge_index[{b}]", nodes) for b, e in enumerate(edge_index)]
        which = torch.cat(
            [torch.full((p.shape[1],), b, device=p.device) for b, p in enumerate(parts)]
        )
        edges = torch.cat(parts, dim=1)
        return which, edges[0], edges[1], batch
    edges = _checked(edge_index, "edge_index", nodes)
    return torch.zeros_like(edges[0]), edges[0], edges[1], 1
