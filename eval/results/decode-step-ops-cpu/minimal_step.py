"""A floor for a sliding-window step's host time on this machine: the step written by hand (the
new key and value copied into their ring slot, the slot's position and the row's length set,
SDPA over the ring; on a cache of its own), beside ``zoo.attention``'s step and SDPA alone over
the ring. B=1, 8 heads, D=64, float32, one thread, a 1024-token prefill, a window of 256. Best of
5 repeats of 2000 steps.

    OMP_NUM_THREADS=1 python eval/results/decode-step-ops-cpu/minimal_step.py
"""

import timeit

import torch

import zoo

torch.set_num_threads(1)
B, H, D, PREFILL = 1, 8, 64, 1024
params = {"window_size": 256}
x = torch.randn(B, H, PREFILL, D)


def filled():
    cache = zoo.new_cache("sliding_window", batch_size=B, max_len=PREFILL + 50000,
                          num_kv_heads=H, head_dim=D, **params)  # fmt: skip
    zoo.attention(x, x, x, cache=cache, variant="sliding_window", causal=True, **params)
    return cache


cache, own = filled(), filled()  # the zoo's steps, the steps by hand (each its own cache)
q, k, v = (torch.randn(B, H, 1, D) for _ in range(3))
keys, values, slot_pos, lengths = own.keys, own.values, own.slot_pos, own._lengths
slots = keys.shape[2]
state = {"position": PREFILL}
sdpa = torch.nn.functional.scaled_dot_product_attention


def by_hand():
    position = state["position"]
    slot = position % slots
    keys[:, :, slot].copy_(k[:, :, 0])
    values[:, :, slot].copy_(v[:, :, 0])
    slot_pos[:, slot] = position
    lengths.add_(1)
    state["position"] = position + 1
    return sdpa(q, keys, values, scale=D**-0.5)


def zoo_step():
    return zoo.attention(q, k, v, cache=cache, variant="sliding_window", causal=True, **params)


for name, step in (
    ("by hand", by_hand),
    ("zoo", zoo_step),
    ("sdpa alone", lambda: sdpa(q, keys, values)),
):
    best = min(timeit.repeat(step, number=2000, repeat=5)) / 2000
    print(f"{name:10s} {best * 1e6:6.1f} us")
