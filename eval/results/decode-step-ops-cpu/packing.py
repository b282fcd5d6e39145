"""sdpa's packing of a step's allowed keys (``zoo.backends.sdpa.gather_allowed``) against reading
the slots in use with the mask, side by side in one process on a CPU: ``zoo.attention(q, k, v,
cache=...)`` one token at a time after a prefill, B=1, 8 heads, D=64, max_len 8192, float32, one
thread, on auto (sdpa). The two modes alternate in rounds of 10 steps (60 rounds each, each on
its own cache, the order swapped every round); "masked" makes ``gather_allowed`` answer None.
Medians of the rounds' mean step time; ratio: packed / masked.

    OMP_NUM_THREADS=1 python eval/results/decode-step-ops-cpu/packing.py
"""

import statistics
import time

import torch

import zoo
from zoo.backends import sdpa

torch.set_num_threads(1)
B, H, D, MAX_LEN = 1, 8, 64, 8192
gather = sdpa.gather_allowed
mode = {"pack": True}
sdpa.gather_allowed = lambda *args: gather(*args) if mode["pack"] else None
CELLS = [
    ("bigbird", {}, 1024), ("bigbird", {}, 4096), ("strided", {}, 1024),
    ("block_local", {"block_size": 64}, 1024), ("moba", {}, 1024), ("moba", {}, 4096),
]  # fmt: skip
for variant, params, prefill in CELLS:
    x = torch.randn(B, H, prefill, D)
    caches = {}
    for pack in (True, False):
        caches[pack] = zoo.new_cache(variant, batch_size=B, max_len=MAX_LEN, num_kv_heads=H,
                                     head_dim=D, **params)  # fmt: skip
        zoo.attention(x, x, x, cache=caches[pack], variant=variant, causal=True, **params)
    steps = [tuple(torch.randn(B, H, 1, D) for _ in range(3)) for _ in range(10)]
    times = {True: [], False: []}
    for round_ in range(60):
        for pack in (True, False)[:: 1 if round_ % 2 == 0 else -1]:
            mode["pack"], cache = pack, caches[pack]
            start = time.perf_counter()
            for q, k, v in steps:
                zoo.attention(q, k, v, cache=cache, variant=variant, causal=True, **params)
            times[pack].append((time.perf_counter() - start) / len(steps) * 1e6)
    a, b = statistics.median(times[True]), statistics.median(times[False])
    print(f"{variant:12s} {prefill:5d}  packed {a:7.1f} us  masked {b:7.1f} us  ratio {a / b:.2f}")
