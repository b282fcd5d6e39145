"""How much of the blocked backend's CPU time is ATen's attention kernel, and the sparsity
realization it would reach if nothing else cost anything: the ceiling the kernel sets.

    python -m eval.bench.kernel_ceiling [n] > eval/results/kernel-ceiling-cpu.md

Variants, parameters and shapes are those of ``eval/configs/bench_cpu.yaml`` (#18's sweep) at one
length (8192 by default), causal and not, forward and forward+backward, float32. Per cell: the
median wall time of at least 5 runs (more while they took under 0.5 s); the kernel time, the
median over 3 profiled runs of the self time of the CPU FlashAttention ops (forward and
backward) and of the matrix products that small pieces run instead (``lse_merge.SMALL_KEYS``);
the realization, (dense time / time) / (all pairs /
allowed pairs); and the ceiling, the same with the kernel time in place of the time. Where the
ceiling is below a goal, no plan that runs the same tiles through the same kernel meets it.
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


def _run(fn: Callable[[], torch.Tensor], backward: bool) -> None:
    if backward:
        fn().sum().backward()
    else:
        with torch.no_grad():
            fn()


def measure(fn: Callable[[], torch.Tensor], backward: bool) -> tuple[float, float]:
    """(median wall ms of at least 5 runs, more while they took under half a second, as the
    CPU sweep times them; median kernel ms of 3 profiled runs) after one warm-up."""
    walls = time_runs(lambda: _run(fn, backward), torch.device("cpu"), 1, 5, None, 500.0)
    kernels = []
    for _ in range(3):
        with profile() as prof:
            _run(fn, backward)
        events = prof.key_averages()
        kernels.append(sum(e.self_cpu_time_total for e in events if _is_kernel(e.key)) / 1e3)
    return statistics.median(walls), statistics.median(kernels)


def _is_kernel(name: str) -> bool:
    return any(op in name for op in KERNEL_OPS)


def main(n: int = 8192) -> None:
    with open("eval/configs/bench_cpu.yaml") as f:
        config = yaml.safe_load(f)
    heads, head_dim = config["heads"], config["head_dim"]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, head_dim, requires_grad=True) for _ in range(3))
    print(f"# Kernel ceiling of the blocked backend: n = {n}, B = 1, H = {heads}, D = {head_dim}")
    command = f"python -m eval.bench.kernel_ceiling {n}"
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads; `{command}`")
    print("\n| variant | causal | pass | time ms | kernel ms | realization | kernel ceiling |")
    print("|---|---|---|---|---|---|---|")
    for causal in (False, True):
        for backward in (False, True):
            step = "fwd+bwd" if backward else "fwd"
            dense, dense_kernel = measure(
                partial(scaled_dot_product_attention, q, k, v, is_causal=causal), backward
            )
            print(f"| dense SDPA | {causal} | {step} | {dense:.1f} | {dense_kernel:.1f} | | |")
            for variant in config["variants"]:
                params = config["params"].get(variant, {})
                ideal = all_pairs(n, causal) / allowed_pairs_for(variant, params, causal, n)
                call = partial(
                    zoo.attention, q, k, v, variant=variant, backend="blocked", causal=causal,
                    **params,
                )  # fmt: skip
                wall, kernel = measure(call, backward)
                print(
                    f"| {variant} | {causal} | {step} | {wall:.1f} | {kernel:.1f} "
                    f"| {dense / wall / ideal:.2f} | {dense / kernel / ideal:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
