"""``python -m eval report RESULTS.jsonl [--out DIR]``: tables and plots from a sweep's results.

Writes ``report.md`` (accuracy per task, variant, encoding and test length, averaged over seeds,
with time and memory; accuracy per gap bucket where the task records gaps, as MQAR does),
``results.csv`` (one row per cell and test length) and two PNG plots:
accuracy against test length per variant, and accuracy against cost (the Pareto view: training
time per 1000 steps against accuracy at the train length).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from zoo.views.tables import markdown_table

from .slices import slice_table

CSV_FIELDS = [
    "task", "train_len", "test_len", "variant", "encoding", "setting", "seed", "key", "status",
    "accuracy", "train_seconds", "steps_per_second", "peak_memory_mb", "eval_ms_per_sequence",
    "reason",
]  # fmt: skip


def read_results(path: str | Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not a JSON line ({error})") from error
    return records


IDENTITY = ("task", "train_len", "variant", "encoding", "seed")


def setting_of(cell: dict[str, Any]) -> str:
    """A short name for everything else that shaped a cell (parameters, model, training), so that
    cells of different configs in one results file are never averaged together as seeds."""
    rest = {k: v for k, v in cell.items() if k not in (*IDENTITY, "key", "test_lengths")}
    return hashlib.sha1(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:6]


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per cell and test length, from each cell's latest record (a failed cell gives
    one row with its reason)."""
    latest = {r["cell"]["key"]: r for r in records}
    out = []
    for r in latest.values():
        c = r["cell"]
        base = {k: c[k] for k in IDENTITY}
        base.update(
            setting=setting_of(c), key=c["key"], status=r["status"], reason=r.get("reason", "")
        )
        for key in ("train_seconds", "steps_per_second", "peak_memory_mb"):
            base[key] = r.get(key)
        lengths = r.get("accuracy", {}) or {str(n): None for n in c["test_lengths"]}
        for length, accuracy in lengths.items():
            ms = r.get("eval_ms_per_sequence", {}).get(length)
            out.append(
                {**base, "test_len": int(length), "accuracy": accuracy, "eval_ms_per_sequence": ms}
            )
    return out


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_table(flat: list[dict[str, Any]]) -> str:
    """Accuracy and costs averaged over seeds, per task, length, variant, encoding and setting
    (the setting column appears when a results file holds more than one)."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in flat:
        key = (
            row["task"],
            row["train_len"],
            row["variant"],
            row["encoding"],
            row["setting"],
            row["test_len"],
        )
        groups[key].append(row)
    several = len({(k[:4], k[4]) for k in groups}) > len({k[:4] for k in groups})
    table = []
    for (task, train_len, variant, encoding, setting, test_len), members in sorted(groups.items()):
        ok = [m for m in members if m["status"] == "ok"]
        failed = [m for m in members if m["status"] != "ok"]
        status = f"{len(ok)}/{len(members)} ok" + (
            f" ({failed[0]['reason'][:60]})" if failed else ""
        )
        table.append([
            task, train_len, test_len, variant, encoding, *([setting] if several else []),
            _fmt(_mean([m["accuracy"] for m in ok])),
            _fmt(_mean([m["train_seconds"] for m in ok]), 1),
            _fmt(_mean([m["steps_per_second"] for m in ok]), 1),
            _fmt(_mean([m["peak_memory_mb"] for m in ok]), 0),
            status,
        ])  # fmt: skip
    headers = [
        "task",
        "train len",
        "test len",
        "variant",
        "encoding",
        *(["setting"] if several else []),
        "accuracy",
        "train s",
        "steps/s",
        "peak MB",
        "cells",
    ]
    return markdown_table(headers, table)


def _figure(panels: int, width: float = 5.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * panels, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    return fig, axes


MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p"]
LINESTYLES = ["-", "--", ":", "-."]


def _styles(flat: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """One distinct look per (variant, encoding, train length), the same in every plot: colour by
    variant, marker and line style by encoding and train length."""
    from matplotlib import colormaps

    variants = sorted({r["variant"] for r in flat})
    encodings = sorted({r["encoding"] for r in flat})
    train_lens = sorted({r["train_len"] for r in flat})
    n = len(variants)
    palette = colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"]
    colours = [palette(i if n <= 20 else i / max(n - 1, 1)) for i in range(n)]
    styles = {}
    for v, variant in enumerate(variants):
        for e, encoding in enumerate(encodings):
            for t, train_len in enumerate(train_lens):
                kind = e + t * len(encodings)
                styles[variant, encoding, train_len] = {
                    "color": colours[v],
                    "marker": MARKERS[kind % len(MARKERS)],
                    "linestyle": LINESTYLES[kind % len(LINESTYLES)],
                }
    return styles


def _label(variant: str, encoding: str, train_len: int, several_lengths: bool) -> str:
    return f"{variant}+{encoding}" + (f" (L={train_len})" if several_lengths else "")


def _legend(ax) -> int:
    """A legend right of the panel, in as many columns as keep it within the panel's height;
    returns the number of columns."""
    entries = len(ax.get_legend_handles_labels()[1])
    columns = max(1, -(-entries // 16))
    ax.legend(
        fontsize="small",
        loc="upper left",
        bbox_to_anchor=(1.02, 1.0),
        borderaxespad=0,
        ncols=columns,
    )
    return columns


def _fit_width(fig, panels: int, columns: int) -> None:
    """Widen the figure for legends of several columns (a panel and a column take fixed room)."""
    fig.set_size_inches((5.5 + 2.2 * columns) * panels, fig.get_size_inches()[1])


def accuracy_vs_length_figure(flat: list[dict[str, Any]]):
    """Accuracy against test length, one panel per task and one line per variant, encoding and
    train length; the x ticks are the tested lengths."""
    from matplotlib.ticker import NullLocator

    tasks = sorted({r["task"] for r in flat})
    styles = _styles(flat)
    several = len({r["train_len"] for r in flat}) > 1
    fig, axes = _figure(len(tasks), width=7.7)
    columns = 1
    for ax, task in zip(axes, tasks, strict=True):
        curves: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in flat:
            if r["task"] == task and r["status"] == "ok":
                key = (r["variant"], r["encoding"], r["train_len"])
                curves[key][r["test_len"]].append(r["accuracy"])
        for key, points in sorted(curves.items()):
            xs = sorted(points)
            ax.plot(
                xs,
                [statistics.fmean(points[x]) for x in xs],
                label=_label(*key, several),
                markerfacecolor="none",
                markeredgewidth=1.5,
                **styles[key],
            )
        lengths = sorted({x for points in curves.values() for x in points})
        ax.set(
            xscale="log",
            xlabel="test length",
            ylabel="accuracy",
            title=f"{task}: accuracy against test length",
            ylim=(-0.02, 1.02),
        )
        ax.set_xticks(lengths, labels=[str(n) for n in lengths])
        ax.xaxis.set_minor_locator(NullLocator())
        if len(lengths) > 1:
            ax.set_xlim(lengths[0] / 1.15, lengths[-1] * 1.15)
        ax.grid(True, alpha=0.3)
        columns = max(columns, _legend(ax))
    _fit_width(fig, len(tasks), columns)
    return fig


def plot_accuracy_vs_length(flat: list[dict[str, Any]], path: Path) -> Path:
    accuracy_vs_length_figure(flat).savefig(path, dpi=100)
    return path


def accuracy_vs_cost_figure(flat: list[dict[str, Any]]):
    """Accuracy at the train length against training time, one point per variant, encoding and
    train length (named in the legend, not on the plot), with the Pareto front."""
    tasks = sorted({r["task"] for r in flat})
    styles = _styles(flat)
    several = len({r["train_len"] for r in flat}) > 1
    fig, axes = _figure(len(tasks), width=7.7)
    columns = 1
    for ax, task in zip(axes, tasks, strict=True):
        points: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        for r in flat:
            if (
                r["task"] == task
                and r["status"] == "ok"
                and r["test_len"] == r["train_len"]
                and r["steps_per_second"]
            ):
                points[r["variant"], r["encoding"], r["train_len"]].append(
                    (1000 / r["steps_per_second"], r["accuracy"])
                )
        means = {
            k: (statistics.fmean(x for x, _ in v), statistics.fmean(y for _, y in v))
            for k, v in points.items()
        }
        for key, (x, y) in sorted(means.items()):
            style = styles[key]
            ax.plot(
                [x],
                [y],
                linestyle="none",
                marker=style["marker"],
                color=style["color"],
                markerfacecolor="none",
                markeredgewidth=1.5,
                markersize=8,
                label=_label(*key, several),
            )
        front, best = [], -1.0
        for x, y in sorted(means.values()):
            if y > best:
                front.append((x, y))
                best = y
        if front:
            ax.step(
                [x for x, _ in front],
                [y for _, y in front],
                where="post",
                color="grey",
                linestyle="--",
                label="Pareto front",
                zorder=0,
            )
        ax.set(
            xlabel="training seconds per 1000 steps",
            ylabel="accuracy at the train length",
            title=f"{task}: accuracy against cost",
            ylim=(-0.02, 1.02),
        )
        ax.grid(True, alpha=0.3)
        if means:
            columns = max(columns, _legend(ax))
    _fit_width(fig, len(tasks), columns)
    return fig


def plot_accuracy_vs_cost(flat: list[dict[str, Any]], path: Path) -> Path:
    accuracy_vs_cost_figure(flat).savefig(path, dpi=100)
    return path


def write_report(results: str | Path, out: str | Path | None = None) -> str:
    """Write report.md, results.csv and the plots next to the results; returns the markdown."""
    results = Path(results)
    out = Path(out) if out is not None else results.parent
    out.mkdir(parents=True, exist_ok=True)
    flat = rows(read_results(results))
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(flat)
    records = read_results(results)
    text = f"# Results: {results}\n\n{summary_table(flat)}\n"
    gaps = slice_table(records, "gap")
    if gaps is not None:  # MQAR: recall by distance from key to query
        text += f"\n## Accuracy per gap bucket (key to query distance)\n\n{gaps}\n"
    if any(r["status"] == "ok" for r in flat):
        plot_accuracy_vs_length(flat, out / "accuracy_vs_length.png")
        plot_accuracy_vs_cost(flat, out / "accuracy_vs_cost.png")
        text += (
            "\n![accuracy against test length](accuracy_vs_length.png)\n"
            "![accuracy against cost](accuracy_vs_cost.png)\n"
        )
    (out / "report.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eval report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("results", help="a results.jsonl written by python -m eval run")
    parser.add_argument(
        "--out", default=None, help="directory for the report (default: next to results)"
    )
    args = parser.parse_args(argv)
    print(write_report(args.results, args.out))
    return 0
