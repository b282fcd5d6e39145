"""MoBA on flex: the operations one forward call dispatches eagerly, and those left around the
bookkeeping that a GPU runs as compiled graphs (``zoo.core.fused``: the block sums,
``block_sums._sums``; the choice, ``moba._choose``; the gathered rows,
``flex_chosen._row_layout``; their merge, ``flex_chosen._merge_pairs``), with the calls that the
choice's and the rows' compiled graphs make (Inductor's code for a CPU: fused loops, sorts,
cumsums, scatters; a GPU's Triton code fuses alike, its count is not measured here). B=1, H=16,
D=64, float32, MoBA blocks of 512, top 3, flex blocks of 128, the kernel stubbed; the forward of
a call alone, and of one that records gradients (its block mask carries the transposed lists).

    OMP_NUM_THREADS=2 python eval/results/moba-gathered-cpu/fused_ops.py [N ...]
"""

import re
import sys
from contextlib import ExitStack
from dataclasses import replace
from unittest import mock

import torch
from torch._inductor.utils import run_and_get_code

import zoo
from zoo.backends import flex as flex_module
from zoo.backends import flex_chosen
from zoo.backends.flex import FlexBackend
from zoo.core.prepare import prepare_call
from zoo.decoding import block_sums as sums_module
from zoo.patterns import moba
from zoo.testing.shape_only_kernels import OperationCount, uncounted

VIEWS = re.compile(r"aten\.(view|unsqueeze|expand|alias|transpose|select|slice|detach)\.")


FUSED = (
    (sums_module, "_sums"),
    (moba, "_choose"),
    (flex_chosen, "_row_layout"),
    (flex_chosen, "_merge_pairs"),
)


def stub(compiled, least, q, k, v, lse=False, **kwargs):
    """The kernel by shape only: zeros, and a log-sum-exp where one is asked for."""
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    return (out, q.new_zeros(q.shape[:-1])) if lse else out


class Named(OperationCount):
    """Counts, and counts the views apart (no kernel on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.views += bool(VIEWS.match(str(func)))
        return super().__torch_dispatch__(func, types, args, kwargs)


def compiled_calls(fn, *args) -> int:
    """The kernel and library calls in Inductor's code for ``fn`` (a CPU's)."""
    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(fn, dynamic=None), *args)
    body = "\n".join(codes)
    body = body[body.index("def call(") :]
    calls = r"^\s+(?:\w+ = )?(?:cpp_fused_\w+|extern_kernels\.\w+|(?:torch\.ops\.)?aten\.\w+)"
    return len(re.findall(calls, body, re.M))


class _Recording(FlexBackend):
    """flex taking a call that records gradients on a CPU (the kernel is stubbed): the forward
    of a training step, whose block mask carries the transposed block lists backward reads."""

    capabilities = replace(FlexBackend.capabilities, backward=("cpu", "cuda"))


def cell(n: int, causal: bool) -> str:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, n, 64, generator=g) for _ in range(3))
    kw = dict(variant="moba", causal=causal, block_size=512, top_k=3)
    counts = []
    with mock.patch.object(flex_module, "run_kernel", stub):
        for fuse, grad in ((False, False), (True, False), (False, True), (True, True)):
            flex = (_Recording if grad else FlexBackend)(block_size=128, compile=False)
            inputs = [x.detach().requires_grad_(grad) for x in (q, k, v)]
            zoo.attention(*inputs, backend=flex, **kw)
            with ExitStack() as stack:
                if fuse:  # the functions a GPU compiles, outside the count
                    for module, name in FUSED:
                        fused = getattr(module, name)
                        stack.enter_context(mock.patch.object(module, name, uncounted(fused)))
                counted = stack.enter_context(Named())
                zoo.attention(*inputs, backend=flex, **kw)
            counts.append(counted)
    call = prepare_call(q, k, v, **kw)
    chosen, fixed = flex_chosen.chosen_parts(call.pattern)
    layout = (chosen.picks, flex_chosen.kept_keys(call, 128), fixed, chosen.blocks,
              chosen.block_size, call.kv_len, int(chosen.offset), 128)  # fmt: skip
    rows = [compiled_calls(flex_chosen._row_layout.fn, *layout, t) for t in (False, True)]
    totals, sums = moba.block_sums(k, torch.ones(1, n, dtype=torch.bool), 512)
    choice = compiled_calls(moba._choose.fn, q, totals, sums, 0, 512, causal, 3)
    cells = " | ".join(f"{c.count} ({c.views} views)" for c in counts)
    kind = "causal" if causal else "bidirectional"
    return f"| {n} | {kind} | {cells} | {choice} | {rows[0]} / {rows[1]} |"


if __name__ == "__main__":
    lengths = [int(x) for x in sys.argv[1:]] or [16384, 65536]
    print(
        "| n | | eager: ops a call | fused: ops around the graphs | eager, recording gradients "
        "| fused, recording gradients | choice graph: calls | rows graph: calls (forward / "
        "recording gradients) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in lengths:
        for causal in (False, True):
            print(cell(n, causal), flush=True)
