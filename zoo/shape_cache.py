"""Structures built once per shape, outside the graph that ``torch.compile`` traces.

Specialised patterns, frames, block layouts, blocked plans, flex block masks and dense masks
depend on a pattern and the lengths, never on the data. ``@per_shape`` caches such a builder by
its arguments, like ``functools.lru_cache``; under ``torch.compile`` it also keeps the builder
out of the traced graph. Dynamo traces through an ``lru_cache`` (a cache hit still traces the
builder, with its ``nonzero``, ``.item()`` and ``torch.Generator`` graph breaks); here the builder
runs at trace time as plain Python (``torch.compiler.assume_constant_result``), and its result is
stored under a name that the traced code reads as a global. Its tensors enter the graph as
inputs, its ints as constants, and it can be handed to the next builder (a frame to a layout).

Arguments of a builder are Python constants (ints, strings, tuples of them, devices, dtypes) and
objects that exist outside the traced region: ones another builder returned, or a module's
pattern. A pattern created inside the traced region cannot be one (dynamo has not built it yet
when the builder runs), so the call path makes patterns with a builder too.

Lengths are specialised: a builder's int arguments are read with ``operator.index``, which
turns a symbolic length (``dynamic=True``, or dynamo's automatic dynamic shapes after a second
length) into a guard on its value. A compiled model therefore keeps one graph per sequence length
whose pattern needs a structure (the policy stated in ``zoo.attention``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


class _Built:
    """The results of builders that a traced graph uses, each an attribute by name."""


_BUILT = _Built()
_CLEARS: list[Callable[[], None]] = []  # the cache_clear of every builder


def _index(arg: object) -> object:
    # A symbolic length becomes a concrete one here (dynamo guards on its value).
    return operator.index(arg) if isinstance(arg, int) and not isinstance(arg, bool) else arg


def per_shape(maxsize: int) -> Callable[[F], F]:
    """Cache a builder of per-shape structures by its (positional, hashable) arguments, and run
    it outside the graph under ``torch.compile`` (see the module docstring). The wrapper has the
    ``cache_clear`` of an ``lru_cache``, which also forgets the results that graphs named."""

    def decorate(builder: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(builder)
        names: set[str] = set()

        @torch.compiler.assume_constant_result
        def build_outside(*args: object) -> str:
            result = cached(*args)
            name = f"{builder.__module__}.{builder.__qualname__}.{id(result)}".replace(".", "_")
            setattr(_BUILT, name, result)
            names.add(name)
            return name

        @functools.wraps(builder)
        def lookup(*args: object) -> Any:
            if not torch.compiler.is_compiling():
                return cached(*args)
            return getattr(_BUILT, build_outside(*(_index(a) for a in args)))

        def cache_clear() -> None:
            cached.cache_clear()
            for name in names:
                delattr(_BUILT, name)
            names.clear()

        _CLEARS.append(cache_clear)
        lookup.cache_clear = cache_clear  # type: ignore[attr-defined]
        lookup.cache_info = cached.cache_info  # type: ignore[attr-defined]
        return lookup  # type: ignore[return-value]

    return decorate


def clear_all() -> None:
    """Forget the results of every ``@per_shape`` builder (graphs that used them recompile)."""
    for clear in _CLEARS:
        clear()
