"""``python -m eval bench-profile CONFIG.yaml [key=value ...]``: where a benchmark cell's time goes,
from a ``torch.profiler`` trace of each cell of the config (its zoo backends and its peers:
``flex_standard``, the goal cells' twin, and ``sdpa_dense``), summarised; the raw trace is never
written.

The cells are the sweep's (``eval/bench/sweep.py``: lengths x causal x passes, the dense peer then
each variant's backends and peers, the same inputs). Each cell runs once (compiling), ``warmup``
times, then ``repeats`` steps under the profiler, each step in a ``record_function`` range and
ended by a device synchronisation, so that every kernel a step launched ran inside its range.

Kernels: on CUDA the device's activities (kernels, copies, sets; annotations left out); on a CPU,
where there is no device timeline, the outermost CPU ops (aten's, and calls of compiled graphs:
each op's time includes the ops it called, counted once), so that the gaps are the host's time
between ops (Python, dispatch). Per step:

    step_ms     the range's wall time (median over the steps)
    kernel_ms   the time some kernel ran (the union of their intervals)
    gap_ms      host time between kernels: from the first kernel's start to the last one's end,
                the time no kernel ran (the device waiting for the host)
    lead_ms     from the step's start to its first kernel (launch and host work before it)
    tail_ms     from the last kernel's end to the step's end (host work after it, the sync)
    kernels     kernels per step; ``top``: the kernels by time, with calls and ms per step

Host work per step, in Python: ``repeats`` more steps under ``cProfile`` (after the profiler, so
neither slows the other), their functions by own time (``host``: function, calls and ms per step;
the synchronisation that ends each step shows as the wait it is). Beside a twin it says where a
call's host time goes that the kernels do not explain (the goal cells at 8K, where a call's host
work outlasts its kernel).

Writes ``profile.json`` (rewritten after every cell, so a run cut short keeps its cells) and
``profile.md`` (the cells, and each zoo cell beside its flex_standard twin) in ``out``.
"""

from __future__ import annotations

import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..harness.config import ConfigError, config_arguments, load_config
from ..harness.distributed import device_name, thread_count
from .config import BenchConfig, check_config, resolve_device, resolve_dtype
from .goals import twin_rows
from .impls import Point, clear_zoo_caches
from .measure import CellSkip, failure, free_memory, synchronize
from .run import compiler_settings, write_whole
from .sweep import Sweep, make_point, random_inputs

STEP = "zoo_bench_profile_step"
TOP = 8  # kernels (and host functions) listed per cell
HOST_ROWS = 5  # host functions per cell in profile.md
NAME_WIDTH = 100
DEFAULT_OUT = "eval/results/bench-profile-{device}-{timestamp}"


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals in microseconds, in milliseconds."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def _is_op(event: Any) -> bool:
    """A CPU op (aten's, or a custom one) or a call of a compiled graph (whose C++ kernels record
    no op of their own)."""
    name = event.name
    return name.startswith(("aten::", "prims::", "zoo::")) or "CompiledFxGraph" in name


def is_kernel(event: Any, on_device: bool, annotations: set[str]) -> bool:
    """A device activity (CUDA) other than an annotation's range on the device timeline; where
    there is no device timeline, an outermost CPU op (one that no other op called: its time
    includes its callees', counted once)."""
    if event.name in annotations:
        return False
    if on_device:
        annotated = getattr(event, "is_user_annotation", False)
        return event.device_type == torch.autograd.DeviceType.CUDA and not annotated
    if event.device_type != torch.autograd.DeviceType.CPU or not _is_op(event):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if _is_op(parent):
            return False
        parent = parent.cpu_parent
    return True


def summarise(events: list[Any], on_device: bool) -> dict[str, Any]:
    """Per-step figures (see the module docstring) from a profiler's events."""
    windows = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.name == STEP and e.device_type == torch.autograd.DeviceType.CPU
    )
    # record_function ranges (the steps', compiled graphs' calls) appear on the device timeline
    # too; on a CPU a compiled graph's call stands for the C++ kernels inside it
    annotations = {e.name for e in events if getattr(e, "is_user_annotation", False)}
    if not on_device:
        annotations = {name for name in annotations if "CompiledFxGraph" not in name}
    annotations.add(STEP)
    kernels = [e for e in events if is_kernel(e, on_device, annotations)]
    per_step: list[dict[str, float]] = []
    names: dict[str, list[float]] = {}
    for start, end in windows:
        mine = [k for k in kernels if start <= k.time_range.start <= end]
        spans = [(k.time_range.start, k.time_range.end) for k in mine]
        for k in mine:
            names.setdefault(k.name, []).append((k.time_range.end - k.time_range.start) / 1e3)
        busy = _union_ms(spans)
        first = min((a for a, _ in spans), default=start)
        last = max((b for _, b in spans), default=start)
        per_step.append({
            "step_ms": (end - start) / 1e3, "kernel_ms": busy,
            "gap_ms": max(0.0, (last - first) / 1e3 - busy), "lead_ms": (first - start) / 1e3,
            "tail_ms": (end - last) / 1e3, "kernels": len(mine),
        })  # fmt: skip
    steps = len(per_step)
    if not steps:
        return {"steps": 0}

    def mean(key: str) -> float:
        return round(sum(s[key] for s in per_step) / steps, 4)

    top = sorted(names.items(), key=lambda item: -sum(item[1]))[:TOP]
    busy = sum(s["kernel_ms"] for s in per_step)
    return {
        "steps": steps,
        "step_ms": round(statistics.median(s["step_ms"] for s in per_step), 4),
        "kernel_ms": mean("kernel_ms"),
        "gap_ms": mean("gap_ms"),
        "lead_ms": mean("lead_ms"),
        "tail_ms": mean("tail_ms"),
        "kernels": mean("kernels"),
        "top": [
            {
                "name": name[:NAME_WIDTH],
                "calls": round(len(times) / steps, 2),
                "ms": round(sum(times) / steps, 4),
                "share": round(sum(times) / busy, 3) if busy else None,
            }
            for name, times in top
        ],
    }


