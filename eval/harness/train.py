"""Train one cell of a sweep and measure it: accuracy per test length and slice, time, memory.

Training data is drawn fresh every step from the task's generator (seeds that never repeat and
never meet the evaluation's, eval/harness/seeds.py), so there is nothing to overfit but the task
itself. AdamW with linear warm-up and cosine decay to zero, gradient clipping, bf16 autocast on
GPU and float32 on CPU, fixed seeds.

``train.until: learned`` trains within a budget of ``train.max_steps`` (the schedule spans it)
and stops at the first check from ``train.steps`` on where every slice within the pattern's reach
is learned and the loss no longer falls by the report's rule (``Checker``,
eval/harness/verdict.py, eval/harness/convergence.py); the checks score sequences of their own
(eval/harness/seeds.py), so training never stops on what the record is scored on. Every record
says what each test length's slices reach (``slice_reach``) and its ``verdict``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import zoo

from ..tasks import IGNORE, Batch, Task, get_task
from . import context_parallel
from .convergence import loss_falls
from .distributed import Context, wrap
from .model import SequenceModel
from .seeds import CHECK_OFFSET, draw_problem, sample_seed
from .slices import slice_reach, slice_verdict
from .verdict import CANNOT, LEARNED


def variant_params(cell: dict[str, Any], task: Task) -> dict[str, Any]:
    """The cell's variant parameters, with the task's image grid for a variant that takes one
    (``grid`` in its registry parameters) unless the config sets it: a 2-D pattern then sees the
    image's rows and columns, not a grid guessed from the length."""
    params = dict(cell["variant_params"])
    variant = cell["variant"]
    takes_grid = variant in zoo.list_variants() and "grid" in zoo.get_spec(variant).parameters()
    if task.grid is not None and "grid" not in params and takes_grid:
        params["grid"] = tuple(task.grid)
    return params


def build_model(cell: dict[str, Any], task: Task) -> SequenceModel:
    return SequenceModel(
        vocab_size=task.vocab_size,
        num_classes=task.num_classes,
        head=task.head,
        variant=cell["variant"],
        variant_params=variant_params(cell, task),
        encoding=cell["encoding"],
        encoding_params=cell["encoding_params"],
        causal=cell["causal"],
        backend=cell["backend"],
        **cell["model"],
    )


