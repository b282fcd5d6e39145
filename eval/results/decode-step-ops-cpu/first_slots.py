"""A block-local step that reads its block's slots without a mask (``KVCache.reads_first_slots``)
against the same step with the mask over the ring (before), side by side in one process:
``zoo.attention(q, k, v, cache=...)`` one token at a time after a prefill of 1000 tokens, B=1,
8 heads, D=64, float32, one thread, on auto (sdpa), blocks of 64 and of 256. The two modes
alternate in rounds of 20 steps (150 rounds each, each on its own cache, the order swapped every
round); "before" answers False where the cache would read its first slots. Medians of the rounds'
mean step time; ratio: after / before. The outputs of the two modes are checked equal.

    OMP_NUM_THREADS=1 python eval/results/decode-step-ops-cpu/first_slots.py
"""

import statistics
import time

import torch

import zoo
from zoo.decoding.cache import KVCache

torch.set_num_threads(1)
B, H, D, PREFILL, MAX_LEN = 1, 8, 64, 1000, 8192
reads = KVCache.reads_first_slots
mode = {"after": True}
KVCache.reads_first_slots = lambda self, p, c: mode["after"] and reads(self, p, c)
for block in (64, 256):
    params = {"block_size": block}
    x = torch.randn(B, H, PREFILL, D)
    caches = {}
    for after in (True, False):
        caches[after] = zoo.new_cache("block_local", batch_size=B, max_len=MAX_LEN,
                                      num_kv_heads=H, head_dim=D, **params)  # fmt: skip
        zoo.attention(x, x, x, cache=caches[after], variant="block_local", causal=True, **params)
    steps = [tuple(torch.randn(B, H, 1, D) for _ in range(3)) for _ in range(21)]
    times = {True: [], False: []}
    for round_ in range(150):
        outs = {}
        for after in (True, False)[:: 1 if round_ % 2 == 0 else -1]:
            mode["after"], cache = after, caches[after]
            q, k, v = steps[0]
            zoo.attention(q, k, v, cache=cache, variant="block_local", causal=True, **params)
            start = time.perf_counter()
            for q, k, v in steps[1:]:
                out = zoo.attention(q, k, v, cache=cache, variant="block_local", causal=True,
                                    **params)  # fmt: skip
            times[after].append((time.perf_counter() - start) / 20 * 1e6)
            outs[after] = out
        torch.testing.assert_close(outs[True], outs[False])
    a, b = statistics.median(times[True]), statistics.median(times[False])
    print(f"block_local ({block:3d}) after {a:6.1f} us   before {b:6.1f} us   ratio {a / b:.2f}")
