"""``python -m eval bench-compiles [CONFIG.yaml] [key=value ...]``: how many compiles distinct
sequence lengths of one pattern and head layout cost through ``zoo.attention(..., backend="flex")``.

One call per length (20 distinct lengths by default, none a multiple of another's block count, in
the order given), in a fresh process, on the same variant, parameters, batch, heads and head size.
A compile is a graph that dynamo made: the growth of ``torch._dynamo.utils.counters["stats"]
["unique_graphs"]`` across the call, or of ``counters["frames"]["ok"]`` (frames converted) where
that grew more; both are dynamo's own counters, whatever backend compiles the graph (inductor on a
GPU; the tests count through the "eager" backend on a CPU, where inductor takes seconds a graph).
Dynamo's recompile limits are raised first (as ``bench`` does): past them a length would fall back
to eager silently and count no compile. The campaign's goal (d): at most 2 compiles for 20 lengths.

Writes ``compiles.json`` (rewritten after every length, so a run cut short keeps what it counted)
and ``compiles.md`` in ``out``.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import zoo

from ..harness.config import ConfigError, config_arguments, load_config
from ..harness.distributed import device_name, pick_device, thread_count
from .config import DTYPES
from .run import compiler_settings, write_whole


@dataclass
class CompilesConfig:
    variant: str = "local"
    params: dict = field(default_factory=lambda: {"window_size": 256})
    backend: str = "flex"
    lengths: list[int] = field(default_factory=lambda: [1000 + 371 * i for i in range(20)])
    causal: bool = False
    backward: bool = False  # forward+backward calls (the backward's graphs count too)
    batch: int = 1
    heads: int = 16
    head_dim: int = 64
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    threads: int = 0
    out: str = "eval/results/compiles-{device}"


def graph_counts() -> dict[str, int]:
    """Dynamo's counts so far: graphs made and frames converted."""
    from torch._dynamo.utils import counters

    return {
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "frames_ok": int(counters["frames"]["ok"]),
    }


def compiles_between(before: dict[str, int], after: dict[str, int]) -> int:
    """The compiles between two ``graph_counts``: the larger growth of the two counters."""
    return max(after[key] - before[key] for key in before)


def one_call(config: CompilesConfig, n: int, device: torch.device, dtype: torch.dtype) -> dict:
    """One call at length n: its compiles, its wall time (the compile included), or its error."""
    shape = (config.batch, config.heads, n, config.head_dim)
    generator = torch.Generator(device=device).manual_seed(n)
    q, k, v = (
        torch.randn(shape, generator=generator, device=device)
        .to(dtype)
        .requires_grad_(config.backward)
        for _ in range(3)
    )
    before = graph_counts()
    start = time.perf_counter()
    record: dict[str, Any] = {"n": n}
    try:
        with torch.set_grad_enabled(config.backward):
            out = zoo.attention(
                q, k, v, variant=config.variant, backend=config.backend, causal=config.causal,
                **config.params,
            )  # fmt: skip
            if config.backward:
                out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        record["status"] = "ok"
    except Exception as error:  # recorded; the next length still runs
        record.update(status="error", reason=f"{type(error).__name__}: {str(error)[:300]}")
    record["ms"] = round((time.perf_counter() - start) * 1e3, 2)
    record["compiles"] = compiles_between(before, graph_counts())
    return record


def summary(config: CompilesConfig, calls: list[dict], header: dict) -> dict:
    ok = [c for c in calls if c["status"] == "ok"]
    return {
        "header": header,
        "lengths": list(config.lengths),
        "calls": calls,
        "measured": len({c["n"] for c in ok}),
        "compiles": sum(c["compiles"] for c in calls),
        "compiled_at": [c["n"] for c in calls if c["compiles"]],
        "errors": len(calls) - len(ok),
        "complete": len(calls) == len(config.lengths),
    }


def markdown(data: dict) -> str:
    h = data["header"]
    lines = [
        f"# Compiles over distinct lengths ({h['device']})",
        "",
        f"`{h['command']}`: {h['call']}. {data['compiles']} compiles for {data['measured']} "
        f"distinct lengths ({len(data['lengths'])} asked for"
        f"{'' if data['complete'] else ', cut short'}); compiled at n = "
        f"{', '.join(map(str, data['compiled_at'])) or 'none'}.",
        "",
        "| n | compiles | ms (compile included) | status |",
        "|---|---|---|---|",
    ]
    for c in data["calls"]:
        status = c["status"] if c["status"] == "ok" else f"{c['status']}: {c.get('reason', '')}"
        lines.append(f"| {c['n']} | {c['compiles']} | {c['ms']:.1f} | {status} |")
    return "\n".join(lines) + "\n"


def run_compiles(config: CompilesConfig, argv: list[str]) -> Path:
    """Every length in order, ``compiles.json`` rewritten after each; returns the output folder."""
    device = pick_device(config.device)
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = auto if config.dtype == "auto" else DTYPES[config.dtype]
    out = Path(config.out.format(device=device.type))
    out.mkdir(parents=True, exist_ok=True)
    header = {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "command": shlex.join(["python", "-m", "eval", "bench-compiles", *argv]),
        "call": f"zoo.attention(variant={config.variant!r}, backend={config.backend!r}, "
        f"causal={config.causal}, {config.params}), B={config.batch}, H={config.heads}, "
        f"D={config.head_dim}, {str(dtype).removeprefix('torch.')}, "
        f"{'forward+backward' if config.backward else 'forward'}",
        "counter": "torch._dynamo.utils.counters: stats.unique_graphs (or frames.ok)",
        "config": asdict(config),
    }
    calls: list[dict] = []
    with compiler_settings(device), thread_count(config.threads):
        for n in config.lengths:
            calls.append(one_call(config, n, device, dtype))
            print(json.dumps(calls[-1]), flush=True)
            data = summary(config, calls, header)
            write_whole(out / "compiles.json", data)
    (out / "compiles.md").write_text(markdown(data))
    print(f"{data['compiles']} compiles for {data['measured']} lengths; wrote {out}/compiles.json")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path, items = config_arguments(
        "python -m eval bench-compiles", __doc__.split(":")[0], argv, "lengths=[1000,1371,1742]"
    )
    try:
        config = load_config(CompilesConfig, path, items)
        if len(set(config.lengths)) != len(config.lengths) or not config.lengths:
            raise ConfigError(f"lengths must be distinct and non-empty, got {config.lengths}")
        if config.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)}")
        pick_device(config.device)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if config.variant not in zoo.list_attention():
        print(f"error: unknown variant {config.variant!r}", file=sys.stderr)
        return 2
    run_compiles(config, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
