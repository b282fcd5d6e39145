"""Block density of graph attention in the caller's node order and in reverse Cuthill-McKee order
(``zoo.patterns.node_order``), for three graph families with their nodes numbered at random.

    python -m eval.bench.graph_density > eval/results/graph_density.md

Density: block pairs holding an allowed pair (edges and self-loops) / all block pairs, at the
kernels' block sizes (64: the blocked backend; 128: flex). No timing; a property of the layout.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from zoo.patterns import RouteInputs, graph
from zoo.patterns.node_order import block_density, in_node_order


def geometric(n: int, rng: np.random.Generator, degree: float = 8.0) -> np.ndarray:
    """Points in the unit square joined within the radius that gives ``degree`` neighbours."""
    points = rng.random((n, 2))
    radius = math.sqrt(degree / (math.pi * n))
    order = np.argsort(points[:, 0])  # a sweep along x: pairs within radius, not all n^2
    src, dst = [], []
    for i, a in enumerate(order):
        for b in order[i + 1 :]:
            if points[b, 0] - points[a, 0] >= radius:
                break
            if np.linalg.norm(points[a] - points[b]) < radius:
                src.append(a)
                dst.append(b)
    return np.array([src, dst])


def grid(n: int, rng: np.random.Generator) -> np.ndarray:
    """A side x side 4-neighbour grid (a mesh)."""
    side = math.isqrt(n)
    index = np.arange(side * side).reshape(side, side)
    right = np.stack([index[:, :-1].ravel(), index[:, 1:].ravel()])
    down = np.stack([index[:-1].ravel(), index[1:].ravel()])
    return np.concatenate([right, down], axis=1)


def regular(n: int, rng: np.random.Generator, degree: int = 8) -> np.ndarray:
    """A random degree-regular multigraph by the pairing model (an expander: no good order)."""
    stubs = rng.permutation(np.repeat(np.arange(n), degree))
    return stubs.reshape(2, -1)


FAMILIES = {"random geometric (degree ~8)": geometric, "grid (4-neighbour)": grid,
            "random 8-regular": regular}  # fmt: skip


def shuffled(make, n: int) -> tuple[torch.Tensor, int]:
    """(edge_index (2, E) with every edge both ways, nodes): a family's graph of about n nodes,
    its nodes numbered at random (seed 0)."""
    rng = np.random.default_rng(0)
    edges = make(n, rng)
    n = int(edges.max()) + 1
    edges = torch.from_numpy(rng.permutation(n)[edges])
    return torch.cat([edges, edges.flip(0)], dim=1), n


def rows(sizes=(1024, 4096), blocks=(64, 128)) -> list[str]:
    out = []
    for name, make in FAMILIES.items():
        for n in sizes:
            both, n = shuffled(make, n)
            x = torch.zeros(1, 1, n, 1)
            layout = graph().bind(RouteInputs(x, x, edge_index=both))
            ordered, _ = in_node_order(layout)
            _, q, k = layout.pairs()
            _, sq, sk = ordered.slot_pairs()
            for block in blocks:
                before, after = block_density(q, k, n, block), block_density(sq, sk, n, block)
                out.append(
                    f"| {name} | {n} | {both.shape[1]} | {block} | {before:.4f} | {after:.4f} | "
                    f"{before / after:.2f}x |"
                )
    return out


def main() -> None:
    print(__doc__.split("\n\n")[2].replace("\n", " ").strip())
    print("Command: `python -m eval.bench.graph_density`.\n")
    print("| family | nodes | edges | block | caller's order (shuffled) | RCM order | ratio |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows()))


if __name__ == "__main__":
    main()
