"""Dynamo's tracing time for one checkout of the zoo, in a fresh process: one MultiHeadAttention
forward (bigbird on flex, fullgraph) and bigbird's cached prefill and two decoding steps, each
under a CompileCounter backend (dynamo only, no Inductor). Prints the two times in seconds.

    OMP_NUM_THREADS=1 python trace_time.py CHECKOUT
"""

import sys
import time

sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]  # the checkout's zoo and its test helpers

import torch  # noqa: E402
from helpers import small_params  # noqa: E402
from torch._dynamo.testing import CompileCounter  # noqa: E402

import zoo  # noqa: E402

assert zoo.__file__.startswith(sys.argv[1]), zoo.__file__
torch.set_num_threads(1)


def traced(model, *calls, fullgraph=False):
    """Seconds to run ``calls`` (each a function of the compiled model) after a dynamo reset."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=CompileCounter(), fullgraph=fullgraph)
    start = time.perf_counter()
    with torch.no_grad():
        for call in calls:
            call(compiled)
    return time.perf_counter() - start


x = torch.randn(2, 64, 32)
traced(zoo.MultiHeadAttention(32, 2, variant="full", backend="sdpa"), lambda m: m(x))  # warm-up
layer = zoo.MultiHeadAttention(32, 2, variant="bigbird", backend="flex", **small_params("bigbird"))
forward = traced(layer, lambda m: m(x), fullgraph=True)

attn = zoo.create_attention(
    "bigbird", dim=32, num_heads=4, num_kv_heads=2, causal=True, block_size=8, random_blocks=1
).eval()
xs, cache = torch.randn(2, 40, 32), attn.new_cache(2, 64)
prefill = lambda m: m(xs[:, :10], cache=cache, valid_lens=torch.tensor([10, 7]))  # noqa: E731
steps = [lambda m, i=i: m(xs[:, i : i + 1], cache=cache) for i in (10, 11)]
decode = traced(attn, prefill, *steps)
print(f"{forward:.3f} {decode:.3f}")
