"""A decoding step's host time with and without its plan (``zoo.core.call_plans.step_signature``),
side by side in one process: ``zoo.attention(q, k, v, cache=...)`` one token at a time after a
prefill of 1024 tokens, B=1, 8 heads, D=64, float32, one thread, on auto (sdpa). The two modes
alternate in rounds of 20 steps (60 rounds each, the order swapped every round); "checked" hides
the step plans from the lookup, so every step takes the checked path, as before the plans.
Medians of the rounds' mean step time; ratio: planned / checked.

    OMP_NUM_THREADS=1 python eval/results/decode-step-ops-cpu/step_plans.py
"""

import statistics
import time

import torch

import zoo
from zoo.core import call_plans

torch.set_num_threads(1)
B, H, D, PREFILL = 1, 8, 64, 1024
PARAMS = {
    "causal": {},
    "sliding_window": {"window_size": 256},
    "longformer": {"window_size": 256},
    "block_local": {"block_size": 64},
}
real_find = call_plans.find


def unplanned(key):
    return None if key and key[0] == "step" else real_find(key)


for variant, params in PARAMS.items():
    cache = zoo.new_cache(variant, batch_size=B, max_len=PREFILL + 40000, num_kv_heads=H,
                          head_dim=D, **params)  # fmt: skip
    x = torch.randn(B, H, PREFILL, D)
    zoo.attention(x, x, x, cache=cache, variant=variant, causal=True, **params)
    q, k, v = (torch.randn(B, H, 1, D) for _ in range(3))
    times = {"planned": [], "checked": []}
    for round_ in range(60):
        for mode in ("planned", "checked")[:: 1 if round_ % 2 == 0 else -1]:
            call_plans.find = real_find if mode == "planned" else unplanned
            zoo.attention(q, k, v, cache=cache, variant=variant, causal=True, **params)
            start = time.perf_counter()
            for _ in range(20):
                zoo.attention(q, k, v, cache=cache, variant=variant, causal=True, **params)
            times[mode].append((time.perf_counter() - start) / 20 * 1e6)
    call_plans.find = real_find
    a, b = statistics.median(times["planned"]), statistics.median(times["checked"])
    print(f"{variant:15s} planned {a:6.1f} us   checked {b:6.1f} us   ratio {a / b:.2f}")
