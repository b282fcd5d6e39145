"""bench.md: the sweep as markdown tables, the fitted exponents and the goals."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from zoo.views.tables import markdown_table

from .report import Cell, backend_label, series, series_name

SHORT_STATUS = {
    "unsupported": "unsup.",
    "unavailable": "n/a",
    "mismatch": "MISMATCH",
    "oom": "OOM",
    "error": "error",
    "skipped": "skip",
}


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def point_label(pass_: str, causal: bool) -> str:
    return f"{pass_}, {'causal' if causal else 'non-causal'}"


def _groups(cells: Sequence[Cell]) -> list[tuple[str, bool]]:
    return sorted({(c["pass"], c["causal"]) for c in cells})


def time_tables(cells: Sequence[Cell]) -> str:
    """Per pass and causal: rows variant / backend, a column per length, the median time in ms
    (or why there is none)."""
    lengths = sorted({c["n"] for c in cells})
    parts = []
    for pass_, causal in _groups(cells):
        rows = []
        for (variant, _, p, c), members in series(cells).items():
            if (p, c) != (pass_, causal):
                continue
            by_n = {m["n"]: m for m in members}
            row = [variant, backend_label(members)]
            for n in lengths:
                m = by_n.get(n)
                if m is None:
                    row.append("")
                elif m["status"] == "ok":
                    row.append(_num(m["time_ms"]))
                else:
                    row.append(SHORT_STATUS.get(m["status"], m["status"]))
            rows.append(row)
        headers = ["variant", "backend", *(f"{n}" for n in lengths)]
        table = markdown_table(headers, rows)
        parts.append(f"### Time (ms): {point_label(pass_, causal)}\n\n{table}")
    return "\n\n".join(parts)


def realization_tables(cells: Sequence[Cell]) -> str:
    """Per length: rows variant / backend, a column per pass and causality, the sparsity
    realization (only cells that have one: a sparse backend beside its dense peer)."""
    points = _groups(cells)
    parts = []
    for n in sorted({c["n"] for c in cells}):
        at_n = [c for c in cells if c["n"] == n and c.get("sparsity_realization") is not None]
        rows: dict[tuple[str, str], dict[tuple[str, bool], float]] = defaultdict(dict)
        for c in at_n:
            point, value = (c["pass"], c["causal"]), c["sparsity_realization"]
            rows[(c["variant"], backend_label([c]))][point] = value
        if not rows:
            continue
        body = [
            [variant, backend, *(_num(got.get(point)) for point in points)]
            for (variant, backend), got in rows.items()
        ]
        headers = ["variant", "backend", *(point_label(*point) for point in points)]
        parts.append(f"### Sparsity realization at n = {n}\n\n{markdown_table(headers, body)}")
    return "\n\n".join(parts)


def _detail_row(c: Cell) -> list[object]:
    fraction = c["allowed_pairs"] / c["all_pairs"] if c["allowed_pairs"] else None
    error = _num(c["max_error"], 2) if c["checked"] else "unchecked"
    figures = [c["time_ms"], c["useful_tflops"], c["peak_memory_mb"], fraction]
    figures += [c["block_density"], c["sparsity_realization"], c["mask_build_ms"], c["compile_ms"]]
    figures.append(c.get("select_ms"))  # absent from results recorded before the column
    return [c["variant"], backend_label([c]), c["n"], *(_num(x) for x in figures), error]


def detail_tables(cells: Sequence[Cell]) -> str:
    """Per pass and causal: every successful cell with all its figures."""
    headers = [
        "variant", "backend", "n", "ms", "TFLOP/s", "peak MiB", "allowed/all", "density",
        "realization", "mask ms", "compile ms", "select ms", "max err",
    ]  # fmt: skip
    parts = []
    for pass_, causal in _groups(cells):
        rows = [
            _detail_row(c)
            for key, members in series(cells).items()
            if key[2:] == (pass_, causal)
            for c in members
            if c["status"] == "ok"
        ]
        if rows:
            table = markdown_table(headers, rows)
            parts.append(f"### Details: {point_label(pass_, causal)}\n\n{table}")
    return "\n\n".join(parts)


def not_run_table(cells: Sequence[Cell]) -> str:
    """Cells without a time, grouped by series, status and reason, with their lengths."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for c in cells:
        if c["status"] != "ok":
            key = (c["variant"], series_name(c), c["pass"], c["causal"], c["status"], c["reason"])
            groups[key].append(c["n"])
    rows = [
        [v, b, point_label(p, causal), s, ", ".join(map(str, ns)), (r or "")[:300]]
        for (v, b, p, causal, s, r), ns in sorted(groups.items(), key=lambda kv: kv[0][:5])
    ]
    if not rows:
        return "Every cell ran."
    return markdown_table(["variant", "backend", "point", "status", "lengths", "reason"], rows)