def schedule(step: int, total: int, warmup: int) -> float:
    """Learning-rate factor: linear warm-up over ``warmup`` steps, then cosine decay to zero."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE)


def to_device(
    batch: Batch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    mask = None if batch.padding_mask is None else batch.padding_mask.to(device)
    return batch.inputs.to(device), batch.targets.to(device), mask


def attention_inputs(batch: Batch, device: torch.device) -> dict[str, Any]:
    """The batch's attention inputs on ``device`` (a graph's per-sequence edge lists)."""

    def moved(value: Any) -> Any:
        if isinstance(value, list | tuple):
            return [moved(v) for v in value]
        return value.to(device) if isinstance(value, torch.Tensor) else value

    return {name: moved(value) for name, value in batch.attention_inputs.items()}


def select(attention: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """The attention inputs of the sequences ``index`` names (tensors by row, lists by item)."""
    rows = index.tolist()
    return {
        name: value[index] if isinstance(value, torch.Tensor) else [value[i] for i in rows]
        for name, value in attention.items()
    }


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def batches(task: Task, cell_seed: int, pool: int, size: int, context: Context):
    """step -> this rank's training batch of ``size``: freshly drawn, or taken from a pool drawn
    once and read in shuffled epochs (epoch e's order is seeded by the cell seed and e)."""
    if not pool:

        def fresh(step: int) -> Batch:
            return task.sample(
                size, sample_seed(cell_seed, "train", step * context.world + context.rank)
            )

        return fresh
    data = task.sample(pool, sample_seed(cell_seed, "train", 0))
    orders: dict[int, torch.Tensor] = {}

    def order(epoch: int) -> torch.Tensor:
        if epoch not in orders:
            generator = torch.Generator().manual_seed(sample_seed(cell_seed, "train", epoch + 1))
            orders[epoch] = torch.randperm(pool, generator=generator)
        return orders[epoch]

    def pooled(step: int) -> Batch:
        positions = torch.arange(size) + (step * context.world + context.rank) * size
        epochs, offsets = positions // pool, positions % pool
        index = torch.empty(size, dtype=torch.long)
        for epoch in epochs.unique().tolist():
            chosen = epochs == epoch
            index[chosen] = order(epoch)[offsets[chosen]]
        mask = None if data.padding_mask is None else data.padding_mask[index]
        slices = {name: keys[index] for name, keys in data.slices.items()}
        attention = select(data.attention_inputs, index)
        return Batch(data.inputs[index], data.targets[index], mask, slices, {}, attention)

    return pooled


def train(
    cell: dict[str, Any], context: Context, progress=None, checkpoint: Path | None = None
) -> dict[str, Any]:
    """Train the cell's model; returns its metrics (the cell's result record without the cell).
    With ``checkpoint``, rank 0 saves the cell and the trained weights there."""
    settings = cell["train"]
    torch.manual_seed(cell["seed"])
    task = get_task(cell["task"], seq_len=cell["train_len"], **cell["task_params"])
    model = build_model(cell, task)
    for length in cell["test_lengths"]:
        model.check_length(length)
    model.to(context.device)
    sharded = settings.get("context_parallel", 1) > 1  # one sequence over the ranks
    if sharded:
        context_parallel.check(cell, context, task, model.pos.kind)
        context_parallel.enable(model, True)
    network = wrap(model, context)
    if settings["compile"]:
        network = torch.compile(network, fullgraph=True)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=settings["lr"],
        weight_decay=settings["weight_decay"],
        betas=(0.9, 0.98),
        # one kernel over every parameter, not a loop of small ops per tensor
        fused=context.device.type in ("cpu", "cuda"),
    )
    steps = settings["steps"]
    until = settings.get("until", "steps")
    budget = settings["max_steps"] if until == "learned" else steps  # the schedule's length
    warmup = max(1, round(settings["warmup"] * budget))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule(s, budget, warmup))
    data = Context(0, 1, context.device) if sharded else context  # sharded: the same batch
    problem = draw_problem(settings, data.world)  # run.py refuses it before; a direct call here
    if problem is not None:
        raise ValueError(problem)
    per_rank = settings["batch_size"] // data.world
    if context.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(context.device)
    losses = []
    targets_seen = torch.zeros(task.num_classes, dtype=torch.long)
    every = check_interval(settings)
    checker = Checker(model, cell, context) if every else None
    checks: list[dict[str, Any]] = []
    stopped = "max_steps" if until == "learned" else None
    start = time.perf_counter()
    draw = batches(task, cell["seed"], settings["pool"], per_rank, data)
    halfway, checking, checked_before = start, 0.0, 0.0
    step = 0
    while step < budget:
        if step == steps // 2:
            halfway, checked_before = time.perf_counter(), checking
        batch = draw(step)
        inputs, targets, mask = to_device(batch, context.device)
        if sharded:
            inputs, targets, mask, total = context_parallel.shard_batch(
                inputs, targets, mask, context
            )
        with autocast(context.device):
            logits = network(inputs, mask, **attention_inputs(batch, context.device))
        if sharded:
            loss = context_parallel.loss_share(logits, targets, total, context.world)
        else:
            loss = loss_of(logits, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings["grad_clip"])
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())  # read once at the end: .item() would wait for a GPU
        targets_seen += count_targets(batch.targets, task.num_classes)
        step += 1
        if progress is not None:
            progress.update(1)
            if step % 25 == 1 or step == budget:
                progress.set_postfix(loss=f"{losses[-1].item():.3f}", refresh=False)
        if checker is not None and (step % every == 0 or step == budget):
            began = time.perf_counter()
            checks.append(checker.check(step, losses, every, targets_seen))
            checking += time.perf_counter() - began
            if until == "learned" and step >= steps and agreed(learned(checks), context):
                stopped = "learned"
                break
    if sharded:  # each rank's loss is its share: the batch's, and whole sequences from here on
        losses = context_parallel.whole_losses(losses, context.world)
        context_parallel.enable(model, False)
    losses = torch.stack(losses).tolist()
    end = time.perf_counter()
    seconds = end - start - checking
    peak = (
        torch.cuda.max_memory_allocated(context.device) / 2**20
        if context.device.type == "cuda"
        else None
    )
    if checkpoint is not None and context.main:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"cell": cell, "model": model.state_dict()}, checkpoint)
    evaluation = {
        str(n): evaluate(model, cell, n, context, reach=True) for n in cell["test_lengths"]
    }
    chance = marginal(targets_seen)["chance_accuracy"]
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(seconds, 3),
        "steps_per_second": round(step / seconds, 3),
        # The second half of training: without a compiled model's compilation or warm-up.
        "steady_steps_per_second": round(
            (step - steps // 2) / (end - halfway - (checking - checked_before)), 3
        ),
        "steps_taken": step,
        **({"stopped": stopped} if stopped else {}),
        **({"check_seconds": round(checking, 3), "checks": checks} if checks else {}),
        "peak_memory_mb": None if peak is None else round(peak, 1),
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 5),
        "loss_curve": loss_curve(losses),
        **marginal(targets_seen),
        "accuracy": {n: e["accuracy"] for n, e in evaluation.items()},
        **(
            {
                "generation_accuracy": {n: e["generation_accuracy"] for n, e in evaluation.items()},
                "generation": "greedy" if greedy(task) else "fixed inputs",
            }
            if settings.get("generation")
            else {}
        ),
        "slices": {n: e["slices"] for n, e in evaluation.items()},
        # answers in reach and answers, per slice value (eval/harness/slices.py), and from them
        # and the accuracies what each length says (eval/harness/verdict.py)
        "slice_reach": {n: e["reach"] for n, e in evaluation.items()},
        "verdict": {
            n: slice_verdict(cell["task"], e["slices"], e["reach"], chance).verdict
            for n, e in evaluation.items()
        },
        "eval_ms_per_sequence": {n: e["ms_per_sequence"] for n, e in evaluation.items()},
    }


