"""What a result record learned, judged against what its pattern reaches: its verdict per test
length (eval/harness/verdict.py), for records of any age.

A record trained since the verdicts were introduced carries ``slice_reach`` (answers in reach and
answers, per slice value, at each test length). An older one does not; its reach is computed
here from its cell: the evaluation sequences are drawn again (the same seeds as ``evaluate``:
sampling is a pure function of the task, the length and the seed; for cell seed 0, whose draws
eval/harness/seeds.py kept, and the only seed of such records here) and each answer's needed
positions checked against the pattern's reach, so the verdicts of committed results need no
retraining. The accuracies and chance are the record's own.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from .needs import VERDICT_SLICE
from .slices import slice_reach, slice_verdict
from .train import eval_batches, variant_params
from .verdict import UNDECIDED, CellVerdict


def reach_of(record: dict[str, Any], length: int | str) -> dict[str, Any] | None:
    """The record's ``slice_reach`` at ``length``, recorded or computed from its cell (None
    when it cannot be: a cell the task or the zoo no longer accepts)."""
    recorded = (record.get("slice_reach") or {}).get(str(length))
    if recorded is not None:
        return recorded
    cell = record["cell"]
    try:  # what the reach depends on, so that the cells of a learning-rate sweep share it
        model, train = cell["model"], cell["train"]
        shared = {
            **{k: cell[k] for k in ("task", "task_params", "variant", "variant_params", "seed")},
            "causal": cell.get("causal", False),
            "model": {"depth": model["depth"], "heads": model.get("heads", 1)},
            "train": {k: train[k] for k in ("eval_samples", "eval_batch_size")},
        }
    except KeyError:
        return None
    return computed_reach(json.dumps(shared, sort_keys=True), int(length))


@functools.lru_cache(maxsize=512)
def computed_reach(frozen: str, length: int) -> dict[str, Any] | None:
    cell = json.loads(frozen)
    try:
        drawn = list(eval_batches(cell, length))
        return slice_reach(cell, length, drawn, variant_params(cell, drawn[0][0]))
    except (KeyError, TypeError, ValueError, RuntimeError):
        return None


def record_verdict(
    record: dict[str, Any], length: int | str | None = None, keep=None
) -> CellVerdict:
    """The record's verdict at ``length`` (its train length by default); ``keep`` (a predicate
    on slice values) restricts the slices judged (the extrapolation's distances seen in
    training)."""
    if record.get("status") != "ok":
        return CellVerdict(UNDECIDED, "no result")
    length = str(record["cell"]["train_len"] if length is None else length)
    slices = (record.get("slices") or {}).get(length)
    if slices is None:
        return CellVerdict(UNDECIDED, f"not tested at {length}")
    chance = record.get("chance_accuracy")
    if chance is None:
        return CellVerdict(UNDECIDED, "no chance recorded")
    task = record["cell"]["task"]
    if VERDICT_SLICE.get(task) not in slices:  # nothing to judge: no reach to compute
        return slice_verdict(task, slices, None, chance, keep)
    return slice_verdict(task, slices, reach_of(record, length), chance, keep)
