"""``python -m eval run CONFIG.yaml [key=value ...]``: train and evaluate a sweep.

A sweep is the product tasks x train lengths x variants x encodings x seeds; every cell is tested
at each of ``test_lengths`` (longer than the train length: length extrapolation). Each finished
cell appends one JSON line to ``<out>/results.jsonl`` and flushes it, so an interrupted sweep,
started again, skips the cells already done and loses nothing. A cell that fails (out of memory,
a variant that cannot run a length) is recorded as failed with the reason and the sweep goes on;
the next run of the sweep tries it again, and the report keeps each cell's latest record.

A cell's key covers its config, not the zoo's code: after a change to what a variant computes
(its definition or its registry defaults) or to what the harness draws (eval/harness/seeds.py),
run the sweep into a fresh ``out``. Each record names
the commit it ran at (``environment.commit``, with ``+changes`` when the tree had uncommitted
changes).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import zoo
from zoo.core.arguments import suggest

from ..tasks import Task, get_task, list_tasks
from . import distributed
from .config import ConfigError, build, load_config
from .seeds import SEED_BITS, draw_problem
from .workers import append_record, parse_shard, run_in_processes

if TYPE_CHECKING:
    from collections.abc import Callable

    from .model import SequenceModel


@dataclass
class ModelConfig:
    dim: int = 64
    depth: int = 2
    heads: int = 2
    kv_heads: int | None = None  # grouped-query attention: key/value heads; None: heads
    mlp_dim: int = 128
    dropout: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 32
    # One learning rate, or a list: one cell per value, and the report keeps the best per cell
    # (``best_of``), as Zoology reports each model at the best of a sweep (4 values, 1e-4 to 1e-2).
    lr: float | list[float] = 1e-3
    weight_decay: float = 0.1
    warmup: float = 0.1  # fraction of the steps
    grad_clip: float = 1.0
    eval_samples: int = 256
    eval_batch_size: int = 64
    # 0: a fresh batch every step. N: draw N training sequences once and go through them in
    # shuffled epochs, as LRA trains on a fixed set; for tasks whose generator is slow (ListOps).
    pool: int = 0
    # torch.compile(model, fullgraph=True) for training (one graph per sequence length; the first
    # steps include the compilation, steady_steps_per_second leaves them out).
    compile: bool = False
    # Causal token tasks (copy, selective_copy): also evaluate by generation, the prompt in one
    # call and then one token at a time with a KVCache per layer (generation_accuracy). With the
    # task's feed_answers: true, greedy: each answer slot reads the model's previous prediction.
    generation: bool = False
    # Context parallelism: one sequence split over this many processes (torchrun
    # --nproc-per-node N), each rank its shard (eval/harness/context_parallel.py); 1: off.
    context_parallel: int = 1
    # "steps": train ``steps`` (the published fixed-budget protocol). "learned": a budget of
    # ``max_steps`` (the learning-rate schedule spans it), stopping at the first check from
    # ``steps`` on where every slice within the pattern's reach is learned and the loss no longer
    # falls (eval/harness/verdict.py); the record says the steps taken and why it stopped.
    until: str = "steps"
    max_steps: int = 0
    # Steps between checks during training (the loss and the accuracy per slice at the train
    # length on sequences of their own, in the record's ``checks``: where a transition came);
    # 0: none, or with until: learned a tenth of ``steps``.
    check_every: int = 0


@dataclass
class RunConfig:
    name: str = "run"
    # What the sweep shows and what it cannot, for the top of its report (kept in each record).
    about: str = ""
    tasks: list[str] = field(default_factory=lambda: ["mqar"])
    task_params: dict[str, dict] = field(default_factory=dict)  # task name -> its parameters
    # task name -> {model: {...}, train: {...}, train_lengths: [...], test_lengths: [...]}:
    # settings that differ by task (ListOps' learning rate and its 2000-token sequences)
    task_settings: dict[str, dict] = field(default_factory=dict)
    variants: list[str] = field(default_factory=lambda: ["full"])  # or mechanisms, by name
    variant_params: dict[str, dict] = field(default_factory=dict)  # variant -> overrides
    encodings: list[str] = field(default_factory=lambda: ["learned"])
    encoding_params: dict[str, dict] = field(default_factory=dict)  # encoding -> overrides
    train_lengths: list[int] = field(default_factory=lambda: [128])
    test_lengths: list[int] = field(default_factory=list)  # empty: the train length only
    seeds: list[int] = field(default_factory=lambda: [0])
    # What the report chooses the best of, per cell, by accuracy at the train length: "lr" (the
    # learning rates of a train.lr list) and/or "seed"; the rest are kept in the results and the
    # report's sweep table, the chosen one named. Seeds not in best_of are averaged.
    best_of: list[str] = field(default_factory=lambda: ["lr"])
    causal: bool = False
    backend: str = "auto"
    # cells left out of the product, each a mapping of task / variant / encoding that a cell
    # must all match: {variant: linear, encoding: alibi} (a mechanism takes no score bias)
    exclude: list[dict] = field(default_factory=list)
    device: str = "auto"
    # torch's CPU threads in each process (torch.set_num_threads), for the sweep; 0 keeps torch's
    # default of one per core. Default 1: the harness's models are small (dim 64, batch 32) and on
    # a shared machine two OpenMP threads per process wait on each other and on the other work:
    # on a 2-core CPU under load, training ran at 0.17 steps/s with torch's two threads against
    # 1.04 with one. Under torchrun each of the N processes takes this many. On a dedicated
    # many-core CPU, or for larger models, raise it (threads=4, or 0 for one per core).
    threads: int = 1
    # Cells trained at once, each in its own process with ``threads`` threads (workers.py): on a
    # 2-core CPU, workers: 2 with threads: 1 trains two cells at a time on both cores. "auto":
    # one per GPU where there are GPUs (each worker its own, CUDA_VISIBLE_DEVICES), else one per
    # core.
    workers: int | str = 1
    # "local": this machine's processes (workers); "ray": every cell a Ray task, scheduled by
    # Ray on one machine or a cluster (eval/harness/ray_launcher.py; pip install -e .[ray]).
    launcher: str = "local"
    # The Ray cluster, HOST:PORT (as `ray start --head` prints it); empty: the RAY_ADDRESS
    # variable, or with neither a local Ray cluster started in this process.
    ray_address: str = ""
    # What each cell asks Ray for: {gpus: G, cpus: C, processes: P}. Defaults: one GPU per cell
    # where the cluster has GPUs (a fraction, e.g. 0.25, lets several small cells share one),
    # ``threads`` CPUs; processes > 1 (default: gpus when gpus >= 2) trains the cell under
    # torch.distributed on what Ray gave it (torchrun inside the task).
    resources: dict[str, float] = field(default_factory=dict)
    # Times Ray runs a cell again whose worker process died (killed, out of memory, a node
    # lost); a cell that fails for its own reason is recorded as failed, not retried.
    max_retries: int = 2
    out: str = "eval/results/{name}"
    save_checkpoints: bool = False  # <out>/checkpoints/<cell key>.pt, for attention maps
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# What each setting of a train or model section takes: (test, what the error says). A value
# outside would fail every cell at run time (several only after training), or train wrongly
# without failing: clip_grad_norm_ scales the gradient by grad_clip / its norm, so a negative
# grad_clip flips it (gradient ascent) and 0 zeroes it.
LIMITS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "train.steps": (lambda v: v >= 1, ">= 1"),
    "train.batch_size": (lambda v: v >= 1, ">= 1"),
    "train.eval_samples": (lambda v: v >= 1, ">= 1"),
    "train.eval_batch_size": (lambda v: v >= 1, ">= 1"),
    "train.weight_decay": (lambda v: v >= 0, ">= 0"),
    "train.warmup": (lambda v: 0 <= v <= 1, "a fraction of the steps, from 0 to 1"),
    "train.grad_clip": (lambda v: v > 0, "a number > 0, the largest gradient norm (.inf: none)"),
    "train.pool": (lambda v: v >= 0, ">= 0 (0: a fresh batch every step)"),
    "train.context_parallel": (lambda v: v >= 1, ">= 1 (1: off)"),
    "train.check_every": (lambda v: v >= 0, ">= 0 (0: no checks)"),
    "model.depth": (lambda v: v >= 1, ">= 1"),
    "model.mlp_dim": (lambda v: v >= 0, ">= 0 (0: no MLP)"),
}

# Cell seeds from 0 to 2047: each draws its own 2**20 batches per stream within the 32 bits that
# seed torch's CPU generator (seeds.sample_seed).
SEEDS = 2**SEED_BITS


def check_names(config: RunConfig, source: str) -> None:
    """Every task, variant and encoding named in the config exists, and every setting is within
    what it takes; errors name the key, the value and what was expected. A task's settings are
    kept as their schema reads them (a float written 1e-2, say), as the config's own are."""
    variants = zoo.list_attention() + zoo.list_modules()  # patterns and mechanisms (nsa)
    for key, names, known in (
        ("tasks", config.tasks, list_tasks()),
        ("variants", config.variants, variants),
        ("encodings", config.encodings, zoo.list_encodings()),
    ):
        for i, name in enumerate(names):
            if name not in known:
                raise ConfigError(f"{source}: {key}[{i}]: {suggest(key[:-1], name, known, key)}")
    for key, table, known in (
        ("task_params", config.task_params, list_tasks()),
        ("variant_params", config.variant_params, variants),
        ("encoding_params", config.encoding_params, zoo.list_encodings()),
    ):
        for name in table:
            if name not in known:
                raise ConfigError(
                    f"{source}: {key}: {suggest(key[:-7], name, known, key[:-7] + 's')}"
                )
    for task, settings in config.task_settings.items():
        if task not in list_tasks():
            raise ConfigError(
                f"{source}: task_settings: {suggest('task', task, list_tasks(), 'tasks')}"
            )
        where = f"{source}: task_settings: {task}"
        for section, schema in (("model", ModelConfig), ("train", TrainConfig)):
            if section in settings:  # kept as the schema reads them: 1e-2 is a string in YAML
                given = settings[section]
                built = build(schema, given, f"{where}: {section}")
                settings[section] = {key: getattr(built, key) for key in given}
        for key in ("train_lengths", "test_lengths"):
            lengths = settings.get(key, [])
            if not isinstance(lengths, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in lengths
            ):
                raise ConfigError(
                    f"{where}: {key} must be a list of positive ints, got {settings[key]!r}"
                )
        for section in set(settings) - {"model", "train", "train_lengths", "test_lengths"}:
            known = "model, train, train_lengths, test_lengths"
            raise ConfigError(f"{where}: unknown key {section!r} (known keys: {known})")
    known_by_key = {"task": list_tasks(), "variant": variants}
    known_by_key["encoding"] = zoo.list_encodings()
    for i, rule in enumerate(config.exclude):
        if not isinstance(rule, dict) or not rule or set(rule) - set(known_by_key):
            raise ConfigError(
                f"{source}: exclude[{i}]: a mapping of task, variant and/or encoding names, "
                f"got {rule!r}"
            )
        for key, name in rule.items():
            if name not in known_by_key[key]:
                message = suggest(key, str(name), known_by_key[key], f"{key}s")
                raise ConfigError(f"{source}: exclude[{i}]: {message}")
    for where, lr in (
        ("train.lr", config.train.lr),
        *(
            (f"task_settings: {task}: train.lr", settings["train"]["lr"])
            for task, settings in config.task_settings.items()
            if "lr" in settings.get("train", {})
        ),
    ):
        if not learning_rates(lr) or not all(v > 0 for v in learning_rates(lr)):
            raise ConfigError(
                f"{source}: {where} must be a positive number or a non-empty list of them, "
                f"got {lr!r}"
            )
    for i, name in enumerate(config.best_of):
        if name not in ("lr", "seed"):
            raise ConfigError(f"{source}: best_of[{i}] must be 'lr' or 'seed', got {name!r}")
    for where, sections in (
        (f"{source}: ", {"model": asdict(config.model), "train": asdict(config.train)}),
        *(
            (f"{source}: task_settings: {task}: ", settings)
            for task, settings in config.task_settings.items()
        ),
    ):
        for section in ("model", "train"):
            for key, value in sections.get(section, {}).items():
                test, expected = LIMITS.get(f"{section}.{key}", (lambda v: True, ""))
                if not test(value):
                    raise ConfigError(f"{where}{section}.{key} must be {expected}, got {value!r}")
    for where, train in (
        ("train", asdict(config.train)),
        *(
            (f"task_settings: {task}: train", {**asdict(config.train), **settings["train"]})
            for task, settings in config.task_settings.items()
            if "train" in settings
        ),
    ):
        check_until(train, f"{source}: {where}")
    for i, seed in enumerate(config.seeds):
        if not 0 <= seed < SEEDS:
            raise ConfigError(f"{source}: seeds[{i}] must be from 0 to {SEEDS - 1}, got {seed}")
    for key, values in (
        ("tasks", config.tasks),
        ("variants", config.variants),
        ("encodings", config.encodings),
        ("train_lengths", config.train_lengths),
        ("test_lengths", config.test_lengths),
        ("seeds", config.seeds),
        ("train.lr", learning_rates(config.train.lr)),
        *(
            (f"task_settings: {task}: {key}", settings[key])
            for task, settings in config.task_settings.items()
            for key in ("train_lengths", "test_lengths")
            if key in settings
        ),
        *(
            (f"task_settings: {task}: train.lr", learning_rates(settings["train"]["lr"]))
            for task, settings in config.task_settings.items()
            if "lr" in settings.get("train", {})
        ),
    ):
        if not values and not key.endswith("test_lengths"):  # empty test_lengths: the train's
            raise ConfigError(
                f"{source}: {key} is an empty list; list at least one (an empty one trains nothing)"
            )
        repeated = [v for i, v in enumerate(values) if v in values[:i]]
        if repeated:
            raise ConfigError(
                f"{source}: {key} lists {repeated[0]!r} twice; list each value once (a repeat "
                "trains or tests the same cells again)"
            )
    backends = ["auto", *zoo.list_backends()]
    if config.backend not in backends:
        message = suggest("backend", config.backend, backends, "zoo.list_backends()")
        raise ConfigError(f"{source}: backend: {message}")
    if config.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(
            f"{source}: device must be 'auto', 'cpu' or 'cuda', got {config.device!r}"
        )
    try:
        results_file(config)
    except (KeyError, IndexError, AttributeError, ValueError) as error:
        raise ConfigError(
            f"{source}: out must be a folder, in which {{name}} is the config's name (the one "
            f"field it may hold; {{{{ and }}}} for braces), got {config.out!r} "
            f"({type(error).__name__}: {error})"
        ) from error
    if config.workers != "auto" and not (isinstance(config.workers, int) and config.workers >= 1):
        raise ConfigError(
            f"{source}: workers must be an int >= 1 or 'auto', got {config.workers!r}"
        )
    if config.launcher not in ("local", "ray"):
        raise ConfigError(f"{source}: launcher must be 'local' or 'ray', got {config.launcher!r}")
    unknown = set(config.resources) - {"gpus", "cpus", "processes"}
    if unknown or any(not v >= 0 for v in config.resources.values()):
        raise ConfigError(
            f"{source}: resources takes gpus, cpus and processes, each >= 0, got "
            f"{config.resources!r}"
        )
    if config.max_retries < 0:
        raise ConfigError(f"{source}: max_retries must be >= 0, got {config.max_retries}")
    if config.threads < 0:
        raise ConfigError(
            f"{source}: threads must be >= 0 (0: torch's default, one per core), "
            f"got {config.threads}"
        )


