"""One benchmark cell: set up, check against the reference, then time; a failure is a record.

A cell is (variant, backend or peer, n, causal, pass). Its record (one entry of bench.json's
``cells``) has these fields; a value that was not measured is null:

    variant, backend, kind          the variant, the zoo backend ("auto" included) or peer name,
                                    "zoo" or "peer"
    resolved, sparse                the backend that ran (auto's choice) and whether it is sparse
    n, causal, pass                 the point ("fwd" or "fwd+bwd")
    batch, heads, head_dim, dtype   the shape and dtype of q, k and v
    params                          the variant's parameter overrides
    status                          ok | unsupported | unavailable | mismatch | oom | error |
                                    skipped (after an out-of-memory at a shorter length)
    reason                          why the status is not ok (the backend's own reason, the error)
    checked, max_error, errors,     whether the reference check ran (n <= check_max_len), the
    tolerance                       largest normalised error, the error per tensor, the limit
    time_ms, times_ms               median and all of the timed runs, in milliseconds
    repeats, warmup                 the runs timed and the untimed runs before them
    peak_memory_mb                  peak above the memory allocated before the run (MiB;
                                    CUDA's counter, or the profiler's events on a CPU)
    allowed_pairs, all_pairs        exact allowed (query, key) pairs; n^2, or n(n+1)/2 if causal
    useful_tflops                   4·B·H·allowed_pairs·D (x 3.5 for fwd+bwd) / time / 1e12
    block_size, block_density       the kernel's block and computed blocks / all blocks
    mask_build_ms, compile_ms       the mask build, and the first call after it (compilation)
    select_ms                       for blocks chosen by content (moba), the choice alone, made
                                    in every call and so inside time_ms too
    dense_time_ms                   the sdpa_dense cell's time at the same point
    sparsity_realization            (dense_time_ms / time_ms) / (all_pairs / allowed_pairs)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .impls import Point
from .measure import (
    TOLERANCE,
    CellSkip,
    compare,
    failure,
    median,
    peak_memory_mb,
    time_runs,
    timed_once,
    within,
)

BACKWARD_FACTOR = 3.5  # forward plus a backward pass counted at 2.5x the forward's FLOPs


@dataclass
class Settings:
    """How every cell of a sweep is measured."""

    warmup: int
    repeats: int
    min_time_ms: float = 0.0  # more runs while the timed ones took less (``time_runs``)


def useful_tflops(
    pairs: int, batch: int, heads: int, head_dim: int, backward: bool, ms: float
) -> float:
    """Useful TFLOP/s: 4·B·H·pairs·D forward (x 3.5 with the backward pass) per time."""
    flop = 4 * batch * heads * pairs * head_dim * (BACKWARD_FACTOR if backward else 1.0)
    return flop / (ms * 1e-3) / 1e12


CELL_FIELDS = (
    "variant", "backend", "kind", "resolved", "sparse", "n", "causal", "pass", "batch", "heads",
    "head_dim", "dtype", "params", "status", "reason", "checked", "max_error", "errors",
    "tolerance", "time_ms", "times_ms", "repeats", "warmup", "peak_memory_mb", "allowed_pairs",
    "all_pairs", "useful_tflops", "block_size", "block_density", "mask_build_ms", "compile_ms",
    "dense_time_ms", "sparsity_realization", "select_ms",
)  # fmt: skip


def new_record(impl: Any, point: Point, pairs: int | None, all_pairs: int) -> dict[str, Any]:
    """The record of a cell with every field (null until measured)."""
    batch, heads, _, head_dim = point.q.shape
    record: dict[str, Any] = dict.fromkeys(CELL_FIELDS)
    record.update(
        variant=impl.variant, backend=impl.name, kind=impl.kind, n=point.n, causal=point.causal,
        batch=batch, heads=heads, head_dim=head_dim, params=dict(impl.params), checked=False,
        dtype=str(point.q.dtype).removeprefix("torch."), allowed_pairs=pairs, all_pairs=all_pairs,
    )  # fmt: skip
    record["pass"] = point.pass_name
    return record


def measure_cell(
    impl: Any, point: Point, settings: Settings, pairs: int | None, all_pairs: int
) -> dict[str, Any]:
    """Set up, run once (timed as compile_ms), check, measure peak memory, then time."""
    record = new_record(impl, point, pairs, all_pairs)
    try:
        _measure(impl, point, settings, record)
    except CellSkip as skip:
        record.update(status=skip.status, reason=skip.reason)
    except Exception as error:  # a cell's failure is data; the sweep goes on
        record.update(failure(error))
    return record


def _measure(impl: Any, point: Point, settings: Settings, record: dict[str, Any]) -> None:
    prepared = impl.setup(point)
    record.update(
        resolved=prepared.resolved,
        sparse=prepared.sparse,
        mask_build_ms=prepared.mask_build_ms,
        block_size=prepared.block_size,
        block_density=prepared.block_density,
        select_ms=prepared.select_ms,
    )
    outputs, record["compile_ms"] = timed_once(lambda: point.step(prepared.run), point.device)
    if point.check:
        try:
            reference = point.reference(impl.variant, impl.params)
        except Exception as error:  # not this cell's failure: no out-of-memory skip follows
            reason = f"the reference check could not run ({type(error).__name__}: {error})"
            raise CellSkip("error", reason[:400]) from error
        names = ["out", "dq", "dk", "dv"][: len(outputs)]
        errors = compare(outputs, reference, names)
        tolerance = TOLERANCE[point.q.dtype]
        worst = max(errors, key=lambda k: math.inf if math.isnan(errors[k]) else errors[k])
        record.update(checked=True, errors=errors, max_error=errors[worst], tolerance=tolerance)
        if not within(errors, tolerance):
            raise CellSkip(
                "mismatch",
                f"{worst} differs from the float32 reference by {errors[worst]:.3g} "
                f"(normalised) > tolerance {tolerance:g}; not timed",
            )
    del outputs
    record["peak_memory_mb"] = peak_memory_mb(lambda: point.step(prepared.run), point.device)
    times = time_runs(
        lambda: point.step(prepared.run), point.device, settings.warmup, settings.repeats, None,
        settings.min_time_ms,
    )  # fmt: skip
    record.update(times_ms=times, time_ms=median(times))
    record.update(repeats=len(times), warmup=settings.warmup, status="ok")
    if record["allowed_pairs"] is not None:
        batch, heads, head_dim = record["batch"], record["heads"], record["head_dim"]
        record["useful_tflops"] = useful_tflops(
            record["allowed_pairs"], batch, heads, head_dim, point.backward, record["time_ms"]
        )
