"""How much of the blocked backend's CPU time is ATen's attention kernel, and the sparsity
realization it would reach if nothing else cost anything: the ceiling the kernel sets.

    python -m eval.bench.kernel_ceiling [n] > eval/results/kernel-ceiling-cpu.md

Variants, parameters and shapes are those of ``eval/configs/bench_cpu.yaml`` (#18's sweep) at one
length (8192 by default), causal and not, forward and forward+backward, float32. Per cell: the
median wall time of at least 5 runs (more while they took under 0.5 s); the kernel time, the
median over 3 profiled runs of the time in the CPU FlashAttention ops (forward and backward)
and in the matrix products that small pieces run instead (``lse_merge.SMALL_KEYS``), with what
they call themselves: the backward kernel allocates and zero-fills the gradients it returns, a
cost no caller avoids (before, counting self time only, dilated's forward+backward kernel took
18.7 ms, its ceiling 0.51; with those fills 25 ms); the realization, (dense time / time) / (all
pairs / allowed pairs); and the ceiling, the same with the kernel time in place of the time.
Where the ceiling is below a goal, no plan that runs the same tiles through the same kernel
meets it. The backward pass is timed as the sweep times it (``torch.autograd.grad`` with a
fixed output gradient, so no gradient accumulates into the inputs' ``.grad``).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from functools import partial

import torch
import yaml
from torch.nn.functional import scaled_dot_product_attention
from torch.profiler import profile

import zoo
from eval.bench.measure import time_runs
from eval.bench.report import all_pairs
from eval.bench.sweep import allowed_pairs_for

KERNEL_OPS = ("flash_attention_for_cpu", "aten::bmm", "aten::mm")


def _run(fn: Callable[[], torch.Tensor], backward: bool, inputs: list[torch.Tensor]) -> None:
    """One run; with the backward pass, the gradients of ``inputs`` for an all-ones output
    gradient, as ``out.sum()`` would give, but returned, not accumulated into ``.grad``."""
    if backward:
        out = fn()
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    else:
        with torch.no_grad():
            fn()


def measure(
    fn: Callable[[], torch.Tensor], backward: bool, inputs: list[torch.Tensor]
) -> tuple[float, float]:
    """(median wall ms of at least 5 runs, more while they took under half a second, as the
    CPU sweep times them; median kernel ms of 3 profiled runs) after one warm-up."""
    run = partial(_run, fn, backward, inputs)
    walls = time_runs(run, torch.device("cpu"), 1, 5, None, 500.0)
    kernels = []
    for _ in range(3):
        with profile() as prof:
            run()
        events = prof.key_averages()  # a kernel op's total includes the fills it calls
        kernels.append(sum(e.cpu_time_total for e in events if _is_kernel(e.key)) / 1e3)
    return statistics.median(walls), statistics.median(kernels)


def _is_kernel(name: str) -> bool:
    return any(op in name for op in KERNEL_OPS)


def main(n: int = 8192) -> None:
    with open("eval/configs/bench_cpu.yaml") as f:
        config = yaml.safe_load(f)
    heads, head_dim = config["heads"], config["head_dim"]
    torch.manual_seed(0)
    qkv = [torch.randn(1, heads, n, head_dim, requires_grad=True) for _ in range(3)]
    q, k, v = qkv
    print(f"# Kernel ceiling of the blocked backend: n = {n}, B = 1, H = {heads}, D = {head_dim}")
    command = f"python -m eval.bench.kernel_ceiling {n}"
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; `{command}`")
    print("\n| variant | causal | pass | time ms | kernel ms | realization | kernel ceiling |")
    print("|---|---|---|---|---|---|---|")
    for causal in (False, True):
        for backward in (False, True):
            step = "fwd+bwd" if backward else "fwd"
            dense, dense_kernel = measure(
                partial(scaled_dot_product_attention, q, k, v, is_causal=causal), backward, qkv
            )
            print(f"| dense SDPA | {causal} | {step} | {dense:.1f} | {dense_kernel:.1f} | | |")
            for variant in config["variants"]:
                params = config["params"].get(variant, {})
                ideal = all_pairs(n, causal) / allowed_pairs_for(variant, params, causal, n)
                call = partial(
                    zoo.attention, q, k, v, variant=variant, backend="blocked", causal=causal,
                    **params,
                )  # fmt: skip
                wall, kernel = measure(call, backward, qkv)
                print(
                    f"| {variant} | {causal} | {step} | {wall:.1f} | {kernel:.1f} "
                    f"| {dense / wall / ideal:.2f} | {dense / kernel / ideal:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