def check_until(train: dict[str, Any], where: str) -> None:
    """``until``, ``max_steps`` and ``check_every`` of a train section make sense together."""
    if train["until"] not in ("steps", "learned"):
        raise ConfigError(f"{where}.until must be 'steps' or 'learned', got {train['until']!r}")
    if train["until"] == "steps" and train["max_steps"]:  # it was dropped without a word
        raise ConfigError(
            f"{where}.max_steps is the budget of until: learned, but until is 'steps' (train "
            f"exactly steps={train['steps']}): set until: learned, or leave max_steps out"
        )
    if train["until"] == "learned" and train["max_steps"] < train["steps"]:
        raise ConfigError(
            f"{where}.until: learned needs max_steps >= steps (the budget), got max_steps "
            f"{train['max_steps']} with steps {train['steps']}"
        )
    checks = train["until"] == "learned" or train["check_every"] > 0
    if checks and train["context_parallel"] > 1:
        raise ConfigError(
            f"{where}: checks during training (until: learned, check_every) do not run with "
            "context_parallel > 1"
        )


def cells(config: RunConfig) -> list[dict[str, Any]]:
    """The sweep's cells in order: plain data naming everything that shapes each result."""
    out = []
    for task in config.tasks:
        settings = config.task_settings.get(task, {})
        train_lengths = settings.get("train_lengths", config.train_lengths)
        test_lengths = settings.get("test_lengths", config.test_lengths)
        lr = settings.get("train", {}).get("lr", config.train.lr)
        for train_len, variant, encoding, seed, rate in itertools.product(
            train_lengths, config.variants, config.encodings, config.seeds, learning_rates(lr)
        ):
            names = {"task": task, "variant": variant, "encoding": encoding}
            if any(all(names[k] == v for k, v in rule.items()) for rule in config.exclude):
                continue
            out.append(
                make_cell(
                    config, task, settings, train_len, test_lengths, variant, encoding, seed, rate
                )
            )
    return out