LOSS_CURVE_POINTS = 20


def loss_curve(losses: list[float]) -> list[float]:
    """The training loss averaged over ``LOSS_CURVE_POINTS`` equal spans of the steps (fewer
    when there are fewer steps): what the report reads to tell a converged cell from one still
    learning."""
    spans = min(LOSS_CURVE_POINTS, len(losses))
    bounds = [round(i * len(losses) / spans) for i in range(spans + 1)]
    return [round(sum(losses[a:b]) / (b - a), 5) for a, b in itertools.pairwise(bounds)]


def count_targets(targets: torch.Tensor, num_classes: int) -> torch.Tensor:
    """How often each class is a scored target in ``targets``."""
    scored = targets[targets != IGNORE]
    return torch.bincount(scored.flatten().cpu(), minlength=num_classes)


def marginal(counts: torch.Tensor) -> dict[str, float]:
    """What a model that ignores its input reaches, from the classes of the training targets:
    the loss of predicting their frequencies (their entropy, in nats) and the accuracy of always
    answering the most frequent class."""
    p = counts.double() / counts.sum().clamp_min(1)
    entropy = -(p[p > 0] * p[p > 0].log()).sum()
    return {"marginal_loss": round(float(entropy), 5), "chance_accuracy": round(float(p.max()), 5)}


def greedy(task: Task) -> bool:
    """Whether generation feeds its own predictions: a task whose answer slots hold the previous
    answer (``feed_answers``) is generated greedily; in one whose slots hold fixed tokens the
    model never reads its predictions, so decoding checks the cache path alone."""
    return bool(getattr(task, "feed_answers", False))


def eval_batches(cell: dict[str, Any], length: int, offset: int = 0):
    """(task, batch) of the cell's ``eval_samples`` evaluation sequences at ``length``, in
    batches of ``eval_batch_size``, drawn from the evaluation stream from index ``offset``:
    what ``evaluate`` scores, drawn again where the report needs them."""
    settings = cell["train"]
    task = get_task(cell["task"], seq_len=length, **cell["task_params"])
    remaining, index = settings["eval_samples"], 0
    while remaining > 0:
        n = min(settings["eval_batch_size"], remaining)
        yield task, task.sample(n, sample_seed(cell["seed"], "eval", offset + index))
        remaining, index = remaining - n, index + 1


