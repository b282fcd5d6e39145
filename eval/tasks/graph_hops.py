"""Graph hops: how many hops is each node from a marked source node (a multi-hop graph task).

* Each sequence is a graph of L = ``seq_len`` nodes, token i being node i. The graph is a random
  geometric graph (L points uniform in the unit square, an edge between two points closer than
  r, r chosen for ``degree`` neighbours on average), its nodes numbered at random, so that token
  order says nothing about the graph. Its edges, both directions of each, are the batch's
  attention input ``edge_index`` (a list of (2, E) tensors, one per sequence): the graph reaches
  the model only through the attention of variant ``graph``; a variant that reads no graph (full,
  local) sees the tokens alone, and can do no better than the class frequencies.
* Token ids: 0 PAD (never emitted), 1 NODE, 2 SOURCE (one per sequence, uniform), so each
  sequence is NODE ... SOURCE ... NODE. Targets: 3 + the hop class of every node, where the hop
  class is the shortest-path distance from the source, 0 .. ``max_hops``, or ``max_hops`` + 1 for
  farther or unreachable nodes: vocab_size = num_classes = 3 + max_hops + 2 (8 by default).
  Every node is scored; slice "hops" is the hop class.
* A model with d layers of graph attention can carry the source's mark d hops, no further:
  ``max_hops`` below the depth is what it can learn.

Speed: 1000 graphs of 128 nodes take about 0.5 s on 2 CPU cores (the pairwise distances).
"""

from __future__ import annotations

import math
from collections import deque

import torch

from .base import Batch, Task, check_int, check_positive_float

NODE, SOURCE, FIRST_CLASS = 1, 2, 3


class GraphHops(Task):
    """Hop class of every node from the source node, over a random geometric graph."""

    name = "graph_hops"
    head = "token"

    def __init__(self, seq_len: int, max_hops: int = 3, degree: float = 4.0) -> None:
        super().__init__(seq_len, max_hops=max_hops, degree=degree)
        self.max_hops = check_int("max_hops", max_hops, minimum=1)
        self.degree = check_positive_float("degree", degree)
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 (a graph of nodes), got {seq_len}.")
        self.vocab_size = FIRST_CLASS + self.max_hops + 2
        self.num_classes = self.vocab_size

    def sample(self, n: int, seed: int) -> Batch:
        gen = self._check_sample_args(n, seed)
        L = self.seq_len
        radius = math.sqrt(self.degree / (math.pi * (L - 1)))
        points = torch.rand(n, L, 2, generator=gen)
        near = torch.cdist(points, points) < radius
        near &= ~torch.eye(L, dtype=torch.bool)
        source = torch.randint(0, L, (n,), generator=gen)
        # Frontier expansion on the dense adjacency: hop h reaches the neighbours of hop h - 1.
        hops = torch.full((n, L), self.max_hops + 1)
        seen = torch.zeros(n, L, dtype=torch.bool)
        seen[torch.arange(n), source] = True
        hops[torch.arange(n), source] = 0
        frontier = seen.clone()
        for h in range(1, self.max_hops + 1):
            frontier = (torch.bmm(frontier[:, None].float(), near.float())[:, 0] > 0) & ~seen
            hops[frontier] = h
            seen |= frontier
        inputs = torch.full((n, L), NODE)
        inputs[torch.arange(n), source] = SOURCE
        edges = [torch.stack(torch.nonzero(near[b], as_tuple=True)) for b in range(n)]
        return Batch(
            inputs=inputs,
            targets=hops + FIRST_CLASS,
            padding_mask=None,
            slices={"hops": hops},
            attention_inputs={"edge_index": edges},
        )


def solve(tokens: list[int], edge_index: torch.Tensor, max_hops: int) -> list[int]:
    """Independent checker: breadth-first search from the SOURCE token over the edge list."""
    neighbours: dict[int, list[int]] = {i: [] for i in range(len(tokens))}
    for u, v in edge_index.t().tolist():
        neighbours[u].append(v)
    start = tokens.index(SOURCE)
    distance = {start: 0}
    queue = deque([start])
    while queue:
        u = queue.popleft()
        for v in neighbours[u]:
            if v not in distance:
                distance[v] = distance[u] + 1
                queue.append(v)
    far = max_hops + 1
    return [FIRST_CLASS + min(distance.get(i, far), far) for i in range(len(tokens))]
