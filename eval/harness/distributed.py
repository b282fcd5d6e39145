"""One process or several (``torchrun --nproc_per_node=N -m eval run ...``): rank, device, DDP.

Under torchrun every rank trains each cell data-parallel (DistributedDataParallel; nccl on GPU,
gloo on CPU) on its share of every batch, evaluates the same data, and only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Context:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but this machine has no CUDA GPU; use device=auto or cpu")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    return torch.device(name)


def start(requested: str) -> Context:
    """This process's rank and device; joins the process group when launched by torchrun."""
    device = pick_device(requested)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Context(0, 1, device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    return Context(dist.get_rank(), dist.get_world_size(), device)


def stop(context: Context) -> None:
    if context.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, context: Context) -> torch.nn.Module:
    """The model as DDP under torchrun, as it is otherwise."""
    if context.world == 1:
        return model
    ids = [context.device.index] if context.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def barrier(context: Context) -> None:
    if context.world > 1:
        dist.barrier()


@contextlib.contextmanager
def thread_count(threads: int) -> Iterator[None]:
    """torch's CPU threads set to ``threads`` for the duration (0 keeps them), restored after:
    the harness's and the benchmark's ``threads`` setting."""
    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
