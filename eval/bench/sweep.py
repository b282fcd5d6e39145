"""The benchmark's loop: points in order, the cells of each point, progress and partial results.

Order: lengths (shortest first) x causal x passes; at each point the dense peer first (the other
cells' realization needs its time), then per variant the zoo backends and the per-variant peers.
After an out-of-memory, the longer lengths of that (variant, backend, pass, causal) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import zoo
from zoo.backends import Backend
from zoo.functional import resolve_pattern

from . import report
from .cell import Settings, measure_cell, new_record
from .config import BenchConfig, CompiledCall, backend_instances
from .impls import Point, SdpaDense, ZooImpl, clear_zoo_caches, variant_peer
from .measure import free_memory, is_oom, older_objects_frozen
from .routed import chosen_pairs, is_routed


@dataclass
class Sweep:
    """A checked config and what it resolved to."""

    config: BenchConfig
    variants: list[str]
    device: torch.device
    dtype: torch.dtype
    # tests: instances by name (a CompiledCall: its cells' calls under torch.compile)
    extra_backends: dict[str, Backend | CompiledCall] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The config's own instances (backend_instances), under what a caller passes.
        self.extra_backends = {**backend_instances(self.config, "config"), **self.extra_backends}

    def implementations(self) -> list[Any]:
        """Per point, in order: the dense peer, then each variant's backends and peers."""
        config = self.config
        out: list[Any] = [SdpaDense()] if "sdpa_dense" in config.peers else []
        for variant in self.variants:
            params = dict(config.params.get(variant, {}))
            for name in config.backends:
                backend = self.extra_backends.get(name, name)
                compiled = isinstance(backend, CompiledCall)
                backend = backend.backend if compiled else backend
                out.append(ZooImpl(name, backend, variant, params, compiled=compiled))
            out += [variant_peer(p, variant, params) for p in config.peers if p != "sdpa_dense"]
        return out


def random_inputs(sweep: Sweep, n: int) -> list[torch.Tensor]:
    """q, k, v and the output gradient: unit variance, seeded by the config's seed and n; k and v
    with ``kv_heads`` heads where the config sets them (grouped-query attention)."""
    c = sweep.config
    generator = torch.Generator(device=sweep.device).manual_seed(c.seed * 1_000_003 + n)
    shape = (c.batch, c.heads, n, c.head_dim)
    kv_shape = (c.batch, c.kv_heads or c.heads, n, c.head_dim)
    return [
        torch.randn(s, generator=generator, device=sweep.device).to(sweep.dtype)
        for s in (shape, kv_shape, kv_shape, shape)
    ]


def make_point(sweep: Sweep, n: int, causal: bool, backward: bool, base: list) -> Point:
    q, k, v, grad_out = base
    if backward:  # leaves on the same storage: the same values in both passes
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return Point(n, causal, backward, q, k, v, grad_out, n <= sweep.config.check_max_len)


def allowed_pairs_for(variant: str, params: dict, causal: bool, n: int) -> int | None:
    """Exact allowed pairs of the variant (intersected with causal), or None where it cannot be
    built at this length (its cells then record why)."""
    try:
        return zoo.allowed_pairs(resolve_pattern(variant, causal, dict(params)), n, n)
    except ValueError:
        return None


def chosen_pairs_for(
    variant: str, params: dict, causal: bool, q: torch.Tensor, k: torch.Tensor
) -> int | None:
    """The pairs a variant chosen by content allows on these inputs (counted without an n x n
    grid, ``eval.bench.routed``), or None where its choice cannot be made here (a graph without
    its edges, no memory for the choice): its cells then record why."""
    try:
        return chosen_pairs(variant, params, causal, q.detach(), k.detach())
    except ValueError:
        return None
    except Exception as error:
        if not is_oom(error):
            raise
        free_memory(q.device)
        return None


