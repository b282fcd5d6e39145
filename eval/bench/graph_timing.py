"""Time of graph attention per backend, for the graph families of ``graph_density`` (nodes
numbered at random, edges both ways), forward and forward+backward.

    python -m eval.bench.graph_timing > eval/results/graph-timing-cpu.md

Per cell: the median wall time (ms) of at least 5 runs, more while they took under 0.5 s, after
one warm-up, of ``zoo.attention(q, k, v, variant="graph", edge_index=..., backend=...)`` with
q, k, v of (batch 8, heads 4, nodes, 32), float32: the call as a model makes it, the graph's
layout and node order built inside. ``sdpa`` is dense attention with the graph as a mask;
``auto`` includes the time of its choice.
"""

from __future__ import annotations

import statistics
import sys

import torch

import zoo
from eval.bench.graph_density import FAMILIES, shuffled
from eval.bench.measure import time_runs

BACKENDS = ("blocked", "sdpa", "auto")


def _time(edges: torch.Tensor, n: int, backend: str, backward: bool, batch: int, repeats: int):
    q, k, v = (torch.randn(batch, 4, n, 32, requires_grad=backward) for _ in range(3))

    def step() -> None:
        out = zoo.attention(q, k, v, variant="graph", edge_index=edges, backend=backend)
        if backward:
            out.sum().backward()

    with torch.set_grad_enabled(backward):
        return statistics.median(time_runs(step, q.device, 1, repeats, None, 500.0))


def rows(sizes=(1024, 4096), batch: int = 8, repeats: int = 5) -> list[str]:
    out = []
    for name, make in FAMILIES.items():
        for n in sizes:
            edges, n = shuffled(make, n)
            for backward in (False, True):
                times = [_time(edges, n, b, backward, batch, repeats) for b in BACKENDS]
                cells = " | ".join(f"{t:.1f}" for t in times)
                step = "fwd+bwd" if backward else "fwd"
                out.append(f"| {name} | {n} | {edges.shape[1]} | {step} | {cells} |")
    return out


def main() -> None:
    torch.manual_seed(0)
    print("# Graph attention: time per backend (CPU)\n")
    print(" ".join(__doc__.split("\n\n")[2].split()))
    print(
        f"\nCommand: `python -m eval.bench.graph_timing`; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads.\n"
    )
    print(f"| family | nodes | edges | pass | {' | '.join(BACKENDS)} |")
    print("|---|---|---|---|" + "---|" * len(BACKENDS))
    sizes = tuple(int(a) for a in sys.argv[1:]) or (1024, 4096)
    print("\n".join(rows(sizes)), flush=True)


if __name__ == "__main__":
    main()
