"""Overlapping windows of keys, one per query block: the band of local and sliding-window
patterns read as a strided view of the keys, never copied (``block_plan``'s band source).

Row r of a band reads key slots start + r * block .. start + (r + width) * block - 1. Consecutive
rows overlap in width - 1 blocks, so the view costs nothing in the forward, and in the backward
each row's window gradient is added back into the keys' slots (``KeyWindows.add_grad``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class KeyWindows:
    """Row r reads key blocks of ``block`` slots, ``width`` of them, from slot start + r * block."""

    start: int
    width: int
    block: int

    def view(self, x: Tensor, rows: int, first: int = 0) -> Tensor:
        """(H, slots, D) -> (rows, H, width * block, D), the windows of rows first .. first + rows
        - 1 as a strided view of x."""
        span = x.narrow(1, self.start + first * self.block, (rows + self.width - 1) * self.block)
        windows = span.unflatten(1, (-1, self.block)).unfold(1, self.width, 1)  # (H, R, bk, D, W)
        return windows.permute(1, 0, 4, 2, 3).flatten(2, 3)  # (R, H, W * bk, D)

    def add_grad(self, grad_x: Tensor, grad: Tensor, first: int = 0) -> None:
        """Add the gradient (rows, H, width * block, D) of rows first .. of the view into the
        keys' gradient grad_x (H, slots, D), one strided slice of grad_x per window offset."""
        rows = grad.shape[0]
        per_offset = grad.unflatten(2, (self.width, self.block)).transpose(0, 1)  # (H,R,W,bk,D)
        for w in range(self.width):  # offset w of row r is block first + r + w of the keys
            start = self.start + (first + w) * self.block
            span = grad_x.narrow(1, start, rows * self.block).unflatten(1, (rows, self.block))
            span.add_(per_offset[:, :, w])  # in place through a view: no copy of the slice


def key_windows(x: Tensor, windows: KeyWindows, rows: int) -> Tensor:
    """``KeyWindows.view`` of x (H, slots, D) for ``rows`` rows, differentiable."""
    return _Windows.apply(x, windows, rows)


class _Windows(torch.autograd.Function):
    """The view with a backward that adds each window offset's gradient, one strided slice of x
    per offset, into a single buffer of x's size. Autograd through the view would run
    ``unfold_backward`` and then fill and copy a buffer per view in the chain (narrow, select),
    a large share of local's backward on a CPU next to the attention kernel's own
    (measured: eval/results/design-notes-cpu.md#key-windows-backward)."""

    @staticmethod
    def forward(ctx, x: Tensor, windows: KeyWindows, rows: int) -> Tensor:
        ctx.shape, ctx.windows = x.shape, windows
        return windows.view(x, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad_x = grad.new_zeros(ctx.shape)  # (H, slots, D)
        ctx.windows.add_grad(grad_x, grad)
        return grad_x, None, None
