"""MoBA (block_size 256, top_k 3) on the blocked backend at 8K tokens, one thread: peak RSS above
a warm-up at 256 tokens, and the median of a few calls after the first (README.md).

python eval/results/moba-runs-cpu/time_moba.py fwd|fb causal(0|1) [reps]"""

import os
import resource
import statistics
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"
import torch

import zoo

torch.set_num_threads(1)
passes, causal = sys.argv[1], sys.argv[2] == "1"
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5


def call(n: int):
    q, k, v = (torch.randn(1, 2, n, 32, requires_grad=passes == "fb") for _ in range(3))

    def run():
        out = zoo.attention(q, k, v, variant="moba", backend="blocked", causal=causal,
                            block_size=256, top_k=3)  # fmt: skip
        if passes == "fb":
            out.sum().backward()

    return run


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


call(256)()
base = rss_mb()
run = call(8192)
start = time.perf_counter()
run()
first = time.perf_counter() - start
times = []
for _ in range(reps):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
median = statistics.median(times)
print(f"{passes} causal={causal}: first {first * 1e3:.0f} ms, median {median * 1e3:.0f} ms, "
      f"peak RSS above the warm-up {rss_mb() - base:.0f} MB")  # fmt: skip
