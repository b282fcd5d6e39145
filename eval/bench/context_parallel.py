"""``python -m eval bench-cp [CONFIG.yaml] [key=value ...]``: context parallelism, one sequence
sharded over N processes, in bytes received per rank and time, beside the peers.

Methods, on the same shapes (B, H, L, D) cut into N equal contiguous shards:
- ``zoo``: ``zoo.attention(..., cp_group=)``, which fetches the key/value blocks the pattern reads
  and computes wide query rows (global tokens) where their keys are (``zoo.parallel``); bytes
  from its plan (``zoo.parallel.shard_stats``: keys, values, shipped query rows and partials),
  the most and the least of any rank;
- ``zoo_head_tail``: the same with ``cp_order="head_tail"`` (causal load balance); its pairs per
  rank (max / min) show the balance;
- ``all_gather``: every key and value gathered on every rank, then the rank's queries against
  them with the pattern (what PyTorch's FlexAttention context-parallel path does);
- ``overlap``: ``zoo`` with ``overlap=True`` (interior rows computed while the exchange is in
  flight) against ``overlap=False`` (a call per chunk after the exchange), timed in turns in one
  loop; its forward and forward+backward times are the overlapped ones, and ``serial_*`` the
  others; ``interior_rows_min``: the fewest rows any rank computes during the exchange;
- ``torch_ring``: PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` (SDPA ring
  attention), for ``full`` and ``causal`` only (SDPA has no other pattern). On a CPU it does not
  run (torch 2.13: no sharding strategy for the CPU flash kernel); its bytes are then the ring's,
  (N - 1) shards of k and v per rank, and its time is left out with the reason.

Time: the median of ``repeats`` forward calls (after ``warmup``), each after a barrier, the
slowest rank's; and, for ``zoo``, forward and backward. On a CPU the N processes share its cores,
so times hold for comparing methods in one run, not as scaling. Without torchrun the command
starts N gloo processes itself for each N in ``worlds``; under ``torchrun --nproc-per-node N``
(the GPU twin, ``eval/configs/bench_cp_gpu.yaml``) it runs in those ranks with NCCL.
Memory: for ``zoo``, the largest rank's peak of one forward and backward above its inputs (the
profiler's allocation events on a CPU, CUDA's counter on a GPU); ``worlds`` may include 1 (one
process, nothing exchanged), the baseline of the fit of peak against N.
Writes ``bench-cp.json`` and ``bench-cp.md`` in ``out``; bench-cp.md ends with compact tables
that docs/context-parallelism.md copies (``zoo readme``): "Bytes received per rank", "Causal
load balance", "Peak memory per rank" and "Overlap".
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zoo
from zoo.functional import resolve_pattern
from zoo.layout.block_layout import specialized, with_heads
from zoo.parallel import ShardLayout, shard_stats
from zoo.parallel.at_positions import AtPositions

from ..harness.config import ConfigError, config_arguments, load_config
from ..harness.distributed import device_name
from .measure import peak_memory_mb
from .report import fit_exponent

METHODS = ("zoo", "zoo_head_tail", "overlap", "all_gather", "torch_ring")


@dataclass
class CPConfig:
    variants: list[str] = field(default_factory=lambda: ["sliding_window", "full", "causal"])
    lengths: list[int] = field(default_factory=lambda: [4096, 8192])
    worlds: list[int] = field(default_factory=lambda: [2, 4])  # without torchrun
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    batch: int = 1
    heads: int = 4
    head_dim: int = 32
    backend: str = "auto"
    warmup: int = 1
    repeats: int = 5
    params: dict[str, dict] = field(default_factory=dict)
    device: str = "cpu"  # cpu (gloo) or cuda (nccl, under torchrun)
    out: str = "eval/results/bench-cp-cpu"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path, items = config_arguments(
        "python -m eval bench-cp", __doc__.split(":")[0], argv, "repeats=5"
    )
    try:
        config = load_config(CPConfig, path, items)
    except ConfigError as error:
        print(f"bench-cp: {error}", file=sys.stderr)
        return 2
    unknown = sorted(set(config.methods) - set(METHODS))
    if unknown:
        print(f"bench-cp: unknown methods {unknown}; choose from {METHODS}", file=sys.stderr)
        return 2
    command = "python -m eval bench-cp " + shlex.join(argv)
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        rows = _measure_in_rank(config)
        if int(os.environ.get("RANK", "0")) == 0:
            _write(config, rows, command)
        return 0
    rows = []
    for world in config.worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_spawned, args=(world, port, config, queue), nprocs=world,
                           start_method="spawn")  # fmt: skip
        rows += queue.get()
    _write(config, rows, command)
    return 0


def _spawned(rank: int, world: int, port: int, config: CPConfig, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = _measure(config, rank, world, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)  # a SimpleQueue: in the pipe when put returns
    # Out without the interpreter's teardown, in which gloo's threads aborted a rank whose work
    # was done ("terminate called without an active exception"; as tests/parallel's ranks do).
    os._exit(0)


def _measure_in_rank(config: CPConfig) -> list[dict]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return _measure(config, rank, world, device)
    finally:
        dist.destroy_process_group()


def _measure(config: CPConfig, rank: int, world: int, device: torch.device) -> list[dict]:
    """Every (variant, length, method) row, as rank 0 records it."""
    rows = []
    group = dist.group.WORLD
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for length in config.lengths:
        s = length // world
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(config.batch, config.heads, s, config.head_dim, generator=g)
                   .to(device, dtype) for _ in range(3))  # fmt: skip
        row_bytes = config.batch * config.heads * 2 * config.head_dim * q.element_size()
        for variant in config.variants:
            params = config.params.get(variant, {})
            base = dict(variant=variant, length=length, world=world, device=device_name(device))
            for method in config.methods:
                found = _one(method, config, q, k, v, group, params, variant, length, world)
                if found is None:
                    continue
                most = found.pop("bytes_received", found["rows_received"] * row_bytes)
                least = found.pop("bytes_received_min", most)
                rows.append(
                    {
                        **base,
                        "method": method,
                        **found,
                        "mib_received": most / 2**20,
                        "mib_received_min": least / 2**20,
                    }
                )
    return rows


def _one(method, config, q, k, v, group, params, variant, length, world) -> dict | None:
    """One method's figures on this rank, reduced over the ranks (the most; pairs: max, min)."""
    kw = dict(variant=variant, **params)
    if method in ("zoo", "zoo_head_tail"):
        order = "head_tail" if method == "zoo_head_tail" else "contiguous"
        stats = shard_stats(q, k, v, group=group, order=order, **kw)
        rows, pairs, received = stats.received_rows, stats.pairs, stats.received_bytes

        def run():
            return zoo.attention(q, k, v, backend=config.backend, cp_group=group, cp_order=order,
                                 **kw)  # fmt: skip

        timed = _time(run, config, group)
        trained = _time(run, config, group, (q, k, v)) if method == "zoo" else None
        peak = _peak_mib(run, (q, k, v), group) if method == "zoo" else None
        return {"rows_received": _most(rows, group), "rows_received_min": abs(_most(-rows, group)),
                "bytes_received": _most(received, group),
                "bytes_received_min": abs(_most(-received, group)),
                "wide_rows_max": _most(stats.wide_rows, group), "pairs_max": _most(pairs, group),
                "pairs_min": abs(_most(-pairs, group)), "forward_ms": timed,
                "forward_backward_ms": trained, "peak_mib": peak}  # fmt: skip
    if method == "overlap":

        def run(overlap: bool):
            return zoo.parallel.context_parallel_attention(
                q, k, v, group=group, backend=config.backend, overlap=overlap, **kw
            )

        stats = shard_stats(q, k, v, group=group, **kw)
        runs = (lambda: run(False), lambda: run(True))
        serial, overlapped = _time_in_turns(runs, (), config, group)
        serial_trained, trained = _time_in_turns(runs, (q, k, v), config, group)
        return {"rows_received": _most(stats.received_rows, group),
                "bytes_received": _most(stats.received_bytes, group),
                "bytes_received_min": abs(_most(-stats.received_bytes, group)),
                "interior_rows_min": abs(_most(-stats.interior_rows, group)),
                "forward_ms": overlapped, "forward_backward_ms": trained,
                "serial_forward_ms": serial,
                "serial_forward_backward_ms": serial_trained}  # fmt: skip
    if method == "all_gather":

        def run():
            return _all_gather_attention(q, k, v, group, config.backend, **kw)

        return {"rows_received": (world - 1) * q.shape[2], "forward_ms": _time(run, config, group)}
    if variant not in ("full", "causal") or params:
        return None
    if q.device.type == "cpu":
        return {"rows_received": (world - 1) * q.shape[2], "forward_ms": None,
                "note": "no CPU kernel: torch's context_parallel has no sharding strategy for "
                        "aten._scaled_dot_product_flash_attention_for_cpu"}  # fmt: skip
    return {
        "rows_received": (world - 1) * q.shape[2],
        "forward_ms": _time_torch_ring(q, k, v, group, variant == "causal", config),
    }


