"""MoBA on flex: the kernel blocks its block masks score and the operations one forward call
dispatches around the kernel, with the queries gathered by chosen key block
(zoo/backends/flex_chosen.py) and with the union of each query block's choices (the path before),
beside block_local at MoBA's density. B=1, H=16, D=64, float32, random inputs, flex blocks of
128, eager flex with its kernel stubbed (counting a call's operations needs no kernel; compiled
flex on a CPU returns no log-sum-exp, so the gathered path is eager there).

    OMP_NUM_THREADS=2 python eval/results/moba-gathered-cpu/blocks.py [N ...]
"""

import sys
from contextlib import nullcontext
from unittest import mock

import torch

import zoo
from zoo.backends import flex as flex_module
from zoo.backends.flex import FlexBackend
from zoo.core.prepare import prepare_call
from zoo.testing.shape_only_kernels import OperationCount


def stub(compiled, least, q, k, v, lse=False, **kwargs):
    """The kernel by shape only: zeros, and a log-sum-exp where one is asked for."""
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    return (out, q.new_zeros(q.shape[:-1])) if lse else out


def cell(n: int, variant: str, params: dict, causal: bool, union: bool) -> str:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, n, 64, generator=g) for _ in range(3))
    flex = FlexBackend(block_size=128, compile=False)
    kw = dict(variant=variant, causal=causal, **params)
    the_union = mock.patch.object(FlexBackend, "gathers", lambda self, call: False)
    with mock.patch.object(flex_module, "run_kernel", stub), the_union if union else nullcontext():
        call = prepare_call(q, k, v, **kw)
        path = "union" if union else ("gathered" if flex.gathers(call) else "fixed")
        full, partial, _ = flex.block_counts(call)
        zoo.attention(q, k, v, backend=flex, **kw)  # per-shape structures built
        with OperationCount() as counted:
            zoo.attention(q, k, v, backend=flex, **kw)
    scored = (full + partial) * 128 * 128
    return (
        f"| {variant} | {path} | {'causal' if causal else 'bidirectional'} | {n} | "
        f"{full:.0f} | {partial:.0f} | {scored / 2**20:.1f} M | {counted.count} |"
    )


if __name__ == "__main__":
    lengths = [int(x) for x in sys.argv[1:]] or [16384, 65536]
    print("| variant | path | | n | full blocks | partial blocks | scored pairs | ops |")
    print("|---|---|---|---|---|---|---|---|")
    moba, twin = {"block_size": 512, "top_k": 3}, {"block_size": 512, "neighbors": 1}
    for n in lengths:
        for causal in (False, True):
            print(cell(n, "moba", moba, causal, union=False), flush=True)
            print(cell(n, "moba", moba, causal, union=True), flush=True)
            print(cell(n, "block_local", twin, causal, union=False), flush=True)
