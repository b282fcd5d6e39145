"""Accuracy per slice of the test set (MQAR's gap buckets, say), from a sweep's result lines.

Each finished cell records, per test length, its accuracy on every value of each slice the task
defines (``Batch.slices``): for MQAR, ``gap`` is the distance from a key to its query, bucketed to
powers of two (a bucket is named by its lower bound). The table puts the buckets side by side, so
that recall beyond a window's reach reads off one row::

    | task | test len | variant | encoding | gap 2 | gap 4 | ... | gap 128 |
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from zoo.views.tables import markdown_table

from ..tasks import Batch, Task
from .needs import NEEDS, VERDICT_SLICE, Needs, needs, scored
from .reach import GRAPH, Reach, graph_mask, pattern_reach
from .verdict import UNDECIDED, CellVerdict, judge_cell


def slice_table(records: list[dict[str, Any]], name: str) -> str | None:
    """Accuracy per value of slice ``name``, averaged over seeds, per task, test length, variant
    and encoding, from each cell's latest successful record; None when no record has the slice."""
    latest = {r["cell"]["key"]: r for r in records if r.get("status") == "ok"}
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in latest.values():
        cell = record["cell"]
        for length, slices in (record.get("slices") or {}).items():
            for value, accuracy in slices.get(name, {}).items():
                key = (cell["task"], int(length), cell["variant"], cell["encoding"])
                groups[key][value].append(accuracy)
    if not groups:
        return None
    values = sorted({v for by_value in groups.values() for v in by_value}, key=_order)
    rows = [
        [*key, *(_mean(by_value.get(v)) for v in values)]
        for key, by_value in sorted(groups.items())
    ]
    headers = ["task", "test len", "variant", "encoding", *(f"{name} {v}" for v in values)]
    return markdown_table(headers, rows)


def _order(value: str) -> tuple[int, float | str]:
    try:
        return (0, float(value))
    except ValueError:
        return (1, value)


def _mean(values: list[float] | None) -> str:
    return "-" if not values else f"{statistics.fmean(values):.3f}"


def slice_reach(
    cell: dict[str, Any],
    length: int,
    batches: Iterable[tuple[Task, Batch]],
    params: dict[str, Any],
) -> dict[str, Any]:
    """How many answers of each slice value have their needed positions within reach
    (eval/harness/needs.py, eval/harness/reach.py), over ``batches`` (the evaluated ones) of the
    cell at ``length``, its variant built with ``params``: ``{"basis": ..., "note": ...,
    "slices": {name: {value: [in reach, answers]}}}``; ``in reach`` is None where no reach is
    known (a task without a rule in needs.py, a variant the harness cannot read)."""
    model = cell["model"]
    reach = pattern_reach(
        cell["variant"], params, length, cell.get("causal", False), model["depth"],
        model.get("heads", 1),
    )  # fmt: skip
    counts: dict[str, dict[int, list[int | None]]] = defaultdict(dict)
    known = reach.known and cell["task"] in NEEDS
    for task, batch in batches:
        if batch.targets.dim() == 2:  # a token head: every scored target
            example, query = scored(batch)
        else:  # a sequence head: one pooled answer per sequence
            example = torch.arange(batch.targets.shape[0])
            query = torch.full_like(example, -1)
        wanted = needs(cell["task"], task, batch) if known else None
        ok = None if wanted is None else in_reach(wanted, reach, batch, cell, params, length)
        for name, keys in batch.slices.items():
            values = keys[example, query] if keys.dim() == 2 else keys[example]
            for value in values.unique().tolist():
                chosen = values == value
                slot = counts[name].setdefault(value, [None if ok is None else 0, 0])
                slot[1] += int(chosen.sum())
                if ok is not None:
                    slot[0] += int(ok[chosen].sum())
    return {
        "basis": reach.basis if known else "unknown",
        **({"note": reach.note} if reach.note else {}),
        "slices": {
            name: {str(v): c for v, c in sorted(by_value.items())}
            for name, by_value in counts.items()
        },
    }


def in_reach(
    wanted: Needs,
    reach: Reach,
    batch: Batch,
    cell: dict[str, Any],
    params: dict[str, Any],
    length: int,
) -> Tensor:
    """(T,) bool: whether each answer's needed positions all lie within its query's reach (for
    a pooled answer, within the reach of some real position)."""
    ok = torch.zeros(wanted.query.numel(), dtype=torch.bool)
    if wanted.edges is not None and reach.basis != GRAPH:  # a variant that never sees the edges
        return ~wanted.edges
    for example in wanted.example.unique().tolist() if reach.basis == GRAPH else [None]:
        targets = (
            torch.arange(wanted.query.numel())
            if example is None
            else (wanted.example == example).nonzero().flatten()
        )
        sizes = wanted.lengths[wanted.example[targets]]
        for n in sizes.unique().tolist():
            chosen = targets[sizes == n]
            if example is None:  # composed where needed: reach.matrix(n), or reach.covers
                matrix = None
            else:
                edges = batch.attention_inputs["edge_index"][example]
                mask = graph_mask(cell["variant"], params, length, cell.get("causal", False), edges)
                matrix = reach.for_graph(mask[:n, :n])
            needed = wanted.needed[chosen, :n]
            queries = wanted.query[chosen]
            token = queries >= 0
            if token.any():
                rows = (reach.matrix(n) if matrix is None else matrix)[queries[token]]
                ok[chosen[token]] = (rows | ~needed[token]).all(1)
            if (~token).any():  # pooled: some real position reaches every needed one
                if example is None:
                    ok[chosen[~token]] = reach.covers(n, needed[~token])
                else:
                    missed = (~matrix).float() @ needed[~token].float().T  # (n, answers)
                    ok[chosen[~token]] = (missed == 0).any(0)
    return ok


def slice_verdict(
    task: str,
    slices: dict[str, dict[str, float]],
    reach: dict[str, Any] | None,
    chance: float,
    keep: Callable[[str], bool] | None = None,
) -> CellVerdict:
    """The verdict (eval/harness/verdict.py) of a cell at one length from its accuracy per slice
    (``slices``: name -> value -> accuracy), the slices' reach (``slice_reach``'s result, None
    where unknown) and chance, read on the task's verdict slice (``needs.VERDICT_SLICE``);
    ``keep`` restricts the values judged."""
    name = VERDICT_SLICE.get(task)
    if name is None or name not in slices:
        return CellVerdict(UNDECIDED, f"{task}: no slice to judge by")
    entry = reach or {}
    by_value = (entry.get("slices") or {}).get(name)
    return judge_cell(name, slices[name], by_value, entry.get("basis", "unknown"), chance, keep)
