"""flex's FULL and PARTIAL blocks (blocks of 128, per sequence and head) of each registry variant
under causal rules, and the time of ``zoo.allowed_pairs`` at the benchmark's longest length, as
the layouts are now and, with ``--as-before``, with two rules of the layouts as they were before
2026-11-29 patched back in: a ``Difference`` (a part of a union in its own token order) never
FULL, and a composition's PARTIAL blocks not asked again on squares of 16. No kernel runs.

    OMP_NUM_THREADS=1 python eval/results/layout-exactness-cpu/counts.py [--as-before]
"""

import sys
import time
from pathlib import Path

import torch
import yaml

import zoo
from zoo.backends import FlexBackend
from zoo.core.prepare import prepare_call
from zoo.functional import resolve_pattern
from zoo.patterns import EMPTY, FULL, PARTIAL
from zoo.patterns.compose import Difference, Intersection, Union

VARIANTS = ["axial_2d", "neighborhood_2d", "bigbird", "longformer", "strided", "local"]
LENGTHS = [16384, 65536]
COUNTED_AT = 131072  # eval/configs/bench.yaml's params, causal


def as_before() -> None:
    def clamped(self, q, k):
        kept = torch.clamp(self.include.block_state(q, k), max=PARTIAL)
        return torch.where(self.exclude.block_state(q, k) == FULL, EMPTY, kept).to(torch.int8)

    Difference.block_state = clamped
    for composition in (Union, Intersection, Difference):
        composition.exact_states = True


def main() -> None:
    before = "--as-before" in sys.argv
    if before:
        as_before()
    torch.set_num_threads(1)
    print(f"layouts {'as before' if before else 'now'}; torch {torch.__version__}")
    print("| variant | tokens | FULL | PARTIAL |")
    print("|---|---|---|---|")
    for variant in VARIANTS:
        for n in LENGTHS:
            q = torch.randn(1, 1, n, 16)
            call = prepare_call(q, q, q, variant=variant, causal=True)
            full, partial, _ = FlexBackend(compile=False).block_counts(call)
            print(f"| {variant} | {n} | {full:g} | {partial:g} |", flush=True)
    params = yaml.safe_load(Path("eval/configs/bench.yaml").read_text())["params"]
    print(f"\n| variant | allowed pairs at {COUNTED_AT} | seconds |")
    print("|---|---|---|")
    for variant in VARIANTS:
        pattern = resolve_pattern(variant, True, dict(params.get(variant, {})))
        start = time.perf_counter()
        pairs = zoo.allowed_pairs(pattern, COUNTED_AT, COUNTED_AT)
        print(f"| {variant} | {pairs} | {time.perf_counter() - start:.2f} |", flush=True)


if __name__ == "__main__":
    main()
