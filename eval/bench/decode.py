"""``python -m eval bench-decode [CONFIG.yaml] [key=value ...]``: one generation step against a
cache of n tokens, time and memory, for each variant and context length, beside the peers.

Each cell fills a cache to n tokens (``zoo.new_cache``; the keys are written as a prefill would
write them, without computing its attention) and times one step of one new token per sequence with
``zoo.attention(..., cache=cache)`` (the median of ``repeats`` steps after ``warmup``, each a
token further on). Memory is the cache's ``nbytes``: what the variant keeps at that length.

Zoo decoding backends (``backends``): ``auto`` (sdpa, the impl ``zoo:VARIANT``), ``flex``
(``zoo:VARIANT:flex``, ``zoo.backends.flex_decode``: compiled FlexAttention with a block mask over
the cache's slots, made at each step), on CUDA only, for the reason ``flex_sliced`` is, and
``sdpa_whole`` (``zoo:VARIANT:sdpa_whole``: sdpa without its split of many masked slots into
runs, ``zoo.backends.split_keys``; the same as auto where the step does not split, as on a CPU).

Peers, one query against all n cached keys and values of full attention:
- ``sdpa_dense``: ``scaled_dot_product_attention`` without a mask (what a dense decoder runs);
- ``flex_sliced``: compiled FlexAttention with the variant's block mask for the one query row
  (``create_block_mask`` at Q_LEN=1, built outside the timing), on CUDA only: on the CPU a
  compile per length costs minutes and the CPU kernel pads the query to a whole block.

The step is checked against the reference decoding backend on the same cache (max abs error).
With ``compile: [false, true]`` each zoo step is also timed under ``torch.compile`` (impl
``zoo:VARIANT+compile``; its warm-up steps compile, twice, after which the lengths are dynamic),
in ``compile_mode`` (``reduce-overhead``: CUDA graphs). ``static_cache: true`` makes the caches
static (``zoo.new_cache(static=True)``: every step of one shape, all slots read and masked), so
that a compiled step is one graph, one CUDA graph in ``reduce-overhead``, for every step.
With ``profile`` = N > 0, each zoo cell also runs N steps under ``torch.profiler`` and N under
cProfile after its timing (``eval.bench.profile.profile_calls``): its kernels, the host's gaps
between them, the top kernels and the top host functions per step, so that a step's time on a
GPU says where it goes (a step that took tens of ms against SDPA's tenths). The header's
``one_kernel_ms`` is the smallest step there is on the machine (one kernel on one element, timed
as the steps are): a window's memory floor (about 1.3 us for 257 keys at B=8, 4 key/value heads,
D=128, bf16 on an H100) lies below it. Writes ``bench-decode.json`` and ``bench-decode.md`` in
``out``.
"""

from __future__ import annotations

import itertools
import json
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

import zoo
from zoo.backends import SdpaBackend
from zoo.core.arguments import suggest
from zoo.functional import resolve_pattern
from zoo.patterns import RouteInputs

from ..harness.config import ConfigError, config_arguments, load_config
from ..harness.distributed import device_name, pick_device
from .config import DTYPES, check_distinct
from .measure import failed_cell
from .profile import profile_calls
from .run import write_whole

PEERS = ("sdpa_dense", "flex_sliced")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The decoding backends a cell may name: auto, flex, and sdpa without its split of the keys
BACKENDS = {"auto": "auto", "flex": "flex", "sdpa_whole": SdpaBackend(split_keys=False)}


