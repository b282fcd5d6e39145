"""``python -m eval bench-report BENCH.json [BENCH.json ...] [out=DIR]``: one report from the
bench.json files of a sweep run in pieces (one command each, e.g. ``lengths=[...]`` or
``variants=[...]`` overrides), or a report re-rendered from one file.

Pieces must agree on what makes their times comparable side by side (COMPARABLE: the device, the
torch version, the dtype, the shape of q, k and v, warm-up, repeats and min_time_s); a piece
interrupted before its end (complete=false) counts with the cells it wrote. A cell is keyed by
(variant, backend, kind: zoo or peer, pass, causal, n, params): a key in two files is an error
unless both records are the same. The dense peer's time at each (n, causal, pass) is looked up
across all the pieces, so a piece run without ``sdpa_dense`` gets its sparsity realization from
another; a cell whose dense peer is in no piece has none. The merged header keeps the fields
all pieces share; ``pieces`` lists each one's file, command, wall time and the fields it differs
in; exponents are fitted over the shared fit_points (3 where the pieces differ). A merged
bench.json can be an input again: its pieces are carried over. One file is re-rendered with its
header as it is; ``out`` defaults to its folder.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from . import report
from .config import BenchConfig
from .run import write_report

COMPARABLE = (
    "device", "device_type", "torch", "dtype",
    "config.batch", "config.heads", "config.kv_heads", "config.head_dim", "config.warmup",
    "config.repeats", "config.min_time_s",
)  # fmt: skip
KEY = ("variant", "backend", "kind", "pass", "causal", "n", "params")
DERIVED = ("dense_time_ms", "sparsity_realization")  # recomputed from the merged cells
PIECE_FIELDS = (
    "command", "argv", "config_file", "started", "finished", "wall_seconds",
    "load_average_start", "load_average_end",
)  # fmt: skip


class MergeError(ValueError):
    """Pieces that cannot make one report; the message names the files and the field."""


def load(path: Path) -> dict[str, Any]:
    """A bench.json, checked to hold a header and cells."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise MergeError(f"{path}: cannot read it as a bench.json: {error}") from error
    if not isinstance(data, dict) or not {"header", "cells"} <= set(data):
        raise MergeError(f"{path}: not a bench.json (python -m eval bench writes one per run)")
    return data


# Fields that files written before them lack, with the value those files ran with.
ADDED_LATER = {"config.min_time_s": 0.0}


def header_field(header: dict[str, Any], name: str) -> Any:
    """A header field by its dotted name ("config.heads")."""
    value: Any = header
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None and name in ADDED_LATER:
        return ADDED_LATER[name]
    return value


def check_comparable(paths: list[Path], datas: list[dict[str, Any]]) -> None:
    """Every file's COMPARABLE fields equal the first file's."""
    first = datas[0]["header"]
    for path, data in zip(paths[1:], datas[1:], strict=True):
        for name in COMPARABLE:
            ours, theirs = header_field(first, name), header_field(data["header"], name)
            if ours != theirs:
                raise MergeError(
                    f"{path}: header field {name} is {theirs!r}, but {paths[0]} has {ours!r}; "
                    "pieces of one report must share the device, torch version, dtype, batch, "
                    "heads, kv_heads, head_dim, warmup, repeats and min_time_s (run the pieces "
                    "with the same config on the same machine)"
                )


def cell_key(cell: dict[str, Any]) -> tuple:
    return tuple(json.dumps(cell.get(k), sort_keys=True) for k in KEY)


