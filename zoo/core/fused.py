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
- not under a ``TorchDispatchMode`` (a FLOP counter, a memory tracker, the zoo's tagged tensors):
  dynamo skips a function first called under one, for the rest of the process;
- not on fake or meta tensors (shapes only: nothing to run).

Automatic dynamic shapes: the first length compiles a static graph, the second one of symbolic
sizes that serves every later length (``fused(dynamic=True)``: symbolic from the first); other
kinds of call (a decoding step, another batch size, autocast) add a graph each, and dynamo's
limit of graphs per function is raised so that none falls back to eager unseen. The function
must be pure tensor code of its arguments (tensors, ints, bools, patterns), and must not read
values on the host. Its values are those of the eager function up to float rounding (a compiled
division or sum may round differently in the last bit).

A function whose one expression suits a compiler but not eager execution (an intermediate as
large as the inputs, which a compiled graph fuses away) names its eager twin (``fused(eager=...)``).

Where the compiled graph fails and the eager function does not (a torch whose compiler cannot
lower an operation on this GPU; the backward too, compiled with the forward where an argument
records gradients), the calls of that kind run eagerly from then on, with one warning that names
the function, the kind and the error. A kind (``call_kind``) is the classes of the arguments that
are neither tensors nor numbers, a composed pattern's members included: a pattern that dynamo
cannot trace takes a decoding step's mask eager for that pattern, not for every pattern in the
process. Where the eager function fails too, the inputs are at fault: its error is raised and the
compiled graph is kept. Running out of memory is raised as it is.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .device_build import has_no_data

# Graphs dynamo keeps per function before it runs the function eagerly, silently: each pattern
# (a mask_mod's code), head layout or kind of call is a graph of its own (dynamo's default: 8).
RECOMPILE_LIMIT = 256


def raise_recompile_limit() -> None:
    """Dynamo's graphs per function raised to at least ``RECOMPILE_LIMIT``."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):  # the newer name, and the older one
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), RECOMPILE_LIMIT))


def compiles_here(t: Tensor) -> bool:
    """Whether a call given ``t`` may run a compiled graph of its own: outside a trace, outside
    any dispatch mode, on real data."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not has_no_data(t)
    )


def fuses(t: Tensor) -> bool:
    """Whether a fused function given ``t`` runs compiled: CUDA data where ``compiles_here``."""
    return t.device.type == "cuda" and compiles_here(t)


class Fused:
    """``fn``, compiled where ``fuses`` its first argument, else ``eager`` (see the module
    docstring)."""

    def __init__(
        self, fn: Callable[..., Any], eager: Callable[..., Any] | None = None,
        dynamic: bool | None = None,
    ) -> None:  # fmt: skip
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.eager = fn if eager is None else eager
        self.dynamic = dynamic
        # the compiled graph's error per kind of call (``call_kind``), where it failed alone
        self.failures: dict[tuple, str] = {}

    @functools.cached_property
    def compiled(self) -> Callable[..., Any]:
        """``fn`` under torch.compile (automatic dynamic shapes, or ``dynamic``); built on first
        use."""
        raise_recompile_limit()
        return torch.compile(self.fn, dynamic=self.dynamic)

    @property
    def failed(self) -> str | None:
        """The compiled graph's errors, one per kind of call that failed, or None."""
        return "; ".join(self.failures.values()) or None

    def __call__(self, *args: Any) -> Any:
        if not fuses(args[0]):
            return self.eager(*args)
        kind = call_kind(args) if self.failures else None
        if kind in self.failures:
            return self.eager(*args)
        try:
            with _backward_lowered_now(args):
                return self.compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            out = self.eager(*args)  # raises where the inputs are at fault: the graph is kept
            kind = call_kind(args)
            self.failures[kind] = f"{type(error).__name__}: {error}"
            warnings.warn(
                f"zoo: compiling {self.fn.__module__}.{self.fn.__qualname__} failed; its calls "
                f"of this kind ({describe_kind(kind)}) run eagerly from now on (more host "
                f"time): {self.failures[kind]}",
                RuntimeWarning,
                stacklevel=2,
            )
            return out


def call_kind(args: tuple) -> tuple:
    """The kind of a call, as far as failures go: the class of each argument that is neither a
    tensor nor a number, a composed pattern's members' classes with it (``children``, or a
    difference's ``include`` and ``exclude``): a pattern's code is what a graph most often fails
    on. Calls that trace differently for other reasons (another dtype, an int for a tensor)
    share a kind, and a failure sends them eager together, as before kinds; a failure of every
    kind (a compiler that cannot run at all) warns once per kind."""
    return tuple(_kind(a) for a in args if not isinstance(a, (Tensor, int, float, bool)))


def _kind(a: Any) -> tuple:
    members = getattr(a, "children", None)
    if members is None and hasattr(a, "include") and hasattr(a, "exclude"):
        members = (a.include, a.exclude)
    if not isinstance(members, (tuple, list)):
        members = ()
    return (type(a).__qualname__, *(_kind(m) for m in members))


def describe_kind(kind: tuple) -> str:
    """``call_kind`` in words: Union(Local, Global)."""

    def one(k: tuple) -> str:
        return k[0] + (f"({', '.join(one(m) for m in k[1:])})" if len(k) > 1 else "")

    return ", ".join(one(k) for k in kind) or "tensors and numbers only"


def _backward_lowered_now(args: tuple) -> contextlib.AbstractContextManager:
    """Where an argument records gradients, the compiled graph's backward compiled with its
    forward, so that a backward that fails to lower fails here, in ``Fused``'s reach (AOTAutograd
    compiles it at the first ``.backward()`` otherwise, where the failure would be raised from
    the caller's ``loss.backward()`` at every step). A torch without the setting lowers it
    lazily."""
    import torch._functorch.config as functorch_config

    records = torch.is_grad_enabled() and any(
        isinstance(a, Tensor) and a.requires_grad for a in args
    )
    if not records or not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return contextlib.nullcontext()
    return functorch_config.patch(force_non_lazy_backward_lowering=True)


def fused(
    fn: Callable[..., Any] | None = None, *, eager: Callable[..., Any] | None = None,
    dynamic: bool | None = None,
) -> Any:  # fmt: skip
    """``fn`` compiled into one graph on a GPU (see the module docstring), as ``@fused`` or
    ``@fused(...)``. ``eager``: the function's twin where it is not compiled, the same values in
    a form that suits eager execution (in chunks, where ``fn``'s one expression would hold an
    intermediate that a compiled graph never makes). ``dynamic=True`` for a function whose sizes
    change from call to call by design (a decoding step's slots in use): symbolic sizes from its
    first call, not a static graph then a recompile."""
    if fn is None:
        return lambda f: Fused(f, eager, dynamic)
    return Fused(fn, eager, dynamic)
