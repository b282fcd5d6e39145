"""Training with context parallelism: ``train.context_parallel: N`` under
``torchrun --nproc-per-node N -m eval run ...``: one sequence split over the N processes.

Every rank draws the same batch (the data of one process), keeps its contiguous shard of each
sequence (tokens, targets, key padding) and runs the model on it: every zoo attention layer
shards by the group (``zoo.parallel.use_context_parallel``), every other layer is per token. The
loss of a rank is its share of the whole batch's mean (its targets' summed cross-entropy over the
whole batch's target count), times N because DDP averages the ranks' gradients: the sum of the
shares is the one-process loss, and so are the gradients. Evaluation runs each rank on whole
sequences, as without context parallelism.

Limits, checked before training: N must be the number of processes (no data parallelism beside
it), the sequence length a multiple of N, the task's head per token (a sequence head pools over
every rank's tokens), the encoding one that acts inside attention (rope, alibi, t5) or none (an
added table would need the shard's offset in the model), no torch.compile.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zoo
from zoo.parallel import shard, use_context_parallel

from ..tasks import IGNORE, Task
from .distributed import Context


def check(cell: dict[str, Any], context: Context, task: Task, encoding_kind: str) -> None:
    """Raise ValueError, naming the setting to change, where the cell cannot train sharded."""
    n = cell["train"].get("context_parallel", 1)
    problems = []
    if n != context.world:
        problems.append(
            f"train.context_parallel={n} needs {n} processes (torchrun --nproc-per-node {n}), "
            f"this run has {context.world}"
        )
    if cell["train_len"] % n:
        problems.append(f"train length {cell['train_len']} is not a multiple of {n}")
    if task.head != "token":
        problems.append(f"task {cell['task']!r} has a {task.head!r} head, not a per-token one")
    if encoding_kind == "embed":
        problems.append(
            f"encoding {cell['encoding']!r} adds a table to the input; use rope, alibi, t5 or none"
        )
    if cell["train"].get("compile"):
        problems.append("train.compile must be false")
    if cell["variant"] in zoo.list_modules():  # its own module: use_context_parallel refuses it
        problems.append(
            f"variant {cell['variant']!r} is a module of its own (zoo.list_modules()), which does "
            "not shard over processes"
        )
    if problems:
        raise ValueError("context parallelism: " + "; ".join(problems))


def enable(model: torch.nn.Module, on: bool) -> None:
    """Shard the model's attention over the world group (on), or run whole sequences (off)."""
    use_context_parallel(model, dist.group.WORLD if on else None)


def shard_batch(
    inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None, context: Context
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """This rank's shard of the batch's sequences, and the whole batch's target count."""
    total = int((targets != IGNORE).sum())
    mine = [None if t is None else shard(t, context.rank, context.world, dim=1)
            for t in (inputs, targets, mask)]  # fmt: skip
    return (*mine, total)


def loss_share(logits: torch.Tensor, targets: torch.Tensor, total: int, world: int) -> torch.Tensor:
    """This rank's share of the batch's mean loss, times ``world`` (DDP averages gradients)."""
    summed = F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return summed * world / max(total, 1)


def whole_losses(losses: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """The batch's mean loss per step from every rank's share (summed over ranks / world)."""
    stacked = torch.stack(losses)
    dist.all_reduce(stacked)
    return list(stacked / world)