def merge_cells(paths: list[Path], datas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The union of the files' cells (a key twice only if the records agree), ordered by n
    (stable: each file's order within a length), with realization recomputed across them."""
    seen: dict[tuple, tuple[Path, dict[str, Any]]] = {}
    for path, data in zip(paths, datas, strict=True):
        for cell in data["cells"]:
            key = cell_key(cell)
            if key not in seen:
                seen[key] = (path, dict(cell))
                continue
            other_path, other = seen[key]
            if _measured(other) != _measured(cell):
                name = ", ".join(f"{k}={cell[k]}" for k in KEY)
                raise MergeError(
                    f"the cell ({name}) is in both {other_path} and {path} with different "
                    "figures; each cell must come from one piece (run the dense peer sdpa_dense "
                    "in one piece only: peers=[...] without it in the others)"
                )
    cells = sorted((cell for _, cell in seen.values()), key=lambda c: c["n"])
    realize_all(cells)
    return cells


def _measured(cell: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cell.items() if k not in DERIVED}


def realize_all(cells: list[dict[str, Any]]) -> None:
    """Each cell's dense_time_ms and sparsity_realization from the dense peer at its (n, causal,
    pass), wherever that came from; None where no piece has it."""
    dense = {(c["n"], c["causal"], c["pass"]): c for c in cells if c["backend"] == "sdpa_dense"}
    for cell in cells:
        cell.update(dict.fromkeys(DERIVED))
        report.realize(cell, dense.get((cell["n"], cell["causal"], cell["pass"])))


def pieces_of(path: Path, data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every piece in a file, each a full header with its file, completeness and cell count (a
    merged file holds several: its shared fields and each piece's own)."""
    header = data["header"]
    if "pieces" not in header:
        own = {
            "file": str(path),
            "complete": bool(data.get("complete")),
            "cells": len(data["cells"]),
        }
        return [header | own]
    shared = {k: v for k, v in header.items() if k not in ("pieces", *PIECE_FIELDS)}
    return [
        shared | piece | {"config": header["config"] | piece.get("config", {})}
        for piece in header["pieces"]
    ]


def _common(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """The items every dict has with the same value, in the first dict's order."""
    return {k: v for k, v in dicts[0].items() if all(k in d and d[k] == v for d in dicts[1:])}


def merge_headers(pieces: list[dict[str, Any]], argv: list[str]) -> dict[str, Any]:
    """The fields all pieces share, this command, the summed wall time and the pieces (each with
    its file, command, wall time and the fields it differs in)."""
    own = ("file", "complete", "cells", *PIECE_FIELDS)
    header = _common([{k: v for k, v in p.items() if k not in own} for p in pieces])
    header["config"] = _common([p["config"] for p in pieces])
    header["command"] = shlex.join(getattr(sys, "orig_argv", sys.argv))
    header["argv"] = list(argv)
    header["wall_seconds"] = round(sum(p.get("wall_seconds") or 0 for p in pieces), 1)
    header["pieces"] = []
    for piece in pieces:
        entry = {k: piece.get(k) for k in own}
        entry |= {k: v for k, v in piece.items() if k not in own and k not in header}
        config = {k: v for k, v in piece["config"].items() if k not in header["config"]}
        if config:
            entry["config"] = config
        header["pieces"].append(entry)
    return header


def merge(paths: list[Path], out: Path, argv: list[str] | None = None) -> Path:
    """Read the bench.json files, check and merge them, and write the report into ``out``."""
    if len({p.resolve() for p in paths}) < len(paths):
        raise MergeError(f"a file is given twice in {[str(p) for p in paths]}")
    datas = [load(p) for p in paths]
    check_comparable(paths, datas)
    cells = merge_cells(paths, datas)
    pieces, seen = [], set()
    for path, data in zip(paths, datas, strict=True):
        for piece in pieces_of(path, data):
            # a piece held by a merged file and given again (or by two merged files) counts
            # once: its cells are merged once, and so are its wall time and its entry
            key = (Path(piece["file"]).resolve(), piece.get("command"), piece.get("wall_seconds"))
            if key not in seen:
                seen.add(key)
                pieces.append(piece)
    header = datas[0]["header"] if len(paths) == 1 else merge_headers(pieces, argv or [])
    complete = all(p["complete"] for p in pieces)
    print(f"bench-report: {len(cells)} cells from {len(pieces)} pieces -> {out}", flush=True)
    for piece in pieces:
        if not piece["complete"]:
            print(
                f"note: {piece['file']} is incomplete (interrupted); its {piece['cells']} cells "
                "count, and the report says so (complete=false)"
            )
    out.mkdir(parents=True, exist_ok=True)
    fit_points = header["config"].get("fit_points", BenchConfig.fit_points)
    write_report(out, header, cells, fit_points, complete)
    return out


def main(argv: list[str] | None = None) -> int:
    """The ``bench-report`` command; returns the exit status (2 for files that do not merge)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m eval bench-report", description=__doc__.split(":")[0]
    )
    parser.add_argument("items", nargs="+", help="BENCH.json [BENCH.json ...] [out=DIR]")
    items = parser.parse_args(argv).items
    options = dict(item.split("=", 1) for item in items if "=" in item)
    paths = [Path(item) for item in items if "=" not in item]
    try:
        if set(options) - {"out"}:
            unknown = sorted(set(options) - {"out"})
            raise MergeError(
                f"unknown option {unknown[0]!r}; bench-report takes BENCH.json files and out=DIR"
            )
        if not paths:
            raise MergeError(
                "no bench.json given; usage: python -m eval bench-report BENCH.json "
                "[BENCH.json ...] out=DIR"
            )
        if "out" not in options and len(paths) > 1:
            raise MergeError(
                "out=DIR is needed with several files (one file is re-rendered in its own folder "
                "by default)"
            )
        merge(paths, Path(options.get("out") or paths[0].parent), argv)
    except MergeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