def _all_gather_attention(q, k, v, group, backend, *, variant, **params):
    """Every rank's keys and values gathered, then this rank's queries against all of them."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    keys = [torch.empty_like(k) for _ in range(world)]
    values = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(keys, k.contiguous(), group=group)
    dist.all_gather(values, v.contiguous(), group=group)
    length = q.shape[2] * world
    pattern = resolve_pattern(variant, False, params)
    pattern = specialized(pattern, length, length, q.device)
    if pattern.per_head:
        pattern = with_heads(pattern, q.shape[1])
    layout = ShardLayout(world, q.shape[2], "contiguous")
    wrapper = _wrapper(pattern, layout, rank, q.device, q.shape[1])
    return zoo.attention(q, torch.cat(keys, 2), torch.cat(values, 2), variant=wrapper,
                         backend=backend)  # fmt: skip


_WRAPPERS: dict = {}


def _wrapper(pattern, layout, rank, device, heads) -> AtPositions:
    key = (id(pattern), layout, rank)
    if key not in _WRAPPERS:
        _WRAPPERS[key] = AtPositions(
            pattern, layout.positions(rank).to(device), torch.arange(layout.length, device=device),
            heads if pattern.per_head else None,
        )  # fmt: skip
    return _WRAPPERS[key]


def _time_torch_ring(q, k, v, group, causal, config) -> float:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    world = dist.get_world_size(group)
    mesh = DeviceMesh(q.device.type, list(range(world)))
    g = torch.Generator().manual_seed(0)  # the whole sequence, the same on every rank
    shape = (*q.shape[:2], q.shape[2] * world, q.shape[3])
    whole = [torch.randn(shape, generator=g).to(q.device, q.dtype) for _ in range(3)]

    def run():
        buffers = [t.clone() for t in whole]  # the context shards its buffers in place
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            return torch.nn.functional.scaled_dot_product_attention(*buffers, is_causal=causal)

    return _time(run, config, group)


def _time(run, config: CPConfig, group, inputs: tuple = ()) -> float:
    """The slowest rank's median time of ``run`` in ms (``_time_in_turns`` of it alone)."""
    return _time_in_turns([run], inputs, config, group)[0]


