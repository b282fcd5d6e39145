"""Per-shape structures for a device that holds no data in this process.

A call can run on tensors that have a device but no data: fake CUDA tensors on a machine
without a GPU (``torch._subclasses.FakeTensorMode``, as ``torch.export`` of a CUDA model on a
CPU build machine makes them, and as the zoo's own tests run every CUDA path), or meta tensors.
The per-shape builders (``zoo.core.shape_cache``) plan with real values (``nonzero``,
``.tolist()``, drawn tables), which a fake or meta tensor does not have. So such a builder runs
here for real on the CPU, with every tensor it makes *tagged* with the call's device: an
operation that mixes a tagged tensor with a plain CPU tensor raises as CUDA would ("Expected all
tensors to be on the same device"), so a builder that leaves a tensor on the CPU fails here as
it fails on a GPU. Its result is then mirrored onto the call's device under the caller's mode
(tensors of the same shapes and dtypes, no values) and is never cached: caches hold only real
tensors.

A mirrored result handed to the next builder (a frame to a layout) is swapped back for the
tagged original, which carries the values.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

_STATE = threading.local()
# Mirrors handed out, newest last, each kept with its tagged original so that a later builder
# given the mirror builds from the original; bounded (they hold no data, only shapes). A call
# may make other calls before it hands a mirror on (a sharded call's chunks), so they are kept
# across calls; an id stays unique while its mirror is held here.
_MIRRORS: OrderedDict[int, tuple[Any, Any]] = OrderedDict()
MIRRORS_KEPT = 4096
# Ops of a CUDA tensor that also take CPU tensors (indices, a copy's source) as real CUDA does.
_CPU_OPERANDS_ALLOWED = {
    "index", "index_put", "index_put_", "_index_put_impl_", "copy_", "_to_copy",
}  # fmt: skip


@functools.cache
def can_hold_data(device: torch.device) -> bool:
    """Whether tensors on ``device`` can hold values in this process."""
    if device.type == "meta":
        return False
    if device.type == "cpu":
        return True
    module = getattr(torch, device.type, None)
    return bool(module is not None and module.is_available())


def has_no_data(t: Tensor) -> bool:
    """Whether ``t`` is a fake or meta tensor: shapes and devices only (never, in a graph that
    torch.compile traces: its run-time tensors are real)."""
    if type(t) is Tensor:  # a plain tensor (every call's hot path): not fake; meta by device
        return t.is_meta
    if torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def on_host() -> contextlib.AbstractContextManager:
    """Reads of host data (plans' CPU tensors: rows, positions) outside the caller's modes: a
    fake mode would make them fake and their values unreadable."""
    return _disable_current_modes()


def can_read_values(t: Tensor) -> bool:
    """Whether a check may read ``t``'s values: not in a traced graph (a graph break), not on
    fake or meta tensors (which have none)."""
    return not torch.compiler.is_compiling() and not has_no_data(t)


def refuse_where(bad: Tensor, message: str, detail: Callable[[Tensor], str] | None = None) -> None:
    """Refuse values where ``bad`` holds a True: on the CPU a ValueError (``message``, then
    ``detail(bad)``, which may read values), elsewhere a device-side assertion (no
    synchronisation), also in a traced graph; nothing on fake tensors, which hold no values."""
    readable = can_read_values(bad)
    if readable and bad.device.type == "cpu":
        if bool(bad.any()):
            raise ValueError(message + (detail(bad) if detail is not None else ""))
    elif readable or torch.compiler.is_compiling():
        torch._assert_async(~bad.any(), message)


def needs_device_build(args: tuple) -> bool:
    """Whether a builder with these arguments must be built here: a device among them holds no
    data, or an argument is the mirror of such a build (checked on every per-shape lookup, so
    kept to a type test per argument)."""
    if getattr(_STATE, "building", False) or getattr(_STATE, "tagging", 0):
        return True  # a builder that calls another, or a call on tagged tensors: built so too
    for arg in args:
        if type(arg) is torch.device:
            if not can_hold_data(arg):
                return True
        elif _MIRRORS and id(arg) in _MIRRORS:
            return True
    return False


def device_build(builder: Callable[..., Any], args: tuple) -> Any:
    """``builder(*args)`` for the device among ``args`` that holds no data: run for real on the
    CPU with its tensors tagged with that device, the result mirrored under the caller's mode."""
    args = tuple(_MIRRORS[id(a)][1] if id(a) in _MIRRORS else a for a in args)
    if getattr(_STATE, "building", False):  # a builder that calls another: stay tagged
        return builder(*args)
    tagged = getattr(_STATE, "tagging", 0) > 0  # a caller on tagged tensors: their values kept
    _STATE.building = True
    try:
        if tagged:
            return builder(*args)
        with _disable_current_modes(), _no_function_modes(), torch.no_grad(), tagging():
            built = builder(*args)
    finally:
        _STATE.building = False
    memo: dict[int, tuple[Any, Any]] = {}
    mirror = _mirror(built, memo)
    for original, mirrored in memo.values():  # each part too: a plan's group goes on alone
        if mirrored is not original:
            _MIRRORS[id(mirrored)] = (mirrored, original)
    while len(_MIRRORS) > MIRRORS_KEPT:
        _MIRRORS.popitem(last=False)
    return mirror


@contextlib.contextmanager
def tagging() -> Iterator[None]:
    """Operations on ``Tagged`` tensors run on their CPU values, their results tagged, a mix
    with a plain CPU tensor refused; factories asked for a device without data make tagged
    tensors (what a builder runs under, and a test that runs a device's path on a CPU)."""
    _STATE.tagging = getattr(_STATE, "tagging", 0) + 1
    try:
        with _Tagging(), _DeviceArguments():
            yield
    finally:
        _STATE.tagging -= 1


@contextlib.contextmanager
def _no_function_modes() -> Iterator[None]:
    """Without the caller's torch-function modes (a ``torch.device`` context would send every
    factory to its device)."""
    modes = [
        torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())
    ]
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