def profile_steps(run, point: Point, warmup: int, repeats: int) -> dict[str, Any]:
    """Compile and warm up outside the profiler, then ``repeats`` profiled steps."""
    return profile_calls(lambda: point.step(run), point.device, warmup, repeats)


def profile_calls(step, device: torch.device, warmup: int, repeats: int) -> dict[str, Any]:
    """``step()`` once and ``warmup`` times outside the profiler, then ``repeats`` times under
    it (each in a ``STEP`` range, ended by a synchronisation), summarised (``summarise``), and
    ``repeats`` more under cProfile (``host``)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(1 + warmup):
        step()
    synchronize(device)
    on_device = (
        device.type == "cuda" and ProfilerActivity.CUDA in torch.profiler.supported_activities()
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            with record_function(STEP):
                step()
                synchronize(device)
    result = summarise(list(prof.events()), on_device)
    result["activity"] = "CUDA kernels" if on_device else "outermost CPU ops"
    if on_device and not result.get("kernels"):  # no device activity recorded (no CUPTI)
        result = summarise(list(prof.events()), False)
        result["activity"] = "outermost CPU ops: the profiler recorded no CUDA activity"
    result["host"] = host_functions(step, device, repeats)
    return result


def host_functions(step, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """The Python functions of ``repeats`` calls of ``step()`` by own time (cProfile), per call."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for _ in range(repeats):
            step()
            synchronize(device)
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, ..., tottime, cumtime, _)}
    ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:TOP]
    return [
        {
            "function": _function_name(*key)[:NAME_WIDTH],
            "calls": round(value[1] / repeats, 2),
            "ms": round(value[2] * 1e3 / repeats, 4),
        }
        for key, value in ranked
    ]


def _function_name(file: str, line: int, name: str) -> str:
    """``zoo/backends/flex.py:227(forward)``, paths cut to the package; built-ins as they are."""
    if file == "~":
        return name
    for root in ("zoo/", "eval/", "torch/"):
        if f"/{root}" in file:
            file = file[file.rindex(f"/{root}") + 1 :]
            break
    return f"{file}:{line}({name})"


def profile_cell(impl: Any, point: Point, warmup: int, repeats: int) -> dict[str, Any]:
    cell: dict[str, Any] = {
        "variant": impl.variant, "params": dict(impl.params), "backend": impl.name,
        "kind": impl.kind, "n": point.n, "causal": point.causal, "pass": point.pass_name,
        "resolved": None, "status": None, "reason": None,
    }  # fmt: skip
    try:
        prepared = impl.setup(point)
        cell["resolved"] = prepared.resolved
        cell.update(profile_steps(prepared.run, point, warmup, repeats))
        cell["status"] = "ok"
    except CellSkip as skip:
        cell.update(status=skip.status, reason=skip.reason)
    except Exception as error:  # a cell's failure is data; the others still run
        cell.update(failure(error))
    if impl.kind == "zoo":
        clear_zoo_caches()
    if cell["status"] != "ok":
        free_memory(point.device)
    return cell


def _label(cell: dict[str, Any]) -> str:
    backend = cell["backend"]
    if cell["resolved"] and cell["resolved"] != backend:
        backend += f"->{cell['resolved']}"
    return backend


def _point(cell: dict[str, Any]) -> str:
    return f"{cell['n']} {'causal' if cell['causal'] else 'non-causal'} {cell['pass']}"