def _time_in_turns(runs, inputs, config: CPConfig, group) -> list[float]:
    """The slowest rank's median time in ms of each of ``runs``, run in turns in one loop so
    that the machine's drift reaches each alike: forward only, or, given the ``inputs`` they
    read, forward and the backward of the output's sum to those inputs."""
    for t in inputs:
        t.requires_grad_(True)
    times: list[list[float]] = [[] for _ in runs]
    with torch.set_grad_enabled(bool(inputs)):
        for i in range(config.warmup + config.repeats):
            for run, kept in zip(runs, times, strict=True):
                dist.barrier(group)
                start = time.perf_counter()
                out = run()
                if inputs:
                    out.sum().backward()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                if i >= config.warmup:
                    kept.append(time.perf_counter() - start)
    for t in inputs:
        t.requires_grad_(False)
        t.grad = None
    return [_most(statistics.median(kept) * 1e3, group) for kept in times]


def _peak_mib(run, inputs, group) -> float:
    """The largest rank's peak memory of one forward and backward (MiB above what was allocated
    before it: the shards' gradients, what was fetched, the attention's own buffers)."""
    for t in inputs:
        t.requires_grad_(True)
    dist.barrier(group)
    peak = peak_memory_mb(lambda: run().sum().backward(), inputs[0].device)
    for t in inputs:
        t.requires_grad_(False)
        t.grad = None
    return _most(peak, group)