@dataclass
class DecodeConfig:
    variants: list[str] = field(default_factory=lambda: ["causal", "sliding_window", "longformer"])
    # zoo decoding: auto, flex, sdpa_whole (BACKENDS)
    backends: list[str] = field(default_factory=lambda: ["auto"])
    peers: list[str] = field(default_factory=lambda: ["sdpa_dense"])
    lengths: list[int] = field(default_factory=lambda: [1024 * 2**i for i in range(7)])
    batch: int = 1
    heads: int = 8
    kv_heads: int | None = None
    head_dim: int = 64
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU
    warmup: int = 3
    repeats: int = 20
    threads: int = 0  # CPU threads for torch; 0 keeps torch's default
    params: dict[str, dict] = field(default_factory=dict)
    device: str = "auto"
    out: str = "eval/results/bench-decode-{device}"
    profile: int = 0  # steps of each zoo cell under the profiler (and as many under cProfile)
    # each zoo step eager (false) and/or under torch.compile (true, impl "...+compile")
    compile: list[bool] = field(default_factory=lambda: [False])
    compile_mode: str = "default"  # torch.compile's mode: "reduce-overhead" runs CUDA graphs
    # caches of fixed step shapes (zoo.new_cache(static=True)): every slot read, masked; a
    # compiled step is then one graph (static shapes) for every step
    static_cache: bool = False