def markdown(header: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    lines = [
        f"# Profile of benchmark cells ({header['device']})",
        "",
        f"`{header['command']}`; {header['steps']} profiled steps per cell after "
        f"{header['warmup']} warm-up steps; kernels: {header['activity']}. Per step: wall time, "
        "the time some kernel ran, host time between kernels (the first kernel's start to the "
        "last one's end, no kernel running), time before the first kernel and after the last.",
        "",
        "| variant | point | impl | step ms | kernel ms | gap ms | lead ms | tail ms | kernels "
        "| top |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        if c["status"] != "ok" or not c.get("steps"):
            why = (
                f"{c['status']}: {(c['reason'] or '')[:80]}" if c["status"] != "ok" else "no steps"
            )
            lines.append(f"| {c['variant']} | {_point(c)} | {_label(c)} | {why} | | | | | | |")
            continue
        top = c["top"][0] if c.get("top") else None
        name = f"`{top['name'][:60]}` ({top['share']:.0%})" if top and top["share"] else "-"
        lines.append(
            f"| {c['variant']} | {_point(c)} | {_label(c)} | {c['step_ms']:.3f} | "
            f"{c['kernel_ms']:.3f} | {c['gap_ms']:.3f} | {c['lead_ms']:.3f} | {c['tail_ms']:.3f} | "
            f"{c['kernels']:g} | "
            f"{name} |"
        )
    twins = twin_rows(cells)
    if twins:
        lines += [
            "",
            "## Beside flex_standard",
            "",
            "| variant | point | impl | step / twin | kernel / twin | gap ms - twin's |",
            "|---|---|---|---|---|---|",
        ]
        for c, twin in twins:
            kernel = c["kernel_ms"] / twin["kernel_ms"] if twin["kernel_ms"] else float("nan")
            lines.append(
                f"| {c['variant']} | {_point(c)} | {_label(c)} | "
                f"{c['step_ms'] / twin['step_ms']:.3f} | {kernel:.3f} | "
                f"{c['gap_ms'] - twin['gap_ms']:+.3f} |"
            )
    hosts = [c for c in cells if c["status"] == "ok" and c.get("host")]
    if hosts:
        lines += [
            "",
            "## Host work per step (Python, by own time)",
            "",
            "| variant | point | impl | function | calls | ms |",
            "|---|---|---|---|---|---|",
        ]
        for c in hosts:
            for f in c["host"][:HOST_ROWS]:
                lines.append(
                    f"| {c['variant']} | {_point(c)} | {_label(c)} | `{f['function'][:70]}` | "
                    f"{f['calls']:g} | {f['ms']:.4f} |"
                )
    return "\n".join(lines) + "\n"


def run_profile(config: BenchConfig, source: str, argv: list[str]) -> Path:
    variants = check_config(config, source, {})
    device = resolve_device(config.device, source)
    sweep = Sweep(config, variants, device, resolve_dtype(config.dtype, device))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(config.out.format(device=device.type, timestamp=stamp))
    out.mkdir(parents=True, exist_ok=True)
    on_device = device.type == "cuda"
    header = {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "dtype": str(sweep.dtype).removeprefix("torch."),
        "command": shlex.join(["python", "-m", "eval", "bench-profile", *argv]),
        "config_file": source,
        "config": asdict(config),
        "steps": config.repeats,
        "warmup": config.warmup,
        "activity": "CUDA kernels" if on_device else "outermost CPU ops",
    }
    cells: list[dict[str, Any]] = []

    def save() -> None:
        write_whole(out / "profile.json", {"header": header, "cells": cells})
        (out / "profile.md").write_text(markdown(header, cells))

    print(f"bench-profile: {source} on {header['device']} -> {out}", flush=True)
    with compiler_settings(device), thread_count(config.threads):
        impls = sweep.implementations()
        for n in sorted(config.lengths):
            for causal in config.causal:
                base = random_inputs(sweep, n)
                for pass_ in config.passes:
                    point = make_point(sweep, n, causal, pass_ == "fwd+bwd", base)
                    for impl in impls:
                        cell = profile_cell(impl, point, config.warmup, config.repeats)
                        cells.append(cell)
                        figures = (
                            f"step {cell['step_ms']:.3g} ms, kernels {cell['kernel_ms']:.3g} ms, "
                            f"gaps {cell['gap_ms']:.3g} ms"
                            if cell["status"] == "ok" and cell.get("steps")
                            else f"{cell['status']} {cell['reason'] or ''}"[:200]
                        )
                        print(f"{cell['variant']} {_point(cell)} {_label(cell)}: {figures}",
                              flush=True)  # fmt: skip
                        save()
                    del point
                    free_memory(device)
                del base
    save()
    print(f"wrote {out / 'profile.json'} and {out / 'profile.md'}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path, items = config_arguments(
        "python -m eval bench-profile", __doc__.split(":")[0], argv, "lengths=[16384] repeats=3"
    )
    if path is None:
        print("error: bench-profile needs a config (eval/configs/bench_goals_gpu.yaml)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        config = load_config(BenchConfig, path, items)
        if config.out == BenchConfig.out:
            config.out = DEFAULT_OUT
        check_config(config, path, {})
        resolve_device(config.device, path)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    run_profile(config, path, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
