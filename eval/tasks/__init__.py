"""Synthetic long-sequence tasks for the eval harness, looked up by name.

>>> task = get_task("mqar", seq_len=256, num_kv_pairs=16)
>>> batch = task.sample(8, seed=0)

Every task's parameters, token ids and layout are documented in its module's docstring.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from .base import IGNORE, PAD, Batch, Task
from .copy import Copy
from .graph_hops import GraphHops
from .induction import Induction
from .listops import ListOps
from .mqar import MQAR
from .passkey import Passkey
from .pathfinder import Pathfinder
from .selective_copy import SelectiveCopy

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (Copy, GraphHops, Induction, ListOps, MQAR, Passkey, Pathfinder, SelectiveCopy)
}

__all__ = ["IGNORE", "PAD", "TASKS", "Batch", "Task", "get_task", "list_tasks"]


def list_tasks() -> list[str]:
    """The registered task names, sorted."""
    return sorted(TASKS)


def _unknown(kind: str, value: str, known: list[str]) -> str:
    close = difflib.get_close_matches(value, known, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown {kind} {value!r}{hint} (known: {', '.join(known)})"


def get_task(name: str, **params: Any) -> Task:
    """Build the task called `name` with `params` (``seq_len`` is required).

    Unknown names and unknown parameter names raise ValueError with close matches suggested.
    """
    if name not in TASKS:
        raise ValueError(_unknown("task", str(name), list_tasks()) + ".")
    cls = TASKS[name]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for key in params:
        if key not in accepted:
            raise ValueError(_unknown(f"parameter for task {name!r}:", key, accepted) + ".")
    if "seq_len" not in params:
        raise ValueError(f"get_task({name!r}) needs seq_len, the sequence length; pass seq_len=.")
    return cls(**params)
