"""Bookkeeping made of many small tensor operations, compiled into one graph on a GPU.

Some calls compute their layout from their inputs before the kernel runs: MoBA chooses key blocks
per query and gathers the (query, chosen block) rows (``zoo.patterns.moba``,
``zoo.backends.flex_chosen``). Eagerly each of their operations is a dispatch and, on a GPU, a
kernel launch: MoBA's forward dispatched about 190 around its one attention kernel, so its time on
a GPU was mostly the host's. ``fused(fn)`` runs such a function compiled instead (a few fused
kernels, one guard check), where that pays and can run:

- on a GPU only: on a CPU the operations compute on the cores that dispatch them, and a first call
  per shape would compile for seconds;
- not inside a graph that torch.compile traces (the caller's graph takes the operations in);
- not on fake or meta tensors (shapes only: nothing to run).

Automatic dynamic shapes: the first length compiles a static graph, the second one of symbolic
sizes that serves every later length. The function must be pure tensor code of its arguments
(tensors, ints, bools, patterns), and must not read values on the host.

Where the compiled graph fails (a torch whose compiler cannot lower an operation on this GPU),
the function runs eagerly from then on, with one warning that names it and the error: the eager
run computes the same values, and raises itself where the inputs are at fault.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .device_build import has_no_data


def fuses(t: Tensor) -> bool:
    """Whether a fused function given ``t`` runs compiled: real CUDA data, outside a trace."""
    return t.device.type == "cuda" and not torch.compiler.is_compiling() and not has_no_data(t)


class Fused:
    """``fn``, compiled where ``fuses`` its first argument (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.failed: str | None = None  # the compiled graph's error, once it failed

    @functools.cached_property
    def compiled(self) -> Callable[..., Any]:
        """``fn`` under torch.compile (automatic dynamic shapes); built on first use."""
        return torch.compile(self.fn, dynamic=None)

    def __call__(self, *args: Any) -> Any:
        if self.failed is not None or not fuses(args[0]):
            return self.fn(*args)
        try:
            return self.compiled(*args)
        except Exception as error:  # the eager run below raises where the inputs are at fault
            self.failed = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"zoo: compiling {self.fn.__module__}.{self.fn.__qualname__} failed; it runs "
                f"eagerly from now on (same values, more host time): {self.failed}",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.fn(*args)


def fused(fn: Callable[..., Any]) -> Fused:
    """``fn`` compiled into one graph on a GPU (see the module docstring)."""
    return Fused(fn)
