"""The published protocol's choice: per cell, the best of a learning-rate sweep (and of seeds,
where a config asks for it), as Zoology reports each model at its best learning rate.

A *cell of the protocol* is everything that shaped a result except what the sweep varies: the
task, lengths, variant, encoding and settings, without ``train.lr`` (and without the seed when
the config's ``best_of`` names "seed"). Its candidates are the sweep's learning rates; each is
scored by its accuracy at the train length, averaged over seeds (or, with "seed" in best_of, the
best seed's). The best score wins; a tie goes to the smaller learning rate. Every candidate stays
in the results and in the report's sweep table, the chosen one marked.

Accuracy is measured on the evaluation sequences the report also shows, as Zoology selects on
its validation accuracy: the chosen score is the best of a handful, slightly optimistic.

The records of one results file are chosen by one rule, ``best_of``: the config's where the run
writes its report, else that of the last record written (the latest run's). A run again with
another ``best_of`` trains nothing and changes the choice; each record keeps the rule it was
trained under, and records of two rules were once split into two sweeps of one cell.

How long a cell trained (``train.until``, ``max_steps``, ``check_every``) is not part of its
setting: a cell trained again with ``train.until=learned`` (to train a "not learned" cell further)
is the same candidate, and its latest record in the file replaces the earlier one.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

IDENTITY = ("task", "train_len", "variant", "encoding", "seed")
# Training settings that say how long a cell trained, not what it is (see the module docstring).
TRAINING_LENGTH = ("until", "max_steps", "check_every")


def setting_of(cell: dict[str, Any], leave_out: tuple[str, ...] = ()) -> str:
    """A short name for everything else that shaped a cell (parameters, model, training), so that
    cells of different configs in one results file are never averaged together as seeds.
    ``leave_out`` names training settings the name ignores ("lr": the cells of one sweep)."""
    rest = {k: v for k, v in cell.items() if k not in (*IDENTITY, "key", "test_lengths")}
    left_out = (*leave_out, *TRAINING_LENGTH)
    rest["train"] = {k: v for k, v in rest.get("train", {}).items() if k not in left_out}
    return hashlib.sha1(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:6]


@dataclass
class Sweep:
    """One cell of the protocol: its candidates' scores and the chosen learning rate (and seed)."""

    task: str
    train_len: int
    variant: str
    encoding: str
    setting: str
    best_of: tuple[str, ...]
    # lr (None in records without one) -> score at the train length (None: every run failed)
    scores: dict[float | None, float | None] = field(default_factory=dict)
    chosen_lr: float | None = None
    chosen_seed: int | None = None
    chosen: list[dict[str, Any]] = field(default_factory=list)  # the chosen records


def latest(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each cell's latest record (a rerun cell's last line wins)."""
    return list({r["cell"]["key"]: r for r in records}.values())


def rule_of(records: list[dict[str, Any]], best_of: list[str] | None = None) -> tuple[str, ...]:
    """The choice's rule for ``records`` (see the module docstring): ``best_of``, else the last
    record's, else "lr"."""
    if best_of is None:
        best_of = records[-1].get("best_of", ["lr"]) if records else ["lr"]
    return tuple(sorted(best_of))


def latest_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each candidate's latest record: as ``latest``, and of the records of one cell trained for
    different lengths (``TRAINING_LENGTH``), the one written last."""
    last: dict[tuple, tuple[int, dict[str, Any]]] = {}
    for position, record in enumerate(records):
        cell = record["cell"]
        candidate = (
            *(cell.get(k) for k in IDENTITY),
            setting_of(cell),
            json.dumps(cell.get("train", {}).get("lr")),
        )
        last[candidate] = (position, record)
    return [record for _, record in sorted(last.values(), key=lambda item: item[0])]


def accuracy_at_train_length(record: dict[str, Any]) -> float | None:
    if record.get("status") != "ok":
        return None
    return (record.get("accuracy") or {}).get(str(record["cell"]["train_len"]))


def choose(records: list[dict[str, Any]], best_of: list[str] | None = None) -> list[Sweep]:
    """The sweeps in ``records`` (each cell's latest record), each with its chosen records, by
    the rule ``best_of`` (``rule_of``)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    best_of = rule_of(records, best_of)
    for record in latest_runs(records):
        cell = record["cell"]
        key = (
            cell["task"],
            cell["train_len"],
            cell["variant"],
            cell["encoding"],
            setting_of(cell, leave_out=("lr",)),
            best_of,
        )
        groups[key].append(record)
    sweeps = []
    for (task, train_len, variant, encoding, setting, best_of), members in sorted(
        groups.items(), key=lambda item: item[0][:5]
    ):
        sweep = Sweep(task, train_len, variant, encoding, setting, best_of)
        by_lr: dict[float | None, list[dict[str, Any]]] = defaultdict(list)
        for record in members:
            by_lr[record["cell"].get("train", {}).get("lr")].append(record)
        best: tuple[float, float, list[dict[str, Any]]] | None = None
        for lr, runs in sorted(by_lr.items(), key=lambda item: item[0] or 0.0):
            scored = [(accuracy_at_train_length(r), r) for r in runs]
            ok = [(a, r) for a, r in scored if a is not None]
            if not ok:
                sweep.scores[lr] = None
                continue
            if "seed" in best_of:
                accuracy, record = max(ok, key=lambda item: (item[0], -item[1]["cell"]["seed"]))
                score, chosen = accuracy, [record]
            else:
                score, chosen = statistics.fmean(a for a, _ in ok), [r for _, r in ok]
            sweep.scores[lr] = score
            if best is None or score > best[1]:
                best = (lr, score, chosen)
        if best is None:  # every candidate failed: show the failures
            sweep.chosen = members
        else:
            sweep.chosen_lr, _, sweep.chosen = best
            if "seed" in best_of:
                sweep.chosen_seed = sweep.chosen[0]["cell"]["seed"]
        sweeps.append(sweep)
    return sweeps


def chosen_records(
    records: list[dict[str, Any]], best_of: list[str] | None = None
) -> list[dict[str, Any]]:
    """The records the protocol reports: each sweep's chosen ones."""
    return [r for sweep in choose(records, best_of) for r in sweep.chosen]
