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
from typing import Any

from zoo.views.tables import markdown_table


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
