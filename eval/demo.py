"""Build every registered variant by name, run it forward and backward, and print what it cost.

``python -m eval demo [--seq-len N]``: for each variant, the backend that ``auto`` chose, the
allowed pairs and the pairs that backend scored (both as a fraction of n^2), and the median time
of a forward + backward pass. A variant that reads the call's graph (``graph``) runs on an
example graph (``zoo.testing.routed_views.example_graph``: a ring, chords and a clique of 24 nodes);
one that chooses its blocks by content (``moba``) chooses them from the random input, so its
fractions are the mean over heads.
"""

# Why this file sits at eval/'s top level rather than in eval/harness or eval/bench: it trains
# nothing and reads no task (not the harness), and it has no config, peers, reference check or
# bench.json (not the benchmark); it is a one-screen tour of the zoo that imports only zoo, so it
# stays beside the two tools, depending on neither.

from __future__ import annotations

import argparse
import statistics
import time

import torch

import zoo
from zoo.__main__ import positive_int
from zoo.backends import resolve_backend
from zoo.functional import prepare_call
from zoo.patterns import reads_graph
from zoo.registry import get_spec
from zoo.testing.routed_views import example_graph
from zoo.views.tables import markdown_table


def time_variant(variant: str, x: torch.Tensor, repeats: int) -> tuple[str, float, float, float]:
    """(backend, allowed fraction, scored fraction, median seconds) for one variant."""
    n = x.shape[2]
    q, k, v = (x.clone().requires_grad_() for _ in range(3))
    pattern = get_spec(variant).build()
    inputs = {"edge_index": example_graph(n)} if reads_graph(pattern) else {}
    call = prepare_call(q, k, v, variant=variant, **inputs)
    backend = resolve_backend("auto", call)
    if call.pattern.routed:  # bound to this call: a layout per sequence and head
        dense = call.pattern.dense(n, n)
        allowed = float(torch.broadcast_to(dense, (*q.shape[:2], n, n)).float().mean())
    else:
        allowed = zoo.allowed_pairs(pattern, n, n) / n**2
    scored = backend.scored_pairs(call) / n**2
    times = []
    for _ in range(repeats + 1):  # the first run builds and caches the layout
        start = time.perf_counter()
        zoo.attention(q, k, v, variant=variant, **inputs).sum().backward()
        times.append(time.perf_counter() - start)
    return backend.name, allowed, scored, statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seq-len", type=positive_int, default=2048)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--head-dim", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--variants", default="*", help="a glob over variant names")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(1, args.heads, args.seq_len, args.head_dim)
    rows = []
    for name in zoo.list_variants(args.variants):
        backend, allowed, scored, seconds = time_variant(name, x, args.repeats)
        rows.append(
            [
                name,
                backend,
                f"{allowed:.3f}",
                f"{scored:.3f}",
                f"{seconds * 1e3:.1f}",
                get_spec(name).complexity,
            ]
        )
    headers = ["variant", "backend", "allowed / n²", "scored / n²", "fwd+bwd ms", "complexity"]
    table = markdown_table(headers, rows)
    print(
        f"n = {args.seq_len}, heads = {args.heads}, head_dim = {args.head_dim}, "
        f"CPU float32, median of {args.repeats}"
    )
    print(table)
    return 0