def learning_rates(lr: float | list[float]) -> list[float]:
    """The learning rates of a sweep: ``train.lr`` as a list, or the one value."""
    return [float(v) for v in lr] if isinstance(lr, list | tuple) else [float(lr)]


# The training-length settings a cell records only where they differ from these (so that the
# keys of results trained before them are unchanged).
UNTIL_DEFAULTS = {"until": "steps", "max_steps": 0, "check_every": 0}


def make_cell(
    config: RunConfig,
    task: str,
    settings: dict[str, Any],
    train_len: int,
    test_lengths: list[int],
    variant: str,
    encoding: str,
    seed: int,
    lr: float,
) -> dict[str, Any]:
    """One cell as plain data; its key hashes everything in it, so a changed setting reruns it.
    ``lr`` is the cell's one learning rate, of the sweep's list."""
    cell = {
        "task": task,
        "task_params": config.task_params.get(task, {}),
        "train_len": train_len,
        "test_lengths": test_lengths or [train_len],
        "variant": variant,
        "variant_params": config.variant_params.get(variant, {}),
        "encoding": encoding,
        "encoding_params": config.encoding_params.get(encoding, {}),
        "seed": seed,
        "causal": config.causal,
        "backend": config.backend,
        "model": {**asdict(config.model), **settings.get("model", {})},
        "train": {**asdict(config.train), **settings.get("train", {}), "lr": lr},
    }
    if cell["train"]["context_parallel"] == 1:  # off: the keys of earlier results unchanged
        del cell["train"]["context_parallel"]
    for name, default in UNTIL_DEFAULTS.items():  # likewise for a fixed budget without checks
        if cell["train"].get(name) == default:
            del cell["train"][name]
    if "until" not in cell["train"]:
        cell["train"].pop("max_steps", None)
    cell["key"] = hashlib.sha1(json.dumps(cell, sort_keys=True).encode()).hexdigest()[:16]
    return cell


