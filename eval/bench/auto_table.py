"""``python -m eval auto-table BENCH.json [...] [--out zoo/backends/auto_table.json]``: the table
behind ``backend="auto"``, from benchmark results.

For every measured point (device type, dtype, variant with all its parameters, causal, pass, n)
it keeps the fastest zoo backend that ran without error (and passed the reference check, where
the benchmark ran one: up to its check_max_len), and the runner-up. Peers (dense SDPA, standard
FlexAttention, xFormers) are the yardstick, not candidates: auto chooses among zoo backends.
An ``auto`` cell is a measurement of the backend it ran (its ``resolved``, such as ``auto ->
flex``) where that backend was not timed directly at the point: a sweep run with
``backends=[auto,blocked,xformers]`` times flex only through auto, and leaving it out would crown
xformers or blocked. Compiled flex is no candidate on CPU: its first call per shape compiles for
seconds, a cost the timed figure leaves out. A backend instance a config built with options
(``backend_instances``, such as ``blocked_bf16``) is no candidate either: auto chooses among the
registered backends as they come. Entries of the device types and dtypes in the new results
replace the table's old ones; the others stay: give every file of a device type at once.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from zoo.backends import list_backends
from zoo.backends.auto_table import TABLE, comparable
from zoo.functional import resolved_params

POINT = ("device", "dtype", "variant", "params", "causal", "pass", "n")


def entries_from(bench: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """The table's entries of one benchmark file: the fastest backend at each point."""
    return _entries(timed_at_points(bench, source))


def timed_at_points(bench: dict[str, Any], source: str) -> dict[tuple, dict[str, tuple]]:
    """Each point's backends that ran there: point -> {backend: (ms, source)}."""
    device = bench["header"]["device_type"]
    direct: dict[tuple, dict[str, float | None]] = defaultdict(dict)  # None: ran, not ok
    through_auto: dict[tuple, dict[str, float]] = defaultdict(dict)
    registered = set(list_backends())
    for cell in bench["cells"]:
        if cell["kind"] != "zoo" or cell["backend"] not in registered | {"auto"}:
            continue
        by_auto = cell["backend"] == "auto"
        name = cell.get("resolved") if by_auto else cell["backend"]
        if name in (None, "auto") or (device == "cpu" and name == "flex"):
            continue
        ms = cell["time_ms"] if cell["status"] == "ok" else None
        point = _point(device, cell)
        if not by_auto:
            direct[point][name] = ms
        elif ms is not None:
            through_auto[point].setdefault(name, ms)
    # An auto cell stands in only for a backend not timed directly at its point (a direct cell
    # that failed is not rescued by auto's run of the same backend).
    timed: dict[tuple, dict[str, float]] = {}
    for point in {*direct, *through_auto}:
        ran = {name: ms for name, ms in direct.get(point, {}).items() if ms is not None}
        stand_ins = through_auto.get(point, {}).items()
        ran |= {name: ms for name, ms in stand_ins if name not in direct.get(point, {})}
        if ran:
            timed[point] = {name: (ms, source) for name, ms in ran.items()}
    return timed


def _entries(timed: dict[tuple, dict[str, tuple]]) -> list[dict[str, Any]]:
    """One entry per point: the fastest backend, and the runner-up."""
    entries = []
    for point, ran in sorted(timed.items()):
        times = sorted((ms, name, source) for name, (ms, source) in ran.items())
        best = times[0]
        runner = times[1] if len(times) > 1 else (float("nan"), "-", None)
        entry = dict(zip(POINT, point, strict=True))
        entry["params"] = json.loads(entry["params"])
        entries.append(
            entry
            | {
                "backend": best[1],
                "time_ms": round(best[0], 4),
                "runner_up": runner[1],
                "runner_up_ms": round(runner[0], 4),
                "source": best[2],
            }
        )
    return entries


def _point(device: str, cell: dict[str, Any]) -> tuple:
    """The cell's POINT, its parameters resolved and made one JSON string."""
    params = json.dumps(
        comparable(resolved_params(cell["variant"], cell["params"])), sort_keys=True
    )
    return (device, cell["dtype"], cell["variant"], params, cell["causal"], cell["pass"], cell["n"])


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    replaced = {(e["device"], e["dtype"]) for e in new}
    kept = [e for e in old if (e["device"], e["dtype"]) not in replaced]
    return sorted(kept + new, key=lambda e: tuple(str(e[k]) for k in POINT))


def write_table(bench_files: list[str], out: str | Path = TABLE) -> list[dict[str, Any]]:
    out = Path(out)
    old = json.loads(out.read_text())["entries"] if out.exists() else []
    # The files' points pooled: one entry per point, the fastest of every file's backends there
    # (a backend timed in two files: the later file's time).
    timed: dict[tuple, dict[str, tuple]] = defaultdict(dict)
    for f in bench_files:
        for point, ran in timed_at_points(json.loads(Path(f).read_text()), str(f)).items():
            timed[point] |= ran
    entries = merge(old, _entries(timed))
    out.write_text(
        json.dumps({"written_by": "python -m eval auto-table", "entries": entries}, indent=1) + "\n"
    )
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval auto-table", description=__doc__.splitlines()[0]
    )
    parser.add_argument("bench", nargs="+", help="bench.json files written by python -m eval bench")
    parser.add_argument(
        "--out", default=str(TABLE), help="the table to update (default: the zoo's)"
    )
    args = parser.parse_intermixed_args(argv)  # options among the names
    entries = write_table(args.bench, args.out)
    print(f"{args.out}: {len(entries)} entries")
    return 0
