"""``python -m eval.bench.cache_memory [--lengths N] [--start L] [--backend NAME]``: resident
memory of one process that calls attention at N distinct sequence lengths, as a training run over
unbucketed lengths does, with the per-shape caches' entries and bytes (``zoo.core.shape_cache``).

BigBird (block 64, 3 random blocks), B=1, H=1, D=16, float32, one thread, lengths L, L+1, ...;
prints a markdown table row at 10, 100, 200, 500 and 1000 lengths (those up to N).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import zoo
from zoo.core import shape_cache

CHECKPOINTS = (10, 100, 200, 500, 1000)


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench.cache_memory", description=__doc__)
    parser.add_argument("--lengths", type=int, default=1000)
    parser.add_argument("--start", type=int, default=4000)
    parser.add_argument("--backend", default="blocked")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"bigbird, backend={args.backend}, lengths from {args.start}, torch {torch.__version__}, "
          f"byte bound {shape_cache.stats()['max_bytes'] / 2**20:.0f} MiB")  # fmt: skip
    print("| lengths | resident MiB | cache entries | cache MiB | seconds |")
    print("|---|---|---|---|---|")
    start = time.perf_counter()
    for count in range(1, args.lengths + 1):
        q = torch.randn(1, 1, args.start + count - 1, 16)
        zoo.attention(q, q, q, variant="bigbird", block_size=64, backend=args.backend)
        if count in CHECKPOINTS or count == args.lengths:
            held = shape_cache.stats()
            seconds = time.perf_counter() - start
            print(f"| {count} | {resident_mib():.0f} | {held['entries']} | "
                  f"{held['bytes'] / 2**20:.0f} | {seconds:.0f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