def check_cells(cells_: list[dict[str, Any]], source: str, world: int | None = 1) -> None:
    """Fail before training on what a cell could only fail later: task parameters, lengths the
    encoding cannot reach, generation without a causal token model, a graph variant on a task
    without a graph, a batch that does not split over the ``world`` processes of this run or a
    context parallelism of another number of processes (None: not known here, as for Ray's
    driver before it connects; it checks again once it knows a task's processes), a 2-D model
    tested on another image grid."""
    from .train import build_model, variant_params

    for cell in cells_:
        trained = problem = None
        where = f"{cell['task']} / {cell['variant']} / {cell['encoding']}"
        for length in sorted({cell["train_len"], *cell["test_lengths"]}):
            try:
                task = get_task(cell["task"], seq_len=length, **cell["task_params"])
                model = build_model(cell, task)
                model.check_length(length)
                if length == cell["train_len"]:
                    trained = variant_params(cell, task)
                    problem = training_problem(cell, task, model, world)
            except (TypeError, ValueError) as error:
                raise ConfigError(f"{source}: {where} at length {length}: {error}") from error
        if problem is not None:
            raise ConfigError(f"{source}: {where}: {problem}")
        for length in cell["test_lengths"]:  # a model built for one image grid keeps it
            task = get_task(cell["task"], seq_len=length, **cell["task_params"])
            if variant_params(cell, task) != trained:
                raise ConfigError(
                    f"{source}: {cell['task']} / {cell['variant']}: the model is built for the "
                    f"grid of train length {cell['train_len']}, {trained.get('grid')}, and "
                    f"cannot be tested at length {length} (grid {task.grid}); test 2-D variants "
                    "at their train length"
                )


