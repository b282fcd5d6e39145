"""The memory-efficient kernel's ops answered by shape alone (zeros of the right shapes, no
work): the CUDA wrapping of the runs by key block (``zoo.backends.lse_kernel.cuda_kernel``) run
on a CPU with its kernels taken out, so that what is left is the host work around them; and
``OperationCount``, the operations it dispatches (``python -m eval bench-overhead``, a test that
they do not grow with the runs), and ``uncounted``, a function a GPU compiles (``zoo.core.fused``)
taken out of the count."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


class OperationCount(TorchDispatchMode):
    """Counts the operations dispatched under it, views included: on a GPU each is host work."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def uncounted(fused) -> Callable:
    """A ``zoo.core.fused`` function run outside any counting mode: what its compiled graph
    replaces on a GPU (one graph, not its operations). It stands in for the function, ``fn``
    too, so that a caller that takes ``fused.fn`` (eager by choice) is not counted either."""

    def run(*args):
        with _disable_current_modes():
            return fused.fn(*args)

    run.fn = run
    return run


class ShapeOnlyEfficientOps:
    """``zoo.backends.lse_kernel._EfficientOps``' four ops, by shape only."""

    def forward(self, q, k, v, bias, compute_lse, dropout_p, causal, *, scale):
        B, H, M, _ = q.shape
        return q.new_zeros(B, H, M, v.shape[-1]), q.new_zeros(B, H, -(-M // 32) * 32), None, None

    def backward(self, g, q, k, v, bias, out, lse, seed, offset, p, mask, causal, *, scale):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    def varlen_forward(self, q, k, v, bias, cu_q, cu_k, max_q, max_k, p, kind, lse, *, scale):
        runs = cu_q.shape[0] - 1
        lse = q.new_zeros(runs, q.shape[2], -(-max_q // 32) * 32)
        return q.new_zeros(*q.shape[:3], v.shape[-1]), lse, None, None, max_q, max_k

    def varlen_backward(
        self, g, q, k, v, bias, out, cu_q, cu_k, mq, mk, lse, p, s, o, t, b, *, scale
    ):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None