def progress(i: int, total: int, cell: dict[str, Any]) -> str:
    """The one line printed when a cell finishes."""
    backend = cell["backend"]
    if cell["resolved"] and cell["resolved"] != backend:
        backend += f"->{cell['resolved']}"
    head = (
        f"[{i}/{total}] n={cell['n']} {'causal' if cell['causal'] else 'non-causal'} "
        f"{cell['pass']} {cell['variant']}/{backend}: {cell['status']}"
    )
    if cell["status"] != "ok":
        return f"{head}: {cell['reason']}"
    bits = [f"{cell['time_ms']:.3g} ms"]
    if cell["useful_tflops"] is not None:
        bits.append(f"{cell['useful_tflops']:.3g} TFLOP/s")
    if cell["sparsity_realization"] is not None:
        bits.append(f"realization {cell['sparsity_realization']:.2f}")
    if cell["peak_memory_mb"] is not None:
        bits.append(f"{cell['peak_memory_mb']:.0f} MiB")
    bits.append(f"max err {cell['max_error']:.2g}" if cell["checked"] else "unchecked")
    return f"{head} {', '.join(bits)}"


class Runner:
    """Runs cells, remembering allowed-pair counts and the lengths that ran out of memory."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pairs: dict[tuple, int | None] = {}
        self.oom_at: dict[tuple, int] = {}  # (variant, backend, kind, pass, causal) -> n

    @staticmethod
    def count(impl: Any, point: Point) -> int | None:
        """The cell's allowed pairs: from the point's own inputs for a choice by content, else
        from the pattern and the length; never through an n x n mask."""
        if is_routed(impl.variant, impl.params):
            return chosen_pairs_for(impl.variant, impl.params, point.causal, point.q, point.k)
        return allowed_pairs_for(impl.variant, impl.params, point.causal, point.n)

    def run(self, impl: Any, point: Point) -> dict[str, Any]:
        """One cell, or its 'skipped' record after an out-of-memory at a shorter length."""
        key = (impl.variant, repr(sorted(impl.params.items())), point.causal, point.n)
        if key not in self.pairs:
            self.pairs[key] = self.count(impl, point)
        pairs, total = self.pairs[key], report.all_pairs(point.n, point.causal)
        # the kind too: xformers is both a zoo backend and a peer (bench.yaml), and the backend's
        # out of memory skipped the peer, which never ran
        series = (impl.variant, impl.name, impl.kind, point.pass_name, point.causal)
        if series in self.oom_at:
            cell = new_record(impl, point, pairs, total)
            reason = f"skipped after out of memory at n={self.oom_at[series]}"
            cell.update(status="skipped", reason=reason)
            return cell
        cell = measure_cell(impl, point, self.settings, pairs, total)
        if impl.kind == "zoo":
            clear_zoo_caches()  # masks cached for this cell would hold device memory
        if cell["status"] == "oom":
            self.oom_at[series] = point.n
        if cell["status"] != "ok":
            free_memory(point.device)
        return cell


def run_cells(sweep: Sweep, save: Callable[[list[dict]], None]) -> list[dict[str, Any]]:
    """Every cell of the sweep in order, a line printed as each finishes; ``save`` after each
    cell, so an interrupted sweep keeps what it measured (a GPU session's stage cut at its limit
    in the middle of a point had lost that point's measured cells: MoBA's forward+backward at 16K
    on the H200, printed but not saved)."""
    config = sweep.config
    impls = sweep.implementations()
    runner = Runner(Settings(config.warmup, config.repeats, 1e3 * config.min_time_s))
    total = len(config.lengths) * len(config.causal) * len(config.passes) * len(impls)
    cells: list[dict[str, Any]] = []
    with older_objects_frozen():
        for n in sorted(config.lengths):
            for causal in config.causal:
                base = random_inputs(sweep, n)
                for pass_ in config.passes:
                    point = make_point(sweep, n, causal, pass_ == "fwd+bwd", base)
                    dense = None
                    for impl in impls:
                        cell = runner.run(impl, point)
                        if impl.name == "sdpa_dense":
                            dense = cell
                        report.realize(cell, dense)
                        cells.append(cell)
                        print(progress(len(cells), total, cell), flush=True)
                        save(cells)
                    del point
                    free_memory(sweep.device)
                del base
    return cells