def training_problem(
    cell: dict[str, Any], task: Task, model: SequenceModel, world: int | None
) -> str | None:
    """What keeps the cell from training or evaluating with its task and model, or None."""
    train = cell["train"]
    if train["generation"] and not (cell["causal"] and task.head == "token"):
        got = "causal=false" if not cell["causal"] else f"a {task.head!r} head, one label"
        return (
            "train.generation=true decodes token by token, which needs causal=true and a task "
            f"with a per-token head; got {got}"
        )
    if getattr(task, "feed_answers", False) and not cell["causal"]:
        return (
            f"task {cell['task']!r} with feed_answers=true holds each answer in the slot after "
            "it, which a bidirectional model reads: it needs causal=true"
        )
    given = task.sample(1, 0).attention_inputs if model.reads else {}
    missing = [name for name in model.reads if name not in given]
    if missing:
        return (
            f"variant {cell['variant']!r} reads the call's {', '.join(missing)} (a graph per "
            f"sequence), which task {cell['task']!r} does not give; use a task that does "
            "(graph_hops)"
        )
    # Data parallel, each of the world's ranks trains batch_size // world sequences; context
    # parallel, every rank reads the whole batch and its shard of each sequence.
    shards = train.get("context_parallel", 1)
    if world is not None and shards == 1 and train["batch_size"] % world:
        return (
            f"train.batch_size={train['batch_size']} does not split over the {world} processes "
            f"of this run (each trains batch_size // {world} sequences); use a multiple of {world}"
        )
    if world is not None and shards > 1 and shards != world:
        return (
            f"train.context_parallel={shards} splits each sequence over {shards} processes, this "
            f"run has {world}; run it under torchrun --nproc-per-node {shards}"
        )
    return draw_problem(train, world if world is not None and shards == 1 else 1)


