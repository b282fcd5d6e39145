"""``python -m eval report RESULTS.jsonl [--out DIR]``: tables and plots from a sweep's results.

Writes ``report.md`` (accuracy per task, variant, encoding and test length, averaged over seeds,
with time and memory), ``results.csv`` (one row per cell and test length) and two PNG plots:
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

from zoo.tables import markdown_table

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


def _figure(panels: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * panels, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    return fig, axes


def plot_accuracy_vs_length(flat: list[dict[str, Any]], path: Path) -> Path:
    tasks = sorted({r["task"] for r in flat})
    fig, axes = _figure(len(tasks))
    for ax, task in zip(axes, tasks, strict=True):
        curves: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in flat:
            if r["task"] == task and r["status"] == "ok":
                curves[f"{r['variant']}+{r['encoding']} (L={r['train_len']})"][
                    r["test_len"]
                ].append(r["accuracy"])
        for label, points in sorted(curves.items()):
            xs = sorted(points)
            ax.plot(xs, [statistics.fmean(points[x]) for x in xs], marker="o", label=label)
        ax.set(
            xscale="log",
            xlabel="test length",
            ylabel="accuracy",
            title=f"{task}: accuracy against test length",
            ylim=(-0.02, 1.02),
        )
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def plot_accuracy_vs_cost(flat: list[dict[str, Any]], path: Path) -> Path:
    tasks = sorted({r["task"] for r in flat})
    fig, axes = _figure(len(tasks))
    for ax, task in zip(axes, tasks, strict=True):
        points: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in flat:
            if (
                r["task"] == task
                and r["status"] == "ok"
                and r["test_len"] == r["train_len"]
                and r["steps_per_second"]
            ):
                points[f"{r['variant']}+{r['encoding']}"].append(
                    (1000 / r["steps_per_second"], r["accuracy"])
                )
        means = {
            k: (statistics.fmean(x for x, _ in v), statistics.fmean(y for _, y in v))
            for k, v in points.items()
        }
        for label, (x, y) in sorted(means.items()):
            ax.scatter([x], [y])
            ax.annotate(label, (x, y), fontsize="small", xytext=(3, 3), textcoords="offset points")
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
            )
            ax.legend(fontsize="small")
        ax.set(
            xlabel="training seconds per 1000 steps",
            ylabel="accuracy at the train length",
            title=f"{task}: accuracy against cost",
            ylim=(-0.02, 1.02),
        )
    fig.savefig(path, dpi=100)
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
    text = f"# Results: {results}\n\n{summary_table(flat)}\n"
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
