"""``python -m eval.bench.lookup_mask [VARIANT] [N] [HEADS] [DEVICE]``: compiled FlexAttention's
forward on one block mask with the pattern's own mask_mod and with its table lookup
(``zoo.backends.flex_lookup``), timed in turns (defaults: bigbird, 8192 tokens, 4 heads of 64,
float32 on a CPU, bfloat16 on CUDA). Prints the medians and the largest difference of outputs."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from zoo.backends import clear_caches
from zoo.backends import flex as flex_backend
from zoo.backends.flex import FlexBackend
from zoo.backends.flex_kernel import _compiled_kernel
from zoo.core.prepare import prepare_call


def block_masks(variant: str, q, k, v) -> dict:
    """The backend's block mask of ``variant`` with each mask_mod."""
    masks, lookup = {}, flex_backend.lookup_mask_mod
    try:
        for name, builder in (("lookup", lookup), ("own", lambda *args: None)):
            flex_backend.lookup_mask_mod = builder
            clear_caches()
            masks[name] = FlexBackend().block_mask(prepare_call(q, k, v, variant=variant))
    finally:
        flex_backend.lookup_mask_mod = lookup
        clear_caches()
    return masks


def main(argv: list[str]) -> None:
    variant = argv[0] if argv else "bigbird"
    n, heads = (int(argv[1]) if len(argv) > 1 else 8192), (int(argv[2]) if len(argv) > 2 else 4)
    device = torch.device(argv[3] if len(argv) > 3 else "cpu")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, 64, device=device, dtype=dtype) for _ in range(3))
    masks = block_masks(variant, q, k, v)
    kernel = _compiled_kernel(device.type != "cpu")
    times: dict[str, list[float]] = {name: [] for name in masks}
    with torch.no_grad():
        outs = {name: kernel(q, k, v, block_mask=m) for name, m in masks.items()}  # compiled
        for turn in range(9):
            order = list(masks.items())
            for name, mask in order if turn % 2 == 0 else order[::-1]:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                kernel(q, k, v, block_mask=mask)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) * 1e3)
    diff = (outs["lookup"].float() - outs["own"].float()).abs().max().item()
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"{variant}, n={n}, heads={heads}, D=64, {dtype}, {device}: largest difference {diff:.3g}"
    )
    for name, median in medians.items():
        print(f"  {name:6s} median {median:.3f} ms  ({', '.join(f'{t:.3g}' for t in times[name])})")
    print(f"  own / lookup: {medians['own'] / medians['lookup']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