class Tagged(Tensor):
    """A CPU tensor's values under another device's name (see the module docstring)."""

    values: Tensor

    @staticmethod
    def __new__(cls, values: Tensor, device: torch.device) -> Tagged:
        tagged = Tensor._make_wrapper_subclass(
            cls, values.shape, strides=values.stride(), storage_offset=values.storage_offset(),
            dtype=values.dtype, device=device, requires_grad=False,
        )  # fmt: skip
        tagged.values = values
        return tagged

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with _Tagging():
            return func(*args, **(kwargs or {}))

    def __repr__(self) -> str:
        return f"Tagged({self.values!r}, device={self.device})"


class _DeviceArguments(TorchFunctionMode):
    """A factory or ``.to`` asked for a device without data runs on the CPU and its result is
    tagged (asked as is, torch would try to initialise that device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = _without_data(kwargs.get("device"))
        if func in (Tensor.tolist, Tensor.numpy) and isinstance(args[0], Tagged):
            return func(args[0].values, *args[1:], **kwargs)  # torch refuses subclasses there
        if device is not None:
            kwargs["device"] = "cpu"
        elif func in (Tensor.to, Tensor.cuda):
            found = [a for a in args[1:] if _without_data(a) is not None]
            device = _without_data(found[0]) if found else None
            if func is Tensor.cuda:
                device = torch.device("cuda") if device is None else device
                args, func = args[:1], Tensor.clone
            args = tuple("cpu" if any(a is f for f in found) else a for a in args)
        out = func(*args, **kwargs)
        if device is None:
            return out
        return tree_map(lambda t: _tag(t, device, args), out)


def _without_data(device: object) -> torch.device | None:
    if isinstance(device, str | torch.device):
        device = torch.device(device)
        return None if can_hold_data(device) else device
    return None


def _tag(t: object, device: torch.device, args: tuple) -> object:
    if not isinstance(t, Tensor) or isinstance(t, Tagged):
        return t
    fresh = t.clone() if any(t is a for a in args) else t  # ``.to`` returned its input
    return Tagged(fresh, device)


class _Tagging(TorchDispatchMode):
    """Runs every operation on the CPU values; factories asked for the tagged device and every
    result of an operation on tagged tensors are tagged; a plain CPU tensor of one or more
    dimensions beside a tagged one is refused as CUDA refuses it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        devices: set[torch.device] = set()
        plain: list[Tensor] = []
        tagged: dict[int, Tagged] = {}  # an in-place result is its input, tagged as it was

        def unwrap(t: object) -> object:
            if isinstance(t, Tagged):
                devices.add(t.device)
                tagged[id(t.values)] = t
                return t.values
            if isinstance(t, Tensor) and t.dim() > 0:
                plain.append(t)
            return t

        args, kwargs = tree_map(unwrap, (args, kwargs))
        asked = kwargs.get("device")
        if asked is not None and torch.device(asked).type != "cpu":
            devices.add(torch.device(asked))
            kwargs["device"] = torch.device("cpu")
        name = func.__name__.split(".")[0]
        if len(devices) > 1 or (devices and plain and name not in _CPU_OPERANDS_ALLOWED):
            found = sorted({str(d) for d in devices} | {str(t.device) for t in plain})
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two "
                f"devices, {' and '.join(found)}! ({func} on CPU values tagged "
                f"{' and '.join(str(d) for d in devices)}: a per-shape structure or a test's)"
            )
        out = func(*args, **kwargs)
        if not devices or (name == "_to_copy" and asked is not None and
                           torch.device(asked).type == "cpu"):  # fmt: skip
            return out
        (device,) = devices

        def wrap(t: object) -> object:
            if not isinstance(t, Tensor):
                return t
            same = tagged.get(id(t))
            return Tagged(t, device) if same is None else same

        return tree_map(wrap, out)