def _most(value: float, group) -> float:
    """The largest value over the ranks."""
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def _write(config: CPConfig, rows: list[dict], command: str) -> None:
    """bench-cp.json and bench-cp.md in ``out``, with the rows of other N that an earlier run of
    the same settings left there (torchrun runs one N at a time: runs at 1, 2 and 4 processes
    into one ``out`` make one report, and the fit of peak memory against N)."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [*_earlier_rows(out / "bench-cp.json", config, rows), *rows]
    (out / "bench-cp.json").write_text(
        json.dumps({"command": command, "config": asdict(config), "rows": rows}, indent=1) + "\n"
    )
    (out / "bench-cp.md").write_text(markdown(config, rows, command))
    print(markdown(config, rows, command))


def _earlier_rows(path: Path, config: CPConfig, rows: list[dict]) -> list[dict]:
    """The rows of ``path`` at an N that ``rows`` lacks, where it was made with the same settings
    (all but ``worlds``) on the same device; none otherwise."""
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    same = {**earlier.get("config", {}), "worlds": None} == {**asdict(config), "worlds": None}
    worlds, devices = {r["world"] for r in rows}, {r["device"] for r in rows}
    return [
        r for r in earlier.get("rows", [])
        if same and r["world"] not in worlds and r["device"] in devices
    ]  # fmt: skip


def markdown(config: CPConfig, rows: list[dict], command: str) -> str:
    def ms(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [
        "# Context parallelism: bytes received per rank and time",
        "",
        f"`{command}`. B={config.batch}, H={config.heads}, D={config.head_dim}; "
        f"{rows[0]['device'] if rows else ''}. MiB: what a rank receives (k and v; for zoo also "
        "wide query rows shipped to it and the partials of its own), the most and the least "
        "over the ranks. "
        "Time: the slowest rank's median forward (and forward+backward for zoo), ms; the ranks "
        "share the machine's cores, so compare methods within a row group, not across N.",
        "",
        "| variant | L | N | method | MiB received max / min | pairs/rank max / min | fwd ms |"
        " fwd+bwd ms |"
        " note |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        pairs = f"{r['pairs_max']:.3g} / {r['pairs_min']:.3g}" if "pairs_max" in r else "-"
        lines.append(
            f"| {r['variant']} | {r['length']} | {r['world']} | {r['method']} | "
            f"{r['mib_received']:.2f} / {r['mib_received_min']:.2f} | {pairs} | "
            f"{ms(r.get('forward_ms'))} | "
            f"{ms(r.get('forward_backward_ms'))} | {r.get('note', '')} |"
        )
    tables = [bytes_table(rows), balance_table(rows), memory_table(rows), overlap_table(rows)]
    return "\n".join([*lines, *(line for table in tables if table for line in ["", *table])]) + "\n"


def _cell(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["variant"], r["world"], r["method"], r["length"]): r for r in rows}


def bytes_table(rows: list[dict]) -> list[str]:
    """Bytes received per rank, MiB: a row per (variant, N), zoo's most / least over the ranks
    at each length, then the all-gather's and the ring's (every rank alike)."""
    cells, lengths = _cell(rows), sorted({r["length"] for r in rows})
    pairs = list(dict.fromkeys((r["variant"], r["world"]) for r in rows))
    pairs.sort(key=lambda vw: vw[1])
    header = ["variant", "N"]
    for method in ("zoo (max / min)", "all-gather", "ring"):
        header += [f"{method}, L={length}" for length in lengths]
    lines = [
        "## Bytes received per rank",
        "",
        "MiB of keys and values (and, for zoo, shipped query rows and their partials) a rank "
        "receives; zoo: the most / the least over the ranks.",
        "",
        "| " + " | ".join(header) + " |",
        "| --- | ---: |" + " ---: |" * (3 * len(lengths)),
    ]
    for variant, world in pairs:
        row = [variant, str(world)]
        for method in ("zoo", "all_gather", "torch_ring"):
            for length in lengths:
                r = cells.get((variant, world, method, length))
                if r is None:
                    row.append("-")
                elif method == "zoo":
                    row.append(f"{r['mib_received']:.2f} / {r['mib_received_min']:.2f}")
                else:
                    row.append(f"{r['mib_received']:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def balance_table(rows: list[dict]) -> list[str]:
    """Causal load balance: pairs per rank, the most / the least, contiguous against head_tail,
    at the longest length."""
    cells = _cell(rows)
    causal = [r for r in rows if r["variant"] == "causal" and r["method"] == "zoo"]
    if not causal:
        return []
    length = max(r["length"] for r in causal)
    lines = [
        "## Causal load balance",
        "",
        f"Pairs per rank under `causal`, the most / the least over the ranks, L={length}.",
        "",
        "| N | contiguous | head_tail |",
        "| ---: | ---: | ---: |",
    ]
    for world in sorted({r["world"] for r in causal}):
        shown = []
        for method in ("zoo", "zoo_head_tail"):
            r = cells.get(("causal", world, method, length))
            shown.append("-" if r is None else f"{r['pairs_max']:.3g} / {r['pairs_min']:.3g}")
        lines.append(f"| {world} | {shown[0]} | {shown[1]} |")
    return lines


def memory_table(rows: list[dict]) -> list[str]:
    """Peak memory per rank of zoo's forward and backward against N at the longest length, and
    the exponent of its fit to N (-1: it falls as 1/N)."""
    zoo_rows = [r for r in rows if r["method"] == "zoo" and r.get("peak_mib") is not None]
    if not zoo_rows:
        return []
    length = max(r["length"] for r in zoo_rows)
    cells, worlds = _cell(zoo_rows), sorted({r["world"] for r in zoo_rows})
    lines = [
        "## Peak memory per rank",
        "",
        f"MiB above the inputs, the largest rank's, of one forward and backward at L={length}; "
        "the exponent is the slope of log(peak) on log(N) (-1: the peak falls as 1/N); a + b/N is "
        "the least-squares fit of a part that does not shrink with the shard (a) and one that "
        "does (b); '-' where the fit needs a < 0 (the peak falls faster than 1/N).",
        "",
        "| variant | " + " | ".join(f"N={world}" for world in worlds) + " | exponent | a + b/N |",
        "| --- |" + " ---: |" * (len(worlds) + 2),
    ]
    for variant in dict.fromkeys(r["variant"] for r in zoo_rows):
        peaks = [cells.get((variant, world, "zoo", length), {}).get("peak_mib") for world in worlds]
        slope = fit_exponent(worlds, peaks, last=len(worlds))
        shown = ["-" if p is None else f"{p:.1f}" for p in peaks]
        shown.append("-" if slope is None else f"{slope:.2f}")
        fit = _fit_inverse(worlds, peaks)
        # a < 0: the peak falls faster than 1/N, which no fixed part explains.
        shown.append("-" if fit is None or fit[0] < 0 else f"{fit[0]:.1f} + {fit[1]:.1f}/N")
        lines.append(f"| {variant} | " + " | ".join(shown) + " |")
    return lines


def overlap_table(rows: list[dict]) -> list[str]:
    """The overlap's effect: each (variant, L, N) timed with every row waiting for the exchange
    (serial) and with the interior rows computed while it is in flight, in turns in one run."""
    timed = [r for r in rows if r["method"] == "overlap"]
    if not timed:
        return []
    lines = [
        "## Overlap",
        "",
        "Median ms of the slowest rank, `overlap=False` (serial) and `overlap=True` (overlapped), "
        "timed in turns in one loop; ratio: overlapped / serial (below 1: the overlap saves "
        "time). Interior rows: the fewest query rows any rank computes while the exchange is in "
        "flight.",
        "",
        "| variant | L | N | interior rows | fwd serial | fwd overlapped | ratio | fwd+bwd serial "
        "| fwd+bwd overlapped | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in timed:
        cells = []
        for kind in ("forward_ms", "forward_backward_ms"):
            serial, overlapped = r[f"serial_{kind}"], r[kind]
            cells += [f"{serial:.1f}", f"{overlapped:.1f}", f"{overlapped / serial:.2f}"]
        lines.append(
            f"| {r['variant']} | {r['length']} | {r['world']} | {r['interior_rows_min']:.0f} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def _fit_inverse(worlds: list[int], peaks: list[float | None]) -> tuple[float, float] | None:
    """(a, b) of the least-squares fit peak = a + b / N, or None with fewer than two points."""
    points = [(1 / n, p) for n, p in zip(worlds, peaks, strict=True) if p is not None]
    if len({x for x, _ in points}) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b
