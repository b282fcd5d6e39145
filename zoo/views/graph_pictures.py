"""``zoo show graph``: a graph's adjacency as a matrix, in the caller's node order and in the
reverse Cuthill-McKee order that the call runs in (``zoo.patterns.node_order``), side by side;
with ``reorder=False`` the call runs in the caller's order, and the RCM panel's title says so.

Without a graph of the caller's, it draws an example: a random geometric graph (points in the
unit square joined within a radius that gives about 8 neighbours each) whose nodes are numbered
at random, seed 0; the grey lines mark blocks of 64, the blocked backend's kernel block.
"""

from __future__ import annotations

import math

import torch
from matplotlib.figure import Figure

from ..patterns import RouteInputs, resolve_family
from ..patterns.node_order import block_density, in_node_order
from .tables import format_params

BLOCK = 64


def example_graph(n: int, seed: int = 0, degree: float = 8.0) -> torch.Tensor:
    """(2, E): a random geometric graph of ``n`` shuffled nodes, both directions of each edge."""
    generator = torch.Generator().manual_seed(seed)
    points = torch.rand(n, 2, generator=generator, dtype=torch.float64)
    radius = math.sqrt(degree / (math.pi * n))
    # Cells of side radius: neighbours lie in the 3 x 3 cells around a point (O(n) pairs tested).
    cells = (points / radius).floor().long()
    src, dst = [], []
    for dx in (-1, 0, 1):
        for dy in (-1, 0, 1):
            key = cells + torch.tensor([dx, dy])
            a, b = torch.nonzero(
                (key[:, None] == cells[None]).all(-1), as_tuple=True
            )  # small n only: pictures
            near = (points[a] - points[b]).norm(dim=-1) < radius
            src.append(a[near & (a != b)])
            dst.append(b[near & (a != b)])
    shuffle = torch.randperm(n, generator=generator)
    return torch.stack([shuffle[torch.cat(src)], shuffle[torch.cat(dst)]])


def draw_graph(
    seq_len: int,
    figure_size: tuple[float, float],
    *,
    causal: bool = False,
    edge_index: torch.Tensor | None = None,
    **params: object,
) -> Figure:
    """The figure: adjacency in the caller's order (left) and in the order the call runs in."""
    example = edge_index is None
    edges = example_graph(seq_len) if example else edge_index
    pattern = resolve_family("graph")(**params)
    pattern = pattern.causal_form() if causal else pattern
    x = torch.zeros(1, 1, seq_len, 1)
    layout = pattern.specialize(seq_len, seq_len).bind(RouteInputs(x, x, edge_index=edges))
    ordered, _ = in_node_order(layout)
    figure = Figure(figsize=figure_size)
    # With reorder=False the call runs in the caller's order: the RCM panel is only a comparison.
    rcm = "RCM order" if pattern.reorder else "RCM order (not run: reorder=False)"
    for i, (shown, name) in enumerate(((layout, "caller's order"), (ordered, rcm))):
        axes = figure.add_subplot(1, 2, i + 1)
        _, q, k = shown.slot_pairs()
        density = block_density(q, k, seq_len, BLOCK)
        axes.plot(k.numpy(), q.numpy(), ",", color="black")
        axes.set_xlim(-0.5, seq_len - 0.5)
        axes.set_ylim(seq_len - 0.5, -0.5)
        axes.set_aspect("equal")
        for edge in range(BLOCK, seq_len, BLOCK):
            axes.axhline(edge - 0.5, color="0.8", linewidth=0.5)
            axes.axvline(edge - 0.5, color="0.8", linewidth=0.5)
        axes.set_title(f"{name}\nblock density {density:.1%} (blocks of {BLOCK})", fontsize=9)
        axes.set_xlabel("key node")
        axes.set_ylabel("query node" if i == 0 else "")
    what = "example: random geometric graph, shuffled (seed 0)" if example else "given graph"
    shape = f"n={seq_len}, {int(layout.keys.numel())} pairs" + (", causal" if causal else "")
    figure.suptitle(f"graph ({shape})\n{what}\n{format_params(params)}", fontsize=10)
    figure.tight_layout()
    return figure
