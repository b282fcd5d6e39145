"""``python -m eval bench [CONFIG.yaml] [key=value ...]``: time and memory of every variant on every
backend, beside the peers (dense SDPA, FlexAttention with a standard block mask, xFormers).

The sweep is lengths x causal x passes x (the dense peer, then per variant: the zoo backends and the
per-variant peers). Every cell of one (length, causal, pass) point sees the same q, k, v. Each
cell's output is checked against the reference backend before it is timed (at n <= check_max_len);
a failure (out of memory, a backend that cannot run the call, a mismatch) is recorded and the sweep
goes on; after an out-of-memory, longer lengths of that series are skipped. Without a config,
eval/configs/bench.yaml runs on CUDA and eval/configs/bench_cpu.yaml elsewhere.

Writes ``bench.json`` (header and cells, rewritten after every point), ``bench.md`` and PNG plots
(``plots=false``: none; ``bench-report`` draws them from bench.json) under ``out``; see
eval/bench/cell.py for the cell fields and eval/bench/report.py for the derived figures. A sweep
run in pieces (one command each) becomes one report with ``python -m eval bench-report``
(eval/bench/merge.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from zoo.backends import Backend

from ..harness.config import ConfigError, config_arguments, load_config
from ..harness.distributed import device_name, thread_count
from . import markdown, plots, report
from .config import BenchConfig, check_config, resolve_device, resolve_dtype
from .impls import PEERS
from .measure import TOLERANCE
from .sweep import Sweep, run_cells

CONFIGS = Path(__file__).parents[1] / "configs"  # eval/configs

__all__ = ["PEERS", "BenchConfig", "check_config", "main", "run_bench", "write_report"]


def environment(sweep: Sweep, argv: list[str], source: str) -> dict[str, Any]:
    """bench.json's header: the machine, the library versions, the config, the command line."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # not installed (CPU wheels), or broken
        triton_version = None
    cuda = sweep.device.type == "cuda"
    return {
        "device": device_name(sweep.device),
        "device_type": sweep.device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "dtype": str(sweep.dtype).removeprefix("torch."),
        "tolerance": TOLERANCE[sweep.dtype],
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
        "argv": list(argv),
        "config_file": source,
        "config": asdict(sweep.config),
        "variants": sweep.variants,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_start": _load_average(),
    }


def _load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: other work on the machine skews CPU timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # not on every platform
        return None


def _plain(value: Any) -> Any:
    """JSON-safe: non-finite floats become strings ("nan"), which strict JSON cannot hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def write_json(path: Path, header: dict[str, Any], cells: list[dict], **extra: Any) -> None:
    """bench.json, written whole (``write_whole``)."""
    write_whole(path, _plain({"header": header, "cells": cells, **extra}))


def write_whole(path: Path, data: object, indent: int | None = 1) -> None:
    """A bench's JSON written whole or not at all (a temporary file renamed over it): rewritten
    after every cell, it must survive the signal that ends a stage at its time limit in the
    middle of a write (gpu_session.sh ships what is there, and the summary reads it)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=indent))
    os.replace(partial, path)


def run_bench(
    config: BenchConfig,
    source: str = "defaults",
    argv: list[str] | None = None,
    extra_backends: dict[str, Backend] | None = None,
) -> Path:
    """Run the sweep and write its outputs; returns the output directory."""
    extra = dict(extra_backends or {})
    variants = check_config(config, source, extra)
    device = resolve_device(config.device, source)
    sweep = Sweep(config, variants, device, resolve_dtype(config.dtype, device), extra)
    with compiler_settings(device), thread_count(config.threads):
        return _run(sweep, source, argv or [])


def _run(sweep: Sweep, source: str, argv: list[str]) -> Path:
    config, device = sweep.config, sweep.device
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(config.out.format(device=device.type, timestamp=stamp))
    out.mkdir(parents=True, exist_ok=True)
    header = environment(sweep, argv, source)
    started = time.perf_counter()
    print(f"bench: {source} on {header['device']} -> {out}", flush=True)
    cells = run_cells(
        sweep, lambda done: write_json(out / "bench.json", header, done, complete=False)
    )
    header["wall_seconds"] = round(time.perf_counter() - started, 1)
    header["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    header["load_average_end"] = _load_average()
    write_report(out, header, cells, config.fit_points, draw=config.plots)
    return out


def write_report(
    out: Path,
    header: dict[str, Any],
    cells: list[dict],
    fit_points: int,
    complete: bool = True,
    draw: bool = True,
) -> None:
    """The report of a sweep's cells, for ``bench`` and ``bench-report`` alike: fits the exponents,
    checks the goals, draws the plots (unless ``draw`` is false), writes bench.json and bench.md
    under ``out`` and prints the exponents and goals. ``complete`` is false for cells of a sweep
    that was interrupted."""
    exps = report.exponents(cells, fit_points)
    goals = report.goals(cells, exps, header["device_type"])
    pictures = plots.plot_all(cells, out) if draw else []
    write_json(out / "bench.json", header, cells, complete=complete, exponents=exps, goals=goals)
    text = markdown.render(header, cells, exps, goals, pictures, complete)
    (out / "bench.md").write_text(text)
    print("\n## Fitted exponents\n\n" + markdown.exponent_table(exps))
    print("\n## Goals\n\n" + "\n".join(goals))
    print(f"\nwrote {out / 'bench.json'}, {out / 'bench.md'} and {len(pictures)} plots", flush=True)


@contextlib.contextmanager
def compiler_settings(device: torch.device) -> Iterator[None]:
    """Every shape and mask is its own compiled graph: past dynamo's recompile limit FlexAttention
    would fall back silently to its dense eager path (and the sweep would time that), so the limit
    is raised for good (raising it harms nothing; restoring it could undo the zoo's own raise). On
    the CPU, inductor compiles in-process during the sweep: its pool of compile workers would
    compete for the cores being timed."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    for name in ("recompile_limit", "accumulated_recompile_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 100_000))
    threads = {"compile_threads": 1} if device.type == "cpu" else {}
    with inductor_config.patch(threads):
        yield


def default_config() -> Path:
    """The GPU sweep where there is a GPU, the CPU sweep elsewhere."""
    return CONFIGS / ("bench.yaml" if torch.cuda.is_available() else "bench_cpu.yaml")


def main(argv: list[str] | None = None) -> int:
    """The ``bench`` command; returns the exit status (2 for a bad config)."""
    argv = sys.argv[1:] if argv is None else argv
    path, items = config_arguments(
        "python -m eval bench", __doc__.split(":")[0], argv, "repeats=50"
    )
    path = str(default_config()) if path is None else path
    try:
        config = load_config(BenchConfig, path, items)
        check_config(config, path, {})
        resolve_device(config.device, path)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    run_bench(config, path, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
