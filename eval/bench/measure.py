"""How the benchmark measures one cell: clocks, peak memory, the reference check, failures.

Timing: the median over ``repeats`` runs after ``warmup`` runs. On CUDA each run is bracketed by
two CUDA events on the current stream (kernel time, no host sync inside the loop); on the CPU by
``time.perf_counter`` (CPU kernels are synchronous). One-off costs (building a mask, the first,
compiling call) are wall time with a device synchronisation on both sides.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` during one run, minus
``torch.cuda.memory_allocated`` just before it (the inputs, already resident, are not counted; the
output and gradients, alive at the peak, are). The CPU allocator keeps no peak counter (and the
process's resident-set peak covers everything the process ever did), so on the CPU one more run
goes under ``torch.profiler`` with ``profile_memory``: its allocation events, in time order, give
the running total of the run's own allocations and frees, whose maximum is the peak. That run is
not timed (the profiler slows it).

Check: the output (and, for fwd+bwd, dq, dk and dv) against the reference backend run in float32
on the same device and the same values. The error of a tensor is max|x - ref| / max(1, max|ref|):
absolute for unit-scale tensors, relative for larger ones (gradients). TOLERANCE gives the limit.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

# Largest allowed normalised error, by the dtype the cell computes in. bf16 keeps 8 mantissa bits
# (2^-8 ~ 4e-3 relative per rounding); unit-variance inputs give outputs of magnitude <= 1, so
# 2e-2 absolute leaves room for a few roundings while a wrong mask (errors ~ 0.1 - 1) fails.
# float32 allows TF32-like rounding (2^-11) on GPUs; a CPU float32 run is far below it.
TOLERANCE = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float64: 1e-6}

_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


class CellSkip(Exception):
    """A cell that cannot run here, recorded with ``status`` and the reason (not a failure)."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def is_oom(error: BaseException) -> bool:
    """True for out-of-memory errors: torch.cuda.OutOfMemoryError, MemoryError, or a RuntimeError
    that says so (compilers and the CPU allocator wrap it in their own exception types)."""
    if isinstance(error, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(t in text for t in _OOM_TEXT)


def failure(error: Exception) -> dict[str, str]:
    """A cell's failure as data: its status (``oom`` or ``error``) and reason, with where it was
    raised unless it ran out of memory."""
    oom = is_oom(error)
    reason = f"{type(error).__name__}: {str(error).strip()[:400]}"
    if not oom:
        where = traceback.extract_tb(error.__traceback__)[-1]
        reason += f" (at {where.filename}:{where.lineno})"
    return {"status": "oom" if oom else "error", "reason": reason}


def failed_cell(error: Exception, **cell: object) -> dict:
    """A cell that raised, recorded with its ``failure`` so that a run goes on and keeps what
    the others measured."""
    return {**cell, **failure(error)}


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Within, a collection (``free_memory``) skips the objects that existed before (``gc.freeze``):
    none of them is a cell's garbage, and after the imports of torch and Inductor a full
    collection scans so many that it cost more than a small cell's timing. Garbage among those
    older objects waits for the end. Within a freeze already made (by the caller), nothing
    changes: its objects stay frozen after."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def free_memory(device: torch.device) -> None:
    """Drop what a failed cell left behind (its traceback frames hold tensors)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock(Protocol):
    """Brackets runs and reports their durations in milliseconds."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def durations_ms(self) -> list[float]: ...


class WallClock:
    """``time.perf_counter`` around each run: right for synchronous (CPU) kernels."""

    def __init__(self) -> None:
        self._t0 = 0.0
        self._ms: list[float] = []

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        self._ms.append((time.perf_counter() - self._t0) * 1e3)

    def durations_ms(self) -> list[float]:
        return list(self._ms)


class CudaClock:
    """A pair of CUDA events per run, read after one synchronisation at the end, so the host
    never waits inside the timed loop. ``cuda`` is the torch.cuda module (tests pass a fake)."""

    def __init__(self, device: torch.device, cuda: Any = torch.cuda) -> None:
        self.device, self.cuda = device, cuda
        self._pairs: list[tuple[Any, Any]] = []

    def start(self) -> None:
        event = self.cuda.Event(enable_timing=True)
        event.record()
        self._pairs.append((event, None))

    def stop(self) -> None:
        event = self.cuda.Event(enable_timing=True)
        event.record()
        self._pairs[-1] = (self._pairs[-1][0], event)

    def durations_ms(self) -> list[float]:
        self.cuda.synchronize(self.device)
        return [float(a.elapsed_time(b)) for a, b in self._pairs]


def make_clock(device: torch.device) -> Clock:
    return CudaClock(device) if device.type == "cuda" else WallClock()


# The most runs ``min_time_ms`` adds (a cell of microseconds would otherwise run for ever).
MAX_RUNS = 1000


def time_runs(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int, clock: Clock | None,
    min_time_ms: float = 0.0,
) -> list[float]:  # fmt: skip
    """Durations (ms) of ``repeats`` runs of ``fn`` after ``warmup`` untimed ones, and of more
    (up to MAX_RUNS) while the runs so far took less than ``min_time_ms`` of wall time: on a
    shared CPU a 5 ms cell's median of 5 runs moved by 30% between sweeps."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    clock = clock if clock is not None else make_clock(device)
    deadline, runs = time.perf_counter() + min_time_ms / 1e3, 0
    while runs < repeats or (runs < MAX_RUNS and time.perf_counter() < deadline):
        clock.start()
        fn()
        clock.stop()
        runs += 1
    return clock.durations_ms()


def timed_once(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """(result, wall ms) of one run with the device synchronised before and after: for one-off
    costs such as a mask build or a first, compiling call."""
    synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, (time.perf_counter() - t0) * 1e3


def peak_memory_mb(
    fn: Callable[[], object], device: torch.device, cuda: Any = torch.cuda
) -> float | None:
    """Peak allocated memory of one run above what was allocated before it (MiB); CUDA's
    counter there, the profiler's allocation events on the CPU (see the module docstring)."""
    if device.type == "cpu":
        return cpu_peak_memory_mb(fn)
    if device.type != "cuda":
        return None
    cuda.synchronize(device)
    before = cuda.memory_allocated(device)
    cuda.reset_peak_memory_stats(device)
    result = fn()
    cuda.synchronize(device)
    peak = cuda.max_memory_allocated(device)
    del result
    return max(peak - before, 0) / 2**20


def cpu_peak_memory_mb(fn: Callable[[], object]) -> float:
    """The largest running total of the CPU allocations (minus frees) that ``fn`` makes, from
    the profiler's allocation events; what ``fn`` returns is freed after the profile ends, so it
    counts."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
    total = peak = 0
    for _, size in sorted(sizes):
        total += size
        peak = max(peak, total)
    return peak / 2**20


def normalised_error(got: Tensor, ref: Tensor) -> float:
    """max|got - ref| / max(1, max|ref|), in float64; NaN anywhere gives NaN."""
    ref = ref.detach().to(torch.float64)
    diff = (got.detach().to(torch.float64) - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    return diff / scale


def compare(got: Sequence[Tensor], ref: Sequence[Tensor], names: Sequence[str]) -> dict[str, float]:
    """The normalised error of each tensor, by name."""
    return {n: normalised_error(g, r) for n, g, r in zip(names, got, ref, strict=True)}


def within(errors: dict[str, float], tolerance: float) -> bool:
    """Every error finite and at most the tolerance."""
    return all(math.isfinite(e) and e <= tolerance for e in errors.values())


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))
