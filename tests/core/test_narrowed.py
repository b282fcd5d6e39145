"""``zoo.core.narrowed``: a narrow that spans its dimension is the tensor itself, so its
backward makes no zero buffer of the tensor's size."""

from __future__ import annotations

import torch

from eval.bench.measure import cpu_peak_memory_mb
from zoo.core.narrowed import narrowed


def test_a_whole_span_is_the_tensor_and_a_part_is_a_view():
    x = torch.randn(3, 10, 4)
    assert narrowed(x, 1, 0, 10) is x
    part = narrowed(x, 1, 2, 5)
    assert part.shape == (3, 5, 4) and part.data_ptr() == x[:, 2].data_ptr()


def test_the_backward_of_a_whole_span_allocates_no_buffer_of_its_size():
    x = torch.randn(1 << 20, requires_grad=True)  # 4 MiB

    def peak(cut) -> float:
        x.grad = None
        return cpu_peak_memory_mb(lambda: cut(x * 2).sum().backward())

    whole = peak(lambda y: narrowed(y, 0, 0, y.shape[0]))
    sliced = peak(lambda y: y.narrow(0, 0, y.shape[0]))
    assert sliced - whole >= 3.9  # the narrow's zero buffer, 4 MiB