_NO_TENSORS = (
    int, float, str, bool, torch.device, torch.dtype, type, types.ModuleType,
    types.BuiltinFunctionType,
)  # fmt: skip


def _mirror(obj: Any, memo: dict[int, tuple[Any, Any]]) -> Any:
    """``obj`` with each tagged tensor replaced by one of the same shape, strides and dtype on
    its device, made under the caller's mode, through containers, objects' fields, closures,
    bound methods and partials; objects holding none are kept as they are."""
    if id(obj) in memo:
        return memo[id(obj)][1]
    if isinstance(obj, Tensor):
        if not isinstance(obj, Tagged):  # host data (plans' row lists): kept real, a constant
            return obj
        result = torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device=obj.device)
    elif obj is None or isinstance(obj, _NO_TENSORS):
        return obj
    elif isinstance(obj, list | tuple | set | frozenset):
        items = [_mirror(x, memo) for x in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        result = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    elif isinstance(obj, dict):
        items = {k: _mirror(v, memo) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        result = type(obj)(items)
    elif isinstance(obj, types.FunctionType):
        if not obj.__closure__:
            return obj
        cells = [_mirror(c.cell_contents, memo) for c in obj.__closure__]
        if all(a is c.cell_contents for a, c in zip(cells, obj.__closure__, strict=True)):
            return obj
        result = types.FunctionType(
            obj.__code__, obj.__globals__, obj.__name__, obj.__defaults__,
            tuple(types.CellType(c) for c in cells),
        )  # fmt: skip
        result.__dict__.update(obj.__dict__)
        result.__kwdefaults__ = obj.__kwdefaults__
    elif isinstance(obj, types.MethodType):
        owner = _mirror(obj.__self__, memo)
        return obj if owner is obj.__self__ else types.MethodType(obj.__func__, owner)
    elif isinstance(obj, functools.partial):
        fn = _mirror(obj.func, memo)
        args = _mirror(obj.args, memo)
        keywords = _mirror(obj.keywords, memo)
        if fn is obj.func and args is obj.args and keywords is obj.keywords:
            return obj
        result = functools.partial(fn, *args, **keywords)
    else:
        return _mirror_fields(obj, memo)
    memo[id(obj)] = (obj, result)
    return result


def _mirror_fields(obj: Any, memo: dict[int, tuple[Any, Any]]) -> Any:
    fields = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                fields[slot] = getattr(obj, slot)
    if not fields:
        return obj
    result = copy.copy(obj)
    memo[id(obj)] = (obj, result)  # a cycle back to obj finds the copy
    mirrored = {name: _mirror(value, memo) for name, value in fields.items()}
    if all(mirrored[name] is value for name, value in fields.items()):
        memo[id(obj)] = (obj, obj)
        return obj
    for name, value in mirrored.items():
        object.__setattr__(result, name, value)
    return result
