"""A one-token step of rows of one length: its slot found on the host and written by slice
copies (``KVCache.host_slot``), and its mask asked only about the slots in use
(``DecodeStep.mask_within``), against the step as before (the slot computed on the device and
written through index tensors; the mask over every slot of the store, then cut), side by side
in one process. ``zoo.attention(q, k, v, cache=...)`` one token at a time after a prefill of
1024 tokens into a cache of 8192 slots' length (max_len), B=1, 8 heads, D=64, float32, one
thread, on auto (sdpa). The two modes alternate in rounds of 20 steps (150 rounds each, each on
its own cache, the order swapped every round); "before" patches the two changes out. Medians of
the rounds' mean step time; ratio: after / before. The caches end equal, bit for bit.

    OMP_NUM_THREADS=1 python eval/results/decode-step-ops-cpu/host_slot.py
"""

import statistics
import time

import torch

import zoo
from zoo.backends.base import DecodeStep
from zoo.decoding.cache import KVCache

torch.set_num_threads(1)
B, H, D, PREFILL, MAX_LEN = 1, 8, 64, 1024, 8192
PARAMS = {
    "causal": {},
    "sliding_window": {"window_size": 256},
    "longformer": {"window_size": 256},
    "block_local": {"block_size": 64},
    "bigbird": {},
    "moba": {},
}
write, mask_within = KVCache.write, DecodeStep.mask_within
mode = {"after": True}


def either_write(self, k, v, positions, valid, every_kept=False, position=None):
    return write(self, k, v, positions, valid, every_kept, position if mode["after"] else None)


def either_mask(self, width):
    if mode["after"] or width is None:
        return mask_within(self, width)
    return mask_within(self, None)[..., :width]  # the whole store, then cut


KVCache.write, DecodeStep.mask_within = either_write, either_mask
for variant, params in PARAMS.items():
    x = torch.randn(B, H, PREFILL, D)
    caches = {}
    for after in (True, False):
        caches[after] = zoo.new_cache(variant, batch_size=B, max_len=MAX_LEN, num_kv_heads=H,
                                      head_dim=D, **params)  # fmt: skip
        zoo.attention(x, x, x, cache=caches[after], variant=variant, causal=True, **params)
    steps = [tuple(torch.randn(B, H, 1, D) for _ in range(3)) for _ in range(21)]
    times = {True: [], False: []}
    for round_ in range(150):
        for after in (True, False)[:: 1 if round_ % 2 == 0 else -1]:
            mode["after"], cache = after, caches[after]
            q, k, v = steps[0]
            zoo.attention(q, k, v, cache=cache, variant=variant, causal=True, **params)
            start = time.perf_counter()
            for q, k, v in steps[1:]:
                zoo.attention(q, k, v, cache=cache, variant=variant, causal=True, **params)
            times[after].append((time.perf_counter() - start) / 20 * 1e6)
    for name in ("keys", "values", "slot_pos", "lengths"):
        assert torch.equal(getattr(caches[True], name), getattr(caches[False], name)), name
    a, b = statistics.median(times[True]), statistics.median(times[False])
    print(f"{variant:15s} after {a:7.1f} us   before {b:7.1f} us   ratio {a / b:.2f}", flush=True)
