"""Structures built once per shape, outside the graph that ``torch.compile`` traces.

Specialised patterns, frames, block layouts, blocked plans, flex block masks and dense masks
depend on a pattern and the lengths, never on the data. ``@per_shape`` caches such a builder by
its arguments; under ``torch.compile`` it also keeps the builder out of the traced graph. Dynamo
traces through an ``lru_cache`` (a cache hit still traces the builder, with its ``nonzero``,
``.item()`` and ``torch.Generator`` graph breaks); here the builder runs at trace time as plain
Python (``torch.compiler.assume_constant_result``), and its result is stored under a name that
the traced code reads as a global. Its tensors enter the graph as inputs, its ints as constants,
and it can be handed to the next builder (a frame to a layout).

A builder always runs with every tracing and fake mode switched off (``torch.export``'s
non-strict tracing, a user's ``FakeTensorMode``): its result is kept for later calls, so its
tensors must be real. A traced program sees them as constants. The one exception is a call on
a device that holds no data in this process (fake CUDA tensors on a machine without a GPU, meta
tensors): there the builder runs on the CPU with its tensors tagged with that device, its result
is mirrored onto the device under the caller's mode and nothing is cached
(``zoo.core.device_build``).

The caches are bounded, least recently used first, by count per builder and by bytes over all
builders: a training run over many lengths keeps the structures of its recent lengths, not of
every length it has seen. ``set_limits`` changes the byte bound (it starts from the environment
variable ``ZOO_SHAPE_CACHE_MB``, default 256). The entries of the current call (``new_call``,
which ``zoo.attention`` makes) are never evicted, so a call whose structures exceed the bound
still finds them on its next call instead of rebuilding every time; nor are those a compiled
graph reads, which would recompile it. Dropping an entry never changes a result, only the time
of the next call at that shape.

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

import contextlib
import ctypes
import functools
import itertools
import operator
import os
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import call_plans
from .device_build import device_build, needs_device_build

F = TypeVar("F", bound=Callable[..., Any])


class _Built:
    """The results of builders that a traced graph uses, each an attribute by name."""


@dataclass
class _Entry:
    result: Any
    nbytes: int
    call: int  # the last call (``new_call``) that used it
    name: str | None = None  # the attribute of _BUILT that traced graphs read


_BUILT = _Built()
_LOCK = threading.RLock()
# Every builder's entries, least recently used first: (builder's cache, key) -> entry.
_ENTRIES: OrderedDict[tuple[int, tuple], _Entry] = OrderedDict()
_CACHES: dict[int, _ShapeCache] = {}
_TOTAL = {"bytes": 0, "call": 0, "untrimmed": 0}
_NAMES = itertools.count()  # entry names: an id() could be reused by a later entry


def _bound_from_environment() -> int:
    text = os.environ.get("ZOO_SHAPE_CACHE_MB", "256")
    try:
        megabytes = float(text)
    except ValueError:
        megabytes = -1.0
    if not megabytes >= 0:
        raise ValueError(
            f"ZOO_SHAPE_CACHE_MB must be a number of MiB >= 0 (the per-shape caches' bound), "
            f"got {text!r}"
        )
    return int(megabytes * 2**20)


_LIMITS = {"bytes": _bound_from_environment()}


class _ShapeCache:
    """One builder's entries: a count bound of its own, bytes counted with every builder's."""

    def __init__(self, builder: Callable[..., Any], maxsize: int) -> None:
        self.builder = builder
        self.maxsize = maxsize
        self.keys: OrderedDict[tuple, None] = OrderedDict()
        # builds on a device that holds no data are never entries: one name per arguments, its
        # result replaced by each trace's (held until ``clear``, not one per trace)
        self.transient_names: dict[tuple, str] = {}
        self.hits = self.misses = 0
        _CACHES[id(self)] = self

    def get(self, args: tuple) -> _Entry:
        if needs_device_build(args):  # fake CUDA on a CPU-only machine, meta: never cached
            return _Entry(device_build(self.builder, args), 0, _TOTAL["call"])
        with _LOCK:
            entry = _ENTRIES.get((id(self), args))
            if entry is not None:
                _ENTRIES.move_to_end((id(self), args))
                self.keys.move_to_end(args)
                self.hits += 1
                entry.call = _TOTAL["call"]
                return entry
        with _as_plain_python():
            result = self.builder(*args)
        with _LOCK:
            self.misses += 1
            built = _ENTRIES.get((id(self), args))
            if built is not None:  # another thread built it meanwhile: keep the first
                return built
            entry = _Entry(result, _nbytes(result), _TOTAL["call"])
            _ENTRIES[(id(self), args)] = entry
            self.keys[args] = None
            _TOTAL["bytes"] += entry.nbytes
            while len(self.keys) > self.maxsize:
                self.drop(next(iter(self.keys)))
            _evict()
        return entry

    def name(self, args: tuple) -> str:
        """The attribute of _BUILT under which a traced graph reads the result of ``args``."""
        entry = self.get(args)
        with _LOCK:
            if needs_device_build(args):  # fake or meta tensors (torch.export on a CPU)
                name = self.transient_names.get(args) or self._new_name()
                self.transient_names[args] = name
                setattr(_BUILT, name, entry.result)
                return name
            if entry.name is None:
                entry.name = self._new_name()
                setattr(_BUILT, entry.name, entry.result)
            if _ENTRIES.get((id(self), args)) is not entry:  # evicted meanwhile: build anew
                return self.name(args)
            return entry.name

    def _new_name(self) -> str:
        qualified = f"{self.builder.__module__}.{self.builder.__qualname__}"
        return f"{qualified}.{next(_NAMES)}".replace(".", "_")

    def drop(self, args: tuple) -> None:
        entry = _ENTRIES.pop((id(self), args))
        del self.keys[args]
        self._forget(entry)

    @staticmethod
    def _forget(entry: _Entry) -> None:
        _TOTAL["bytes"] -= entry.nbytes
        _TOTAL["untrimmed"] += entry.nbytes
        if entry.name is not None and hasattr(_BUILT, entry.name):
            delattr(_BUILT, entry.name)  # graphs that read it fail their guard and recompile

    def clear(self) -> None:
        with _LOCK:
            for args in list(self.keys):
                self.drop(args)
            for name in self.transient_names.values():
                if hasattr(_BUILT, name):
                    delattr(_BUILT, name)
            self.transient_names.clear()

    def info(self) -> functools._CacheInfo:
        return functools._CacheInfo(self.hits, self.misses, self.maxsize, len(self.keys))


def _evict() -> None:
    """Drop the least recently used entries while the bytes of all exceed the bound. Entries
    that the current call used stay (dropping them would rebuild them on every call at a shape
    whose structures exceed the bound), and so do those a compiled graph reads (dropping one
    recompiles that graph: their count bound and torch.compile's recompile limit bound them).
    Freed pages go back to the system right away, before the call's next builds reuse and
    fragment them (trimming once per call, or after dropping down to 3/4 of the bound, left
    more resident memory over many lengths; measured: eval/results/shape-cache-memory-cpu.md,
    eval/results/design-notes-cpu.md#shape-cache-trim)."""
    for key in list(_ENTRIES):
        if _TOTAL["bytes"] <= _LIMITS["bytes"]:
            break
        entry = _ENTRIES[key]
        if entry.call == _TOTAL["call"]:
            break  # this entry and every later one belong to the current call
        if entry.name is None:
            _CACHES[key[0]].drop(key[1])
    if _TOTAL["untrimmed"] >= TRIM_BYTES:
        _TOTAL["untrimmed"] = 0
        _release_free_memory()


# Bytes freed since the last trim; a trim costs little against the calls between trims
# (measured: eval/results/design-notes-cpu.md#shape-cache-trim).
TRIM_BYTES = 1 << 20


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except Exception:  # no C library by that call (Windows), or no malloc_trim (musl, macOS)
        return None


def _release_free_memory() -> None:
    """glibc keeps freed CPU tensors of a few MB in its heap once it has freed a larger one (its
    mmap threshold rises), and structures of many shapes, each a different size, fragment it:
    resident memory grew after the bound was reached. ``malloc_trim`` returns the free pages."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def outside_graph(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``: under ``torch.compile``, ``fn`` runs as
    plain Python at trace time and its result (an int, str, bool or None) enters the graph as a
    constant. Set here without importing ``torch._dynamo``, which would double the time of
    ``import zoo``; the attribute is what that function sets (a test holds the two equal)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@contextlib.contextmanager
def _as_plain_python() -> Iterator[None]:
    """A builder's surroundings, whatever the caller's: no tracing or fake mode (its tensors are
    kept for later calls, so they must be real), no device context (``torch.device("meta")``),
    no autograd and no inference mode (its tensors feed later training calls)."""
    with (
        _disable_current_modes(),
        torch._C.DisableTorchFunction(),
        torch.inference_mode(False),
        torch.no_grad(),
    ):
        yield


@outside_graph
def new_call() -> bool:
    """Mark the start of a zoo call: the entries it uses are kept while it runs (``_evict``).
    Under torch.compile it runs at trace time (``outside_graph``); a compiled call builds
    nothing at run time."""
    with _LOCK:
        _TOTAL["call"] += 1
    return True


# What holds no tensors of a result's own (a module's parameters are its own: nn.Module is data)
_NOT_DATA = (
    type, torch.device, torch.dtype, types.FunctionType, types.MethodType,
    types.BuiltinFunctionType, types.ModuleType, functools.partial,
)  # fmt: skip


def _nbytes(result: object) -> int:
    """The bytes of the tensors a result holds (in containers, dataclasses and objects' fields,
    each storage once)."""
    seen: set[int] = set()
    storages: set[tuple[torch.device, int]] = set()
    total = 0
    stack = [result]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, int | float | str | bool):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (obj.device, storage.data_ptr())
            if key not in storages:
                storages.add(key)
                total += storage.nbytes()
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif not isinstance(obj, _NOT_DATA):
            stack.extend(getattr(obj, "__dict__", {}).values())
            stack.extend(getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ()))
    return total


def _index(arg: object) -> object:
    # A symbolic length becomes a concrete one here (dynamo guards on its value).
    if isinstance(arg, torch.SymInt) and torch.compiler.is_exporting():
        raise ValueError(
            f"torch.export with a dynamic size ({arg}) that a zoo structure depends on: the zoo "
            "builds its patterns, layouts and masks once per sequence length (the blocked "
            "backend also per batch size), so an exported zoo call has those sizes static; "
            "export once per length (no dynamic_shapes on the sequence dimension), or compile "
            "with torch.compile, which keeps one graph per length"
        )
    return concrete(arg)


def concrete(value: object) -> object:
    """A symbolic int, float or bool as its value (under ``torch.compile``, a guard on it: a call
    with another value recompiles); any other value as it is."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    if isinstance(value, torch.SymBool):
        return bool(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return operator.index(value)
    return value


def per_shape(maxsize: int) -> Callable[[F], F]:
    """Cache a builder of per-shape structures by its (positional, hashable) arguments, and run
    it outside the graph under ``torch.compile`` (see the module docstring). The wrapper has
    ``cache_clear`` and ``cache_info`` as an ``lru_cache`` has; ``cache_clear`` also forgets the
    results that graphs named."""

    def decorate(builder: F) -> F:
        cache = _ShapeCache(builder, maxsize)
        key = id(cache)

        @functools.wraps(builder)
        def lookup(*args: object) -> Any:
            if not torch.compiler.is_compiling():
                return cache.get(args).result
            return getattr(_BUILT, _built_name(key, *(_index(a) for a in args)))

        lookup.cache_clear = cache.clear  # type: ignore[attr-defined]
        lookup.cache_info = cache.info  # type: ignore[attr-defined]
        return lookup  # type: ignore[return-value]

    return decorate


@outside_graph
def _built_name(key: int, *args: object) -> str:
    """The name under which the traced code reads builder ``key``'s result for ``args``, built
    at trace time. One function for every builder, the builder named among its arguments: dynamo
    took the constant results of two builders' own closures, one code object called with equal
    arguments, for one (a block-local step's two tables, 2026-11-29)."""
    return _CACHES[key].name(args)


def set_limits(*, max_bytes: int | None = None) -> None:
    """Bound the bytes that every ``@per_shape`` builder's results hold together (least
    recently used first out; see the module docstring for what stays)."""
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        with _LOCK:
            _LIMITS["bytes"] = max_bytes
            _evict()


def stats() -> dict[str, int]:
    """The entries every builder holds now, their bytes, and the byte bound."""
    with _LOCK:
        return {"entries": len(_ENTRIES), "bytes": _TOTAL["bytes"], "max_bytes": _LIMITS["bytes"]}


def clear_all() -> None:
    """Forget the results of every ``@per_shape`` builder (graphs that used them recompile),
    and the call plans that hold some of them (``zoo.core.call_plans``)."""
    for cache in list(_CACHES.values()):
        cache.clear()
    call_plans.clear()
