"""``python -m eval bench-overhead [CONFIG.yaml] [key=value ...]``: the host time a call adds
around the kernel, in microseconds.

On a GPU a call is its kernel launches plus the host work around them; where the kernel is short
(a sparse pattern at 8K tokens), host time decides. Measured here with the kernel replaced by a
stub that returns a preallocated output: what is left is the zoo's own work per call (resolving
the variant, checking the inputs, finding the per-shape structures, choosing and calling the
backend), the same on any device, so a CPU measures it. Each cell times the zoo call and the bare
stub call in turns, ``repeats`` of each, and reports medians and their difference.

Each cell also counts the operations one call dispatches (views included, once, untimed):
on a GPU each is host work (a dispatch, a kernel launch where it computes), so the count is
the call's host cost in a form no machine's speed changes. A flex cell also gives its block
mask's full and partial blocks per sequence and head (``FlexBackend.block_counts``): in a
partial block the kernel evaluates the mask for every element.

Backends: flex (``zoo.backends.flex_kernel``'s kernel stubbed), sdpa
(``scaled_dot_product_attention`` stubbed), and blocked with its kernels with log-sum-exp
stubbed through their CUDA wrapping (``zoo.testing.shape_only_kernels``: MoBA's runs by key
block packed and stacked as on a GPU). Blocked's other operations (the choice, the runs'
bookkeeping) still compute on the CPU, so its time there is not host time; its operation count
is the figure to read. Writes ``overhead.json`` (after every cell: a run stopped at a time
limit keeps the cells it measured) and ``overhead.md``.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

import torch

import zoo
from zoo.backends import get_backend, lse_kernel
from zoo.functional import prepare_call
from zoo.testing.shape_only_kernels import OperationCount, ShapeOnlyEfficientOps

from ..harness.config import ConfigError, config_arguments, load_config
from ..harness.distributed import device_name, pick_device, thread_count
from .measure import failed_cell
from .run import write_whole

STUBBED = {
    "flex": "zoo.backends.flex_kernel._kernel",
    "sdpa": "torch.nn.functional.scaled_dot_product_attention",
    "blocked": "zoo.backends.lse_kernel.KERNELS",
}


@dataclass
class OverheadConfig:
    variants: list[str] = field(
        default_factory=lambda: ["local", "longformer", "bigbird", "block_local", "causal"]
    )
    params: dict[str, dict] = field(default_factory=lambda: {"local": {"window_size": 256}})
    backends: list[str] = field(default_factory=lambda: ["flex"])
    lengths: list[int] = field(default_factory=lambda: [8192])
    batch: int = 1
    heads: int = 16
    head_dim: int = 64
    repeats: int = 300
    device: str = "cpu"
    threads: int = 1
    out: str = "eval/results/overhead-{device}"


class _Stub:
    """A kernel that returns a preallocated (B, H, Lq, Dv) output, whatever it is given (and a
    log-sum-exp where it is asked for one)."""

    def __init__(self) -> None:
        self.outputs: dict[tuple, torch.Tensor] = {}

    def __call__(self, q, k, v, *args, **kwargs):
        key = (tuple(q.shape[:-1]), v.shape[-1], q.dtype, q.device)
        if key not in self.outputs:
            self.outputs[key] = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype,
                                            device=q.device)  # fmt: skip
        out = self.outputs[key]
        if "return_aux" in kwargs or kwargs.get("return_lse"):  # and its log-sum-exp
            return out, out.new_zeros(out.shape[:-1], dtype=torch.float32)
        return out


def measure(config: OverheadConfig, variant: str, backend: str, n: int, device) -> dict:
    """Medians (us) of the zoo call and of the bare stub, timed in turns."""
    shape = (config.batch, config.heads, n, config.head_dim)
    q, k, v = (torch.randn(shape, device=device) for _ in range(3))
    stub = _Stub()
    kwargs = dict(variant=variant, backend=backend, **config.params.get(variant, {}))
    with ExitStack() as stack:
        if backend == "flex":
            stack.enter_context(mock.patch(STUBBED["flex"], lambda *args: stub))
        elif backend == "blocked":
            shape_only = lse_kernel.cuda_kernel(ShapeOnlyEfficientOps())
            stack.enter_context(mock.patch.dict(STUBBED["blocked"], {device.type: shape_only}))
            stack.enter_context(mock.patch(STUBBED["sdpa"], stub))  # its fused parts call SDPA
        else:
            stack.enter_context(mock.patch(STUBBED["sdpa"], stub))
        for _ in range(3):  # the per-shape structures are built here, not timed
            zoo.attention(q, k, v, **kwargs)
        with OperationCount() as counted:
            zoo.attention(q, k, v, **kwargs)
        zoo_us, stub_us = [], []
        for _ in range(config.repeats):
            start = time.perf_counter()
            zoo.attention(q, k, v, **kwargs)
            middle = time.perf_counter()
            stub(q, k, v)
            zoo_us.append((middle - start) * 1e6)
            stub_us.append((time.perf_counter() - middle) * 1e6)
    zoo_median, stub_median = statistics.median(zoo_us), statistics.median(stub_us)
    cell = {
        "variant": variant, "backend": backend, "n": n, "zoo_us": round(zoo_median, 2),
        "stub_us": round(stub_median, 2), "added_us": round(zoo_median - stub_median, 2),
        "ops": counted.count,
    }  # fmt: skip
    if backend == "flex":  # its block mask: in a partial block the mask runs per element
        call = prepare_call(
            q, k, v, **{key: val for key, val in kwargs.items() if key != "backend"}
        )
        full, partial, blocks = get_backend("flex").block_counts(call)
        cell["blocks"] = {"full": full, "partial": partial, "all": blocks}
    return cell


def markdown(data: dict) -> str:
    h = data["header"]
    lines = [
        f"# Host time a call adds around the kernel ({h['device']})",
        "",
        f"`{h['command']}`, torch {h['torch']}: B={h['config']['batch']}, "
        f"H={h['config']['heads']}, D={h['config']['head_dim']}, float32, forward; medians of "
        f"{h['config']['repeats']} calls, the zoo call and the bare stub kernel in turns.",
        "",
        "| variant | backend | n | zoo call (us) | bare kernel stub (us) | added (us) | ops "
        "| flex blocks: full / partial / all |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in data["cells"]:
        if c.get("status", "ok") != "ok":
            lines.append(f"| {c['variant']} | {c['backend']} | {c['n']} | {c['status']}: "
                         f"{c['reason'][:80]} | | | | |")  # fmt: skip
            continue
        b = c.get("blocks")
        blocks = f"{b['full']:.4g} / {b['partial']:.4g} / {b['all']}" if b else "-"
        lines.append(
            f"| {c['variant']} | {c['backend']} | {c['n']} | {c['zoo_us']:.1f} | "
            f"{c['stub_us']:.1f} | {c['added_us']:.1f} | {c.get('ops', '-')} | {blocks} |"
        )
    if any(c["backend"] == "blocked" for c in data["cells"]):
        lines += [
            "",
            "blocked: its kernels stubbed through their CUDA wrapping; its other operations "
            "computed on this CPU, so read its operation count, not its time.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path, items = config_arguments(
        "python -m eval bench-overhead", __doc__.split(":")[0], argv, "lengths=[4096,8192]"
    )
    try:
        config = load_config(OverheadConfig, path, items)
        unknown = [b for b in config.backends if b not in STUBBED]
        if unknown:
            raise ConfigError(f"backends must be among {', '.join(STUBBED)}, got {unknown}")
        device = pick_device(config.device)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = Path(config.out.format(device=device.type))
    out.mkdir(parents=True, exist_ok=True)
    header = {
        "device": device_name(device), "torch": torch.__version__, "config": asdict(config),
        "command": shlex.join(["python", "-m", "eval", "bench-overhead", *argv]),
    }  # fmt: skip
    cells: list[dict] = []
    data = {"header": header, "cells": cells}
    with thread_count(config.threads):
        for variant in config.variants:
            for backend in config.backends:
                for n in config.lengths:
                    try:
                        cells.append(measure(config, variant, backend, n, device))
                    except Exception as error:  # recorded with its reason; the others still run
                        cells.append(failed_cell(error, variant=variant, backend=backend, n=n))
                    print(json.dumps(cells[-1]), flush=True)
                    # after every cell: a run stopped at its time limit keeps those it measured
                    write_whole(out / "overhead.json", data)
    write_whole(out / "overhead.json", data)
    (out / "overhead.md").write_text(markdown(data))
    print(f"wrote {out}/overhead.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