@torch.no_grad()
def evaluate(
    model: SequenceModel,
    cell: dict[str, Any],
    length: int,
    context: Context,
    drawn: list[tuple[Task, Batch]] | None = None,
    reach: bool = False,
) -> dict[str, Any]:
    """Accuracy on ``eval_samples`` fresh sequences of ``length`` (or on the ``drawn`` batches),
    overall and per slice key; with ``reach``, also how many of each slice's answers lie within
    the pattern's reach (``slices.slice_reach``)."""
    settings = cell["train"]
    model.eval()
    hits: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    correct = total = generated = 0
    start = time.perf_counter()
    used = []
    for task, batch in drawn if drawn is not None else eval_batches(cell, length):
        used.append((task, batch))
        inputs, targets, mask = to_device(batch, context.device)
        with autocast(context.device):
            predictions = model(inputs, mask, **attention_inputs(batch, context.device)).argmax(-1)
        scored = targets != IGNORE
        right = (predictions == targets) & scored
        correct += int(right.sum())
        if settings.get("generation"):  # the prompt up to the first answer, then token by token
            prompt = int(scored.any(0).nonzero()[0])
            with autocast(context.device):
                decoded = model.decode(inputs, prompt, greedy=greedy(task)).argmax(-1)
            generated += int(((decoded == targets) & scored).sum())
        total += int(scored.sum())
        for name, keys in batch.slices.items():
            keys = keys.to(context.device)
            for key in keys[scored].unique().tolist():
                chosen = scored & (keys == key)
                hits[name][key][0] += int(right[chosen].sum())
                hits[name][key][1] += int(chosen.sum())
    seconds = time.perf_counter() - start
    model.train()
    slices = {
        name: {str(k): round(c / t, 4) for k, (c, t) in sorted(keys.items())}
        for name, keys in hits.items()
    }
    sequences = sum(batch.inputs.shape[0] for _, batch in used)
    return {
        "accuracy": round(correct / max(total, 1), 4),
        "generation_accuracy": round(generated / max(total, 1), 4),
        "slices": slices,
        "ms_per_sequence": round(1e3 * seconds / max(sequences, 1), 3),
        **(
            {"reach": slice_reach(cell, length, used, variant_params(cell, used[0][0]))}
            if reach
            else {}
        ),
    }


def check_interval(settings: dict[str, Any]) -> int:
    """Steps between the checks during training: ``check_every``, or with ``until: learned`` and
    none set, a tenth of ``steps``; 0: no checks."""
    every = settings.get("check_every", 0)
    if not every and settings.get("until", "steps") == "learned":
        every = max(1, settings["steps"] // 10)
    return every


class Checker:
    """The checks during training: the model scored on sequences of the train length drawn once
    from their own part of the evaluation stream (``CHECK_OFFSET``), with the slices' reach on
    them; each check records the step, the loss since the last one, whether the loss of the
    steps so far still falls by the report's rule (``convergence.loss_falls`` on ``loss_curve``),
    the accuracy per slice and the verdict it gives (eval/harness/verdict.py)."""

    def __init__(self, model: SequenceModel, cell: dict[str, Any], context: Context) -> None:
        self.model, self.cell, self.context = model, cell, context
        length = cell["train_len"]
        self.drawn = list(eval_batches(cell, length, offset=CHECK_OFFSET))
        params = variant_params(cell, self.drawn[0][0])
        self.reach = slice_reach(cell, length, self.drawn, params)

    def check(
        self, step: int, losses: list[torch.Tensor], every: int, seen: torch.Tensor
    ) -> dict[str, Any]:
        found = evaluate(self.model, self.cell, self.cell["train_len"], self.context, self.drawn)
        level = marginal(seen)
        said = slice_verdict(
            self.cell["task"], found["slices"], self.reach, level["chance_accuracy"]
        )
        so_far = torch.stack(losses)
        return {
            "step": step,
            "loss": round(float(so_far[-every:].mean()), 5),
            "loss_falling": loss_falls(loss_curve(so_far.tolist()), level["marginal_loss"]),
            "marginal_loss": level["marginal_loss"],
            "accuracy": found["accuracy"],
            "slices": found["slices"],
            "verdict": said.verdict,
        }


def learned(checks: list[dict[str, Any]]) -> bool:
    """Whether training may stop (``until: learned``): the last check found every reachable
    slice learned (its verdict learned, or cannot: what it fails is out of reach) and the loss of
    the steps so far no longer falling by the rule the report applies to the record, so a cell
    never stops "learned" that its report then calls "still falling"."""
    last = checks[-1]
    return last["verdict"] in (LEARNED, CANNOT) and not last["loss_falling"]


def agreed(stop: bool, context: Context) -> bool:
    """``stop`` where every process of a data-parallel cell says so (each decides on its own
    batches' losses; they must leave the loop together)."""
    if context.world == 1:
        return stop
    import torch.distributed as dist

    flag = torch.tensor([1.0 if stop else 0.0], device=context.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
