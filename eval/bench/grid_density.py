"""Block density of the 2-D patterns in row-major and in tiled token order (``zoo.layout.tiles``).

    python -m eval.bench.grid_density > eval/results/grid_density.md

Density: computed key blocks / all block pairs of the layout, at the kernels' block sizes (64:
the blocked backend; 128: flex). No timing; it is a property of the layout alone.
"""

from __future__ import annotations

import torch

import zoo
from zoo.layout.block_layout import build_layout, specialized
from zoo.layout.frames import build_frame

CASES = [
    ("neighborhood_2d", {"kernel_size": 7}),
    ("neighborhood_2d", {"kernel_size": 7, "dilation": 2}),
    ("neighborhood_2d", {"kernel_size": 13}),
    ("axial_2d", {}),
    ("block_local_2d", {"window_size": 8}),
]


def rows(sides=(64, 128, 256), blocks=(64, 128)) -> list[str]:
    cpu = torch.device("cpu")
    out = []
    for name, params in CASES:
        for side in sides:
            n = side * side
            pattern = zoo.get_spec(name).build(grid=(side, side), **params)
            pattern = specialized(pattern, n, n, cpu)
            for block in blocks:
                row_major, tiled = (
                    build_layout(pattern, build_frame(order, n, n, block, block, cpu)).density()
                    for order in (1, pattern.stride)
                )
                given = ", ".join(f"{k}={v}" for k, v in params.items()) or "-"
                out.append(
                    f"| `{name}` | {given} | {side}x{side} | {block} | {row_major:.4f} | "
                    f"{tiled:.4f} | {row_major / tiled:.2f}x |"
                )
    return out


def main() -> None:
    print(__doc__.split("\n\n")[2].replace("\n", " ").strip())
    print("Command: `python -m eval.bench.grid_density`.\n")
    print("| variant | parameters | grid | block | row-major density | tiled density | ratio |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows()))


if __name__ == "__main__":
    main()