def _timed(step, device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``step()`` (synchronised on CUDA)."""
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def one_kernel_ms(device: torch.device, repeats: int = 200) -> float:
    """Median milliseconds of the smallest step there is, one kernel on one element, timed as
    the steps are (synchronised on CUDA): the least any step costs on this machine, which a
    step reading few keys (a window) meets long before its memory floor."""
    x = torch.zeros(1, device=device)
    return _timed(lambda: x.add_(1), device, 10, repeats)


def _fill(cache, n: int, generator: torch.Generator) -> None:
    """Write n tokens of random keys and values, as a prefill would keep them."""
    b, h, _, d = cache.keys.shape
    for start in range(0, n, 8192):  # in pieces: a 64K prefill's keys need not exist at once
        t = min(8192, n - start)
        k, v = (torch.randn(b, h, t, d, generator=generator).to(cache.keys) for _ in range(2))
        positions = cache.next_positions(t)
        cache.write(k, v, positions, torch.ones_like(positions, dtype=torch.bool))
        cache.advance(torch.full((b,), t, device=k.device), t, full=True)  # the host's bound too


def measure(config: DecodeConfig, variant: str, n: int, device, dtype) -> list[dict]:
    kv_heads = config.kv_heads or config.heads
    params = dict(config.params.get(variant, {}))
    gen = torch.Generator().manual_seed(0)
    # The check's step, the timed ones, a compiled step's own check, and the profiled ones (the
    # first outside the profiler)
    steps = config.warmup + config.repeats + 3 + 2 * config.profile
    cache = zoo.new_cache(variant, batch_size=config.batch, max_len=n + steps, device=device,
                          num_kv_heads=kv_heads, head_dim=config.head_dim, dtype=dtype,
                          static=config.static_cache, **params)  # fmt: skip
    _fill(cache, n, gen)

    def new(heads):
        return torch.randn(config.batch, heads, 1, config.head_dim, generator=gen).to(device, dtype)

    q, k, v = new(config.heads), new(kv_heads), new(kv_heads)
    kw = dict(variant=variant, causal=True, **params)
    # The check: sdpa and the reference decoding path on copies of one cache, one step each.
    twin = cache.clone()
    out = zoo.attention(q, k, v, cache=cache, backend="sdpa", **kw)
    ref = zoo.attention(q, k, v, cache=twin, backend="reference", **kw)
    error = float((out.float() - ref.float()).abs().max())
    cells = []
    for backend, compiled in itertools.product(config.backends, config.compile):
        impl = f"zoo:{variant}" if backend == "auto" else f"zoo:{variant}:{backend}"
        impl += "+compile" if compiled else ""
        cell = dict(impl=impl, variant=variant, n=n, bytes=cache.nbytes, slots=cache.keys.shape[2])
        if backend == "flex" and device.type != "cuda":
            cells.append({**cell, "ms": None, "status": "skipped: compiled flex is CUDA-only here"})
            continue
        try:  # a cell that fails is recorded under its own name (a compiled step's as such)
            measured = _step_cell(
                {**cell}, config, backend, compiled, cache, (q, k, v), params, error
            )
            cells.append(measured)
        except Exception as failed:
            cells.append(failed_cell(failed, **cell))
    for peer in config.peers:
        cells.append(_peer(peer, config, variant, params, n, device, dtype, gen, q))
    return cells


def _step_cell(cell, config, backend, compiled, cache, qkv, params, error) -> dict:
    """One (backend, compiled) cell of ``measure``: its check, its time, its profile; ``error``
    is sdpa's against the reference, auto's check."""
    (q, k, v), variant, n, device = qkv, cell["variant"], cell["n"], qkv[0].device
    kw = dict(variant=variant, causal=True, **params)
    if backend != "auto":  # its own check against the reference, on another copy
        twin = cache.clone()
        got = zoo.attention(q, k, v, cache=cache.clone(), backend=BACKENDS[backend], **kw)
        ref = zoo.attention(q, k, v, cache=twin, backend="reference", **kw)
        cell["error"] = float((got.float() - ref.float()).abs().max())
    else:
        cell["error"] = error
    several = len(config.backends) * len(config.compile) > 1
    timed = cache.clone() if several else cache  # each its own steps

    def step(backend=BACKENDS[backend], timed=timed):
        return zoo.attention(q, k, v, cache=timed, backend=backend, **kw)

    if compiled:  # the warm-up steps compile (twice: then the lengths are dynamic; once
        # with a static cache, whose steps keep their shapes)
        dynamic = False if config.static_cache else None
        step = torch.compile(step, mode=config.compile_mode, dynamic=dynamic)
    cell["ms"] = _timed(step, device, config.warmup, config.repeats)
    if compiled:  # its own output, against the reference on a copy of its cache
        twin = timed.clone()
        ref = zoo.attention(q, k, v, cache=twin, backend="reference", **kw)
        cell["error"] = float((step().float() - ref.float()).abs().max())
    if config.profile:
        cell["profile"] = profile_calls(step, device, 0, config.profile)
    if resolve_pattern(variant, True, dict(params)).routed:  # at goals' middle timed step
        middle = n + 1 + config.warmup + config.repeats // 2
        kv_heads = config.kv_heads or config.heads
        cell["keys_read"] = routed_keys_read(variant, params, q, timed, kv_heads, middle)
    return cell


def routed_keys_read(
    variant: str, params: dict, q: Tensor, cache, kv_heads: int, position: int
) -> float:
    """The keys the step at ``position`` read per key/value head (its query q, every timed
    step's, against keys 0 .. position, which the cache holds), for a pattern chosen by content
    (MoBA): the union of what the query heads sharing a key/value head chose (each its own
    blocks), averaged over rows and key/value heads. The goals' memory floor reads it
    (``eval.bench.goals.keys_read``, at the middle timed step): for a fixed pattern the floor
    follows from the pattern alone, here from the choice. Slot j holds position j."""
    length = position + 1
    keys = cache.keys[:, :, :length]
    positions = torch.full((q.shape[0], 1), position, device=q.device)  # (B, 1)
    pattern = resolve_pattern(variant, True, dict(params)).bind(
        RouteInputs(q, keys, None, causal=True, q_pos=positions)
    )
    b, heads = q.shape[0], q.shape[1]
    allowed = pattern.allowed_at(
        torch.arange(b, device=q.device)[:, None, None, None],
        torch.arange(heads, device=q.device)[None, :, None, None],
        positions[:, None, :, None], torch.arange(length, device=q.device)[None, None, None, :],
    )  # fmt: skip
    per_kv = allowed.expand(b, heads, 1, length).reshape(b, kv_heads, -1, length).any(2)
    return float(per_kv.sum(-1).float().mean())


def _peer(peer, config, variant, params, n, device, dtype, gen, q) -> dict:
    kv_heads = config.kv_heads or config.heads
    k, v = (torch.randn(config.batch, kv_heads, n + 1, config.head_dim, generator=gen).to(
        device, dtype) for _ in range(2))  # fmt: skip
    cell = dict(impl=peer, variant=variant, n=n, bytes=2 * k.numel() * k.element_size())
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if peer == "sdpa_dense":
        groups = config.heads // kv_heads
        cell["ms"] = _timed(lambda: sdpa(q, k, v, enable_gqa=groups > 1), device, config.warmup,
                            config.repeats)  # fmt: skip
        return cell
    if device.type != "cuda":
        return {**cell, "ms": None, "status": "skipped: compiled flex decoding is CUDA-only here"}
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from zoo.layout.block_layout import specialized

    pattern = specialized(resolve_pattern(variant, True, dict(params)), 1, n + 1, device)
    if pattern.routed:
        return {**cell, "ms": None, "status": "skipped: chosen by content, no fixed block mask"}
    pattern = pattern.for_heads(config.heads)  # a pattern per head (BigBird) draws each head's
    mask_heads = config.heads if pattern.per_head else None
    mask = create_block_mask(pattern.mask_mod(1, n + 1), None, mask_heads, 1, n + 1, device=device)
    flex = torch.compile(flex_attention, dynamic=False)
    groups = config.heads // kv_heads
    cell["ms"] = _timed(lambda: flex(q, k, v, block_mask=mask, enable_gqa=groups > 1), device,
                        config.warmup, config.repeats)  # fmt: skip
    return cell


def label(n: int) -> str:
    """A length as a column's label, exact: 16K, 1.5K, and 512, 768 or 1000 as they are (n // 1024
    showed 512 and 768 both as "0K", and 1536 as "1K")."""
    k = f"{n / 1024:g}"
    return f"{k}K" if n >= 1024 and float(k) * 1024 == n else str(n)


def markdown(header: dict, cells: list[dict]) -> str:
    lengths = sorted({c["n"] for c in cells})
    impls = list(dict.fromkeys((c["variant"], c["impl"]) for c in cells))
    lines = [
        f"# Decode step: one token against a cache of n tokens ({header['device']})",
        "",
        f"`{header['command']}`; {header['shape']}, median of {header['repeats']} steps. "
        "Time in ms; memory of the cache (zoo) or of the full K and V (peers) in MiB. "
        f"One kernel on one element, timed as a step: {header['one_kernel_ms'] * 1e3:.3g} us.",
        "",
        "| variant | impl | " + " | ".join(f"{label(n)} ms" for n in lengths) + " | "
        + " | ".join(f"{label(n)} MiB" for n in lengths) + " |",
        "|" + "---|" * (2 + 2 * len(lengths)),
    ]  # fmt: skip
    for variant, impl in impls:
        row = {c["n"]: c for c in cells if c["variant"] == variant and c["impl"] == impl}
        ms = [f"{row[n]['ms']:.3f}" if row.get(n, {}).get("ms") else "-" for n in lengths]
        mib = [f"{row[n]['bytes'] / 2**20:.2f}" if "bytes" in row.get(n, {}) else "-"
               for n in lengths]  # fmt: skip
        lines.append(f"| {variant} | {impl} | " + " | ".join(ms + mib) + " |")
    worst = max((c.get("error", 0.0) for c in cells), default=0.0)
    lines += ["", f"Largest error of a zoo step against the reference decoding path: {worst:.1e}."]
    return "\n".join(lines + _profile_lines(cells)) + "\n"


def _profile_lines(cells: list[dict]) -> list[str]:
    """Where each profiled step's time goes (``profile`` > 0): per step, in ms."""
    profiled = [c for c in cells if c.get("profile", {}).get("steps")]
    if not profiled:
        return []
    lines = [
        "",
        "## Where a step's time goes",
        "",
        "Per step under the profiler: its wall time, the time some kernel ran, the host's time "
        "between kernels, before the first and after the last, kernels launched; the top "
        f"kernels and host functions by time ({profiled[0]['profile']['activity']}).",
        "",
        "| variant | impl | n | step ms | kernel ms | gap ms | lead ms | tail ms | kernels "
        "| top kernels (ms) | top host functions (ms) |",
        "|" + "---|" * 11,
    ]
    for c in profiled:
        p = c["profile"]
        top = "; ".join(f"{k['name'][:50]} {k['ms']:.3f}" for k in p["top"][:3])
        host = "; ".join(f"{h['function'][-50:]} {h['ms']:.3f}" for h in p.get("host", [])[:3])
        lines.append(
            f"| {c['variant']} | {c['impl']} | {c['n']} | {p['step_ms']:.3f} | "
            f"{p['kernel_ms']:.3f} | {p['gap_ms']:.3f} | {p['lead_ms']:.3f} | {p['tail_ms']:.3f} "
            f"| {p['kernels']:.0f} | {top} | {host} |"
        )
    return lines


def check_config(config: DecodeConfig, source: str) -> None:
    """Names and values, as ``bench`` checks its own: an empty axis was an empty run (exit 0, no
    JSON; ``compile: []`` timed no zoo step), a length below 1 was timed, a repeated one timed
    twice, and kv_heads that does not divide heads failed in every cell."""
    for peer in config.peers:
        if peer not in PEERS:
            raise ConfigError(f"{source}: peers: unknown peer {peer!r}; known: {', '.join(PEERS)}")
    for backend in config.backends:
        if backend not in BACKENDS:
            raise ConfigError(f"{source}: backends: unknown decoding backend {backend!r}; known: "
                              f"{', '.join(BACKENDS)}")  # fmt: skip
    if config.compile_mode not in MODES:
        raise ConfigError(f"{source}: compile_mode: {config.compile_mode!r} is not one of "
                          f"torch.compile's modes: {', '.join(MODES)}")  # fmt: skip
    if config.dtype not in ("auto", *DTYPES):
        raise ConfigError(f"{source}: dtype must be auto or one of {', '.join(DTYPES)}, got "
                          f"{config.dtype!r}")  # fmt: skip
    for key, value, least in (("repeats", config.repeats, 1), ("warmup", config.warmup, 0),
                              ("batch", config.batch, 1), ("heads", config.heads, 1),
                              ("head_dim", config.head_dim, 1)):  # fmt: skip
        if value < least:
            raise ConfigError(f"{source}: {key} must be >= {least}, got {value}")
    for key in ("variants", "lengths", "compile"):
        if not getattr(config, key):
            raise ConfigError(f"{source}: {key} must list at least one value, got []")
    if not config.backends and not config.peers:
        raise ConfigError(f"{source}: backends and peers are both empty: nothing to time")
    if any(n < 1 for n in config.lengths):
        raise ConfigError(f"{source}: lengths must be positive ints, got {config.lengths!r}")
    for key in ("variants", "backends", "peers", "lengths", "compile"):
        check_distinct(source, key, getattr(config, key))
    if config.kv_heads is not None and (config.kv_heads < 1 or config.heads % config.kv_heads):
        raise ConfigError(f"{source}: kv_heads must divide heads ({config.heads}) or be null, "
                          f"got {config.kv_heads!r}")  # fmt: skip
    known = zoo.list_attention()
    for variant in config.variants:
        if variant not in known:
            message = suggest("variant", variant, known, "zoo.list_attention()")
            raise ConfigError(f"{source}: variants: {message}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path, items = config_arguments(
        "python -m eval bench-decode", __doc__.split(":")[0], argv, "repeats=5"
    )
    try:
        config = load_config(DecodeConfig, path, items)
        check_config(config, path or "defaults")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    device = pick_device(config.device)
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = auto if config.dtype == "auto" else DTYPES[config.dtype]
    if config.threads:
        torch.set_num_threads(config.threads)
    out = Path(config.out.format(device=device.type))
    out.mkdir(parents=True, exist_ok=True)
    header = {
        "device": device_name(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": shlex.join(["python", "-m", "eval", "bench-decode", *argv]),
        "shape": f"B={config.batch}, H={config.heads}, H_kv={config.kv_heads or config.heads}, "
        f"D={config.head_dim}, {str(dtype).removeprefix('torch.')}",
        "repeats": config.repeats,
        "config": asdict(config),
        "one_kernel_ms": one_kernel_ms(device),
    }
    cells: list[dict] = []
    for variant in config.variants:
        for n in config.lengths:
            try:
                measured = measure(config, variant, n, device, dtype)
            except Exception as error:  # recorded with its reason; the others still run
                measured = [failed_cell(error, impl=f"zoo:{variant}", variant=variant, n=n)]
            cells += measured
            print(json.dumps(measured[0]), flush=True)
            write_whole(out / "bench-decode.json", {"header": header, "cells": cells}, indent=None)
    (out / "bench-decode.md").write_text(markdown(header, cells))
    print(f"wrote {out / 'bench-decode.md'}")
    return 0