def results_file(config: RunConfig) -> Path:
    """Where the sweep's records go: ``<out>/results.jsonl``, ``{name}`` in out filled in."""
    return Path(config.out.format(name=config.name)) / "results.jsonl"


def finished_keys(path: Path) -> set[str]:
    """Keys of the cells whose latest record succeeded (failed ones run again)."""
    if not path.exists():
        return set()
    latest: dict[str, str] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            latest[record["cell"]["key"]] = record["status"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by a crash: that cell runs again
    return {key for key, status in latest.items() if status == "ok"}


def environment(context: distributed.Context) -> dict[str, Any]:
    return {
        "device": distributed.device_name(context.device),
        "device_type": context.device.type,
        "world_size": context.world,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": source_commit(),
    }


@functools.cache
def source_commit() -> str | None:
    """The repository's commit, ``+changes`` when its tracked files differ from it; None outside
    a git checkout (an installed package) or without git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True,
        )  # fmt: skip
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def run(
    config: RunConfig,
    source: str,
    context: distributed.Context,
    show_progress: bool = True,
    shard: tuple[int, int] = (0, 1),
    only: tuple[str, Path] | None = None,
) -> Path:
    """Run every cell not yet in the results file (with ``shard`` (K, N), of every N-th cell of
    the sweep from the K-th on), with ``config.threads`` CPU threads; returns the results file's
    path. ``only`` (cell key, file): that cell alone, its record written to that file (a cell
    that a Ray task trains in several processes, ray_launcher.py)."""
    with distributed.thread_count(config.threads):
        return _run(config, source, context, show_progress, shard, only)


def _run(
    config: RunConfig,
    source: str,
    context: distributed.Context,
    show_progress: bool,
    shard: tuple[int, int],
    only: tuple[str, Path] | None,
) -> Path:
    results = results_file(config) if only is None else only[1]
    out = results.parent
    done = finished_keys(results)
    sweep = cells(config) if only is None else [c for c in cells(config) if c["key"] == only[0]]
    waiting = sum(c["key"] not in done for c in sweep)
    # The share is of the sweep, not of the cells left: a worker that starts after another has
    # finished some cells would otherwise count a different remainder and drop a cell.
    todo = [c for c in sweep[shard[0] :: shard[1]] if c["key"] not in done]
    if context.main:
        out.mkdir(parents=True, exist_ok=True)
        mine = "" if shard[1] == 1 else f" (worker {shard[0] + 1} of {shard[1]}: {len(todo)})"
        print(
            f"{source}: {waiting} cells to run{mine}, {len(sweep) - waiting} done in {results}",
            flush=True,
        )
    total_steps = sum(c["train"].get("max_steps") or c["train"]["steps"] for c in todo)
    bar = progress_bar(total_steps, show_progress and context.main)
    for i, cell in enumerate(todo):
        label = (
            f"[{i + 1}/{len(todo)}] {cell['task']} L={cell['train_len']} "
            f"{cell['variant']}+{cell['encoding']} seed {cell['seed']}"
        )
        if bar is not None:
            bar.set_description(label)
        record = run_cell(cell, config, context, bar)
        if context.main:
            append_record(results, json.dumps(record) + "\n")
            if bar is None:
                print(
                    f"{label}: {record['status']} {record.get('accuracy', record.get('reason'))}",
                    flush=True,
                )
        distributed.barrier(context)
    if bar is not None:
        bar.close()
    return results


def run_cell(
    cell: dict[str, Any], config: RunConfig, context: distributed.Context, progress=None
) -> dict[str, Any]:
    """Train and evaluate one cell: its record, ``status`` "ok" or "failed" with the reason (a
    failure of the cell's own: out of memory, a variant that cannot run a length)."""
    from .train import train

    record: dict[str, Any] = {
        "cell": cell,
        "best_of": config.best_of,
        **({"about": config.about} if config.about else {}),
        "environment": environment(context),
    }
    start = time.time()
    try:
        out = results_file(config).parent
        checkpoint = out / "checkpoints" / f"{cell['key']}.pt" if config.save_checkpoints else None
        record.update(status="ok", **train(cell, context, progress, checkpoint))
    except (RuntimeError, ValueError, torch.cuda.OutOfMemoryError) as error:
        record.update(
            status="failed",
            reason=f"{type(error).__name__}: {error}",
            traceback=traceback.format_exc(limit=3),
        )
        if context.device.type == "cuda":
            torch.cuda.empty_cache()
    record["wall_seconds"] = round(time.time() - start, 2)
    return record


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_workers(workers: int | str) -> int:
    """``workers`` as a number: "auto" is one per GPU, or one per core without one."""
    if workers != "auto":
        return int(workers)
    return gpu_count() or os.cpu_count() or 1


def progress_bar(total: int, enabled: bool):
    if not enabled or total == 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval run", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a YAML file, e.g. eval/configs/quick.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value settings, e.g. train.steps=100")
    parser.add_argument(
        "--no-progress", action="store_true", help="one line per cell instead of a bar"
    )
    parser.add_argument("--no-report", action="store_true", help="skip the report at the end")
    # one worker's share of the cells (workers.py starts them; not for direct use)
    parser.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    # one cell, its record to a file (a Ray task's torchrun; not for direct use)
    parser.add_argument("--cell", nargs=2, default=None, help=argparse.SUPPRESS)
    # intermixed: options may come between the overrides (run CFG --no-progress train.steps=3)
    args = parser.parse_intermixed_args(argv)
    inner = args.shard is not None or args.cell is not None or "WORLD_SIZE" in os.environ
    try:
        config = load_config(RunConfig, args.config, args.overrides)
        check_names(config, args.config)
        # this run's processes: torchrun's, or one; Ray's driver knows a cell's once connected
        ray = config.launcher == "ray" and not inner
        world = None if ray else int(os.environ.get("WORLD_SIZE", "1"))
        check_cells(cells(config), args.config, world)
        shard = (0, 1) if args.shard is None else parse_shard(args.shard)
        workers = resolve_workers(config.workers)
    except (ConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if config.launcher == "ray" and not inner:
        from .ray_launcher import run_on_ray

        results = results_file(config)
        try:
            status = run_on_ray(
                config, args.config, args.overrides, cells(config), finished_keys(results),
                results, run_cell, not args.no_progress, check_cells,
            )  # fmt: skip
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        main_process = True
    elif workers > 1 and not inner:
        status = run_in_processes(args.config, args.overrides, workers, gpu_count())
        main_process = True
    else:
        try:
            context = distributed.start(config.device)
        except ValueError as error:  # device=cuda on a machine without one
            print(f"error: {args.config}: {error}", file=sys.stderr)
            return 2
        only = None if args.cell is None else (args.cell[0], Path(args.cell[1]))
        try:
            run(config, args.config, context, not args.no_progress, shard, only)
        finally:
            distributed.stop(context)
        status, main_process = 0, context.main and only is None
    if status == 0 and main_process and not args.no_report:
        from .report import write_report

        results = results_file(config)
        print(write_report(results, results.parent, config.best_of))
    return status
