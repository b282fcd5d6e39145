"""Python function calls per call of compiled FlexAttention, after compiles at three lengths:
``python host_calls.py auto`` (automatic dynamic shapes: the third length runs the kernel of
symbolic lengths) or ``python host_calls.py static`` (``dynamic=False``: a static kernel per
length). Prints cProfile's count for 20 calls at the third length."""

import cProfile
import pstats
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

torch.set_num_threads(1)
kernel = torch.compile(flex_attention, dynamic=None if sys.argv[1] == "auto" else False)


def window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 64


for n in (256, 384, 512):
    q = torch.randn(1, 2, n, 32)
    mask = create_block_mask(window, None, None, n, n, device="cpu")
    kernel(q, q, q, block_mask=mask)
profiler = cProfile.Profile()
profiler.enable()
for _ in range(20):
    kernel(q, q, q, block_mask=mask)
profiler.disable()
pstats.Stats(profiler).print_stats(0)