def exponent_table(exps: Sequence[dict[str, Any]]) -> str:
    rows = [
        [
            e["variant"],
            e["label"],
            point_label(e["pass"], e["causal"]),
            _num(e["time_exponent"], 2),
            _num(e["memory_exponent"], 2),
            ", ".join(map(str, e["lengths"])),
            e["complexity"],
        ]
        for e in exps
    ]
    headers = ["variant", "backend", "point", "time exp.", "memory exp.", "fitted over n", "stated"]
    return markdown_table(headers, rows) if rows else "Too few successful lengths to fit."


def pieces_line(pieces: Sequence[dict[str, Any]]) -> str:
    """The pieces a merged report (``python -m eval bench-report``) was made from."""
    described = []
    for piece in pieces:
        if piece["complete"]:
            run = f"{piece.get('wall_seconds', '-')} s"
        else:
            run = "interrupted: its cells up to the interruption"
        described.append(f"`{piece['file']}` (`{piece['command']}`; {piece['cells']} cells, {run})")
    return f"- merged from {len(pieces)} pieces: " + "; ".join(described)


def render(
    header: dict[str, Any],
    cells: Sequence[Cell],
    exps: Sequence[dict[str, Any]],
    goal_lines: Sequence[str],
    plots: Sequence[str],
    complete: bool = True,
) -> str:
    """The whole bench.md. A merged header lacks the fields its pieces differ in (threads, the
    check length, ...): each piece lists its own, and the facts show "per piece"."""
    config = header["config"]
    per_piece = "per piece"
    shared = {k: header.get(k, per_piece) or "-" for k in ("triton", "cuda", "threads")}
    summed = " (the pieces' sum)" if "pieces" in header else ""
    load = (
        "load average per piece (in bench.json)"
        if "pieces" in header
        else f"load average {header.get('load_average_start')} at the start, "
        f"{header.get('load_average_end')} at the end"
    )
    facts = [
        f"- device: {header['device']} ({header['device_type']}), torch {header['torch']}, "
        f"triton {shared['triton']}, CUDA {shared['cuda']}, "
        f"{shared['threads']} CPU threads; {load}",
        f"- q, k, v: batch {config['batch']}, heads {config['heads']}"
        f"{grouped_heads(config)}, head_dim "
        f"{config['head_dim']}, {header['dtype']}; median of {runs_of(config)} runs after "
        f"{config['warmup']} warm-up runs; reference check up to n = "
        f"{config.get('check_max_len', per_piece)} (normalised error <= {header['tolerance']:g})",
        f"- command: `{header['command']}`",
        f"- {len(cells)} cells, {sum(c['status'] == 'ok' for c in cells)} ok; "
        f"wall time {header.get('wall_seconds', '-')} s{summed}",
        "- time: median ms; TFLOP/s: useful, 4·B·H·allowed pairs·D (x3.5 with backward) per "
        "second; realization: (dense time / time) / (all pairs / allowed pairs), all pairs "
        "n(n+1)/2 at causal points; density: computed blocks / all blocks at the kernel's block; "
        "peak memory: above the inputs, one run (on a CPU from the profiler's allocation events)",
    ]
    if "pieces" in header:
        facts.insert(3, pieces_line(header["pieces"]))
    if not complete:
        facts.insert(
            0, "- **incomplete**: interrupted before its end; the cells measured until then"
        )
    sections = [
        f"# Attention benchmark: {header['device']}",
        "\n".join(facts),
        "## Goals\n\n" + "\n".join(goal_lines),
        "## Time\n\n" + time_tables(cells),
        "## Sparsity realization\n\n" + (realization_tables(cells) or "No cell has a dense peer."),
        "## Fitted exponents (log-log slope over the largest lengths)\n\n" + exponent_table(exps),
        "## Details\n\n" + (detail_tables(cells) or "No cell succeeded."),
        "## Cells not timed\n\n" + not_run_table(cells),
    ]
    if plots:
        sections.append("## Plots\n\n" + "\n".join(f"![{p}]({p})" for p in plots))
    return "\n\n".join(sections) + "\n"


def grouped_heads(config: dict) -> str:
    """ ", k/v heads 4 (grouped-query attention)" where the sweep set fewer k/v heads, else ""."""
    kv_heads = config.get("kv_heads")
    if kv_heads in (None, config["heads"]):
        return ""
    return f", k/v heads {kv_heads} (grouped-query attention)"


def runs_of(config: dict) -> str:
    """How many runs each median takes: ``repeats``, or at least that many where ``min_time_s``
    adds runs to fast cells."""
    if not config.get("min_time_s"):
        return str(config["repeats"])
    return f"at least {config['repeats']} (more while they took under {config['min_time_s']:g} s)"
