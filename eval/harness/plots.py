"""The harness's plots, one panel per task and one look per variant, encoding and train length
shared by every plot:

* accuracy against test length;
* accuracy against cost: on top, attention (query, key) pairs per sequence at the train length
  (``eval.harness.cost``: machine-independent); below, training seconds per 1000 steps on the
  machine that ran the sweep (which depends on its load);
* greedy generation accuracy beside teacher-forced accuracy, where the rows carry it;
* the loss and the accuracy per slice during training, for records with checks.

A point whose row's ``verdict`` is "not learned" (eval/harness/verdict.py) carries a black cross.

Rows are those of ``eval.harness.report.rows``; the keys ``variant_params``, ``causal``,
``chance_accuracy``, ``generation_accuracy``, ``device`` and ``head_dim`` are read where present
(a missing one counts as None). Where rows carry ``chance_accuracy`` a panel draws chance as a
dotted line labelled "chance". Series that coincide (accuracies within ``COINCIDE`` of each other
at every length, or points at the same cost) are drawn ``OFFSET`` apart, in a fixed order, and a
note under the panel lists them with their true values; their legend entries carry the note's
tag, "[=1]".
"""

from __future__ import annotations

import itertools
import statistics
import textwrap
from collections import defaultdict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from .cost import EXACT, pair_count
from .verdict import NOT_LEARNED

COINCIDE = 0.004  # accuracies this close at every x are drawn on top of each other
OFFSET = 0.01  # how far apart coinciding series are drawn (accuracy units)
NOTE_WIDTH = 100  # characters per line of a note under a panel


def new_figure(panels: int, width: float = 5.5, rows: int = 1, height: float = 4.2):
    """A matplotlib figure drawn without a display: ``rows`` x ``panels`` axes (one row: a
    sequence of axes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * panels, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, panels, squeeze=False)
    return fig, (axes[0] if rows == 1 else axes)


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


def _fit_width(fig, panels: int, columns: int, panel: float = 5.5) -> None:
    """Widen the figure for legends of several columns (a panel and a column take fixed room)."""
    fig.set_size_inches((panel + 2.2 * columns) * panels, fig.get_size_inches()[1])


def _fit_height(fig, axes) -> None:
    """Heighten the figure for the notes under its panels, so that notes never squeeze the
    panels (coinciding series are drawn a fixed accuracy apart, which needs the room)."""
    rows = [list(row) for row in (axes if hasattr(axes[0], "__len__") else [axes])]
    lines = [max(ax.get_xlabel().count("\n") for ax in row) for row in rows]
    fig.set_size_inches(fig.get_size_inches()[0], sum(4.2 + 0.17 * n for n in lines))


# --- chance ---------------------------------------------------------------------------------


def chance_of(rows: list[dict[str, Any]]) -> float | None:
    """The chance accuracy the rows carry (the most common value, should they differ)."""
    values = [r["chance_accuracy"] for r in rows if r.get("chance_accuracy") is not None]
    return statistics.mode(values) if values else None


def _draw_chance(ax, value: float | None) -> None:
    """A dotted horizontal line at chance, labelled "chance" on the line and in the legend."""
    if value is None:
        return
    ax.axhline(
        value, color="0.35", linestyle=":", linewidth=1.3, zorder=1, label="chance", gid="chance"
    )
    ax.annotate(
        "chance",
        xy=(0.01, value),
        xycoords=ax.get_yaxis_transform(),
        xytext=(0, 2),
        textcoords="offset points",
        fontsize="small",
        color="0.35",
        va="bottom",
    )


# --- coinciding series ----------------------------------------------------------------------


def coinciding(
    series: dict[Hashable, dict[float, float]], same_x: Callable[[float, float], bool]
) -> list[list[Hashable]]:
    """Groups (of two or more, in sorted order) of series that would be drawn on top of each
    other: the same x values (``same_x``) and accuracies within ``COINCIDE`` at each, linked in
    chains (single linkage)."""
    keys = sorted(series)
    parent = {k: k for k in keys}

    def root(k):
        while parent[k] != k:
            k = parent[k]
        return k

    def together(a: dict[float, float], b: dict[float, float]) -> bool:
        xa, xb = sorted(a), sorted(b)
        return len(xa) == len(xb) and all(
            same_x(x, y) and abs(a[x] - b[y]) <= COINCIDE for x, y in zip(xa, xb, strict=True)
        )

    for a, b in itertools.combinations(keys, 2):
        if together(series[a], series[b]):
            parent[root(b)] = root(a)
    groups: dict[Hashable, list] = defaultdict(list)
    for k in keys:
        groups[root(k)].append(k)
    return [g for g in groups.values() if len(g) > 1]


def spread(
    series: dict[Hashable, dict[float, float]], groups: list[list[Hashable]]
) -> dict[Hashable, float]:
    """The vertical offset of each series: 0, except in a group of coinciding series, drawn
    ``OFFSET`` apart from the first (the highest; the lowest near the bottom of the axis),
    downwards when they lie in the upper half of the axis, upwards otherwise."""
    offsets = dict.fromkeys(series, 0.0)
    for group in groups:
        level = {k: statistics.fmean(series[k].values()) for k in group}
        down = statistics.fmean(level.values()) > 0.5
        order = sorted(group, key=lambda k: (-level[k] if down else level[k], str(k)))
        for i, k in enumerate(order):
            offsets[k] = (-i if down else i) * OFFSET
    return offsets


def _group_note(tag: int, names: list[str], values: list[dict[float, float]], along: str) -> str:
    """One note: which series coincide, at what accuracy, and how they are drawn (as
    ``spread`` draws them)."""
    ys = [y for v in values for y in v.values()]
    if max(ys) - min(ys) <= COINCIDE:
        where = f"all at {statistics.fmean(ys):.3f}"
    else:
        where = " ".join(["within", str(COINCIDE), "of each other", *([along] if along else [])])
    side = "below" if statistics.fmean(ys) > 0.5 else "above"
    return (
        f"[={tag}] {len(names)} coincide ({where}), drawn {OFFSET} apart, {side} the first "
        "at its true value: " + ", ".join(names)
    )


def _notes(lines: list[str]) -> str:
    return "\n".join(textwrap.fill(line, NOTE_WIDTH, subsequent_indent="    ") for line in lines)


def _ylim(ax, drawn: list[float], chance: float | None) -> None:
    ys = [*drawn, *([chance] if chance is not None else [])]
    low = min([-0.02, *(y - 0.02 for y in ys)])
    high = max([1.02, *(y + 0.02 for y in ys)])
    ax.set_ylim(low, high)


# --- accuracy against test length -----------------------------------------------------------


def accuracy_vs_length_figure(flat: list[dict[str, Any]]):
    """Accuracy against test length, one panel per task and one line per variant, encoding and
    train length; the x ticks are the tested lengths."""
    from matplotlib.ticker import NullLocator

    tasks = sorted({r["task"] for r in flat})
    styles = _styles(flat)
    several = len({r["train_len"] for r in flat}) > 1
    fig, axes = new_figure(len(tasks), width=7.7)
    columns = 1
    for ax, task in zip(axes, tasks, strict=True):
        points: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        unlearned = set()  # (key, test length) where a seed is "not learned"
        for r in flat:
            if r["task"] == task and r["status"] == "ok" and r["accuracy"] is not None:
                key = (r["variant"], r["encoding"], r["train_len"])
                points[key][r["test_len"]].append(r["accuracy"])
                if r.get("verdict") == NOT_LEARNED:
                    unlearned.add((key, r["test_len"]))
        curves = {k: {x: statistics.fmean(v[x]) for x in v} for k, v in points.items()}
        groups = coinciding(curves, lambda a, b: a == b)
        offsets = spread(curves, groups)
        tags = {k: i for i, g in enumerate(groups, start=1) for k in g}
        drawn = []
        for key, curve in sorted(curves.items()):
            xs = sorted(curve)
            ys = [curve[x] + offsets[key] for x in xs]
            drawn += ys
            ax.plot(
                xs,
                ys,
                label=_label(*key, several) + (f" [={tags[key]}]" if key in tags else ""),
                markerfacecolor="none",
                markeredgewidth=1.5,
                **styles[key],
            )
        _mark_not_learned(
            ax, [(x, curves[k][x] + offsets[k]) for k, x in sorted(unlearned) if k in curves]
        )
        chance = chance_of([r for r in flat if r["task"] == task])
        _draw_chance(ax, chance)
        notes = [
            _group_note(
                i, [_label(*k, several) for k in g], [curves[k] for k in g], "at every length"
            )
            for i, g in enumerate(groups, start=1)
        ]
        lengths = sorted({x for curve in curves.values() for x in curve})
        ax.set(
            xscale="log",
            xlabel="\n".join(["test length", *([_notes(notes)] if notes else [])]),
            ylabel="accuracy",
            title=f"{task}: accuracy against test length",
        )
        _ylim(ax, drawn, chance)
        ax.set_xticks(lengths, labels=[str(n) for n in lengths])
        ax.xaxis.set_minor_locator(NullLocator())
        if len(lengths) > 1:
            ax.set_xlim(lengths[0] / 1.15, lengths[-1] * 1.15)
        ax.grid(True, alpha=0.3)
        columns = max(columns, _legend(ax))
    _fit_width(fig, len(tasks), columns, panel=7.7)
    _fit_height(fig, axes)
    return fig


def _mark_not_learned(ax, points: list[tuple[float, float]]) -> None:
    """A black cross on each point whose cell is "not learned" there (eval/harness/verdict.py:
    a slice within the pattern's reach short of learned), one legend entry for all."""
    if points:
        xs, ys = zip(*points, strict=True)
        ax.scatter(xs, ys, marker="x", color="black", s=45, zorder=5, gid="not learned",
                   label="not learned (within reach)")  # fmt: skip


def plot_accuracy_vs_length(flat: list[dict[str, Any]], path: Path) -> Path:
    accuracy_vs_length_figure(flat).savefig(path, dpi=100)
    return path


# --- accuracy against cost ------------------------------------------------------------------

PAIRS_LABEL = "attention (query, key) pairs per sequence at the train length, one head of one layer"


def device_of(flat: list[dict[str, Any]]) -> str:
    """The machine the rows ran on, in words, for the time axis."""
    devices = sorted({str(r["device"]) for r in flat if r.get("device")})
    if not devices:
        return "the machine that ran the sweep"
    return devices[0] if len(devices) == 1 else "several machines (" + ", ".join(devices) + ")"


def _pareto(ax, means: list[tuple[float, float]]) -> None:
    """The Pareto front (least cost for the accuracy), drawn at the true accuracies."""
    front, best = [], -1.0
    for x, y in sorted(means):
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


def _plain_log_axis(ax) -> None:
    """A log x axis ticked at 1, 2 and 5 times powers of ten, written as plain integers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    ax.xaxis.set_minor_locator(NullLocator())


def _cost_panel(
    ax,
    means: dict[tuple, tuple[float, float]],
    styles: dict,
    labels: dict[tuple, str],
    same_x: Callable[[float, float], bool],
    chance: float | None,
) -> list[str]:
    """Draw one point per series at (cost, accuracy), coinciding points spread, with the Pareto
    front and chance; returns the notes on the coinciding points."""
    series = {k: {x: y} for k, (x, y) in means.items()}
    groups = coinciding(series, same_x)
    offsets = spread(series, groups)
    tags = {k: i for i, g in enumerate(groups, start=1) for k in g}
    drawn = []
    for key, (x, y) in sorted(means.items()):
        style = styles[key[:3]]
        drawn.append(y + offsets[key])
        ax.plot(
            [x],
            [y + offsets[key]],
            linestyle="none",
            marker=style["marker"],
            color=style["color"],
            markerfacecolor="none",
            markeredgewidth=1.5,
            markersize=8,
            label=labels[key] + (f" [={tags[key]}]" if key in tags else ""),
        )
    _pareto(ax, list(means.values()))
    _draw_chance(ax, chance)
    _ylim(ax, drawn, chance)
    ax.grid(True, alpha=0.3)
    return [
        _group_note(i, [labels[k] for k in g], [series[k] for k in g], "")
        for i, g in enumerate(groups, start=1)
    ]


def accuracy_vs_cost_figure(flat: list[dict[str, Any]]):
    """Accuracy at the train length against cost, one point per variant, encoding and train
    length (named in the legend, not on the plot), with the Pareto front. Top row: attention
    pairs per sequence (``eval.harness.cost.pair_count``), log scale; a count that is not the
    exact allowed pairs (a routing budget, a FLOP equivalent) is starred and explained under the
    panel, and a series without a count is listed there. Bottom row: training seconds per 1000
    steps, which depend on the machine and its load."""
    tasks = sorted({r["task"] for r in flat})
    styles = _styles(flat)
    several = len({r["train_len"] for r in flat}) > 1
    device = device_of(flat)
    fig, axes = new_figure(len(tasks), width=7.7, rows=2)
    columns = 1
    for p, task in enumerate(tasks):
        at_train = [
            r
            for r in flat
            if r["task"] == task
            and r["status"] == "ok"
            and r["test_len"] == r["train_len"]
            and r["accuracy"] is not None
        ]
        chance = chance_of([r for r in flat if r["task"] == task])

        # Top: attention pairs.
        ax = axes[0][p]
        ax.set_label(f"pairs:{task}")
        by_pairs: dict[tuple, list[float]] = defaultdict(list)
        starred: dict[tuple, str] = {}
        missing: dict[str, str] = {}
        for r in at_train:
            key = (r["variant"], r["encoding"], r["train_len"])
            count = pair_count(r)
            if count.pairs is None:
                missing[_label(*key, several)] = count.note
                continue
            by_pairs[(*key, count.pairs)].append(r["accuracy"])
            if count.basis != EXACT:
                starred[(*key, count.pairs)] = count.note
        counts_per_key = defaultdict(set)
        for key in by_pairs:
            counts_per_key[key[:3]].add(key[3])
        labels = {
            key: _label(*key[:3], several)
            + (f" @{key[3]}" if len(counts_per_key[key[:3]]) > 1 else "")
            + (" *" if key in starred else "")
            for key in by_pairs
        }
        means = {k: (float(k[3]), statistics.fmean(v)) for k, v in by_pairs.items()}
        notes = _cost_panel(ax, means, styles, labels, lambda a, b: a == b, chance)
        notes = [f"* {note}" for note in sorted(set(starred.values()))] + notes
        if missing:
            shown = "; ".join(f"{name} ({why})" for name, why in sorted(missing.items()))
            notes.append(f"not shown, no pair count: {shown}")
        if means:
            _plain_log_axis(ax)
        ax.set(
            xlabel="\n".join([f"{PAIRS_LABEL} (log scale)", *([_notes(notes)] if notes else [])]),
            ylabel="accuracy at the train length",
            title=f"{task}: accuracy against attention pairs (machine-independent)",
        )
        if means or chance is not None:
            columns = max(columns, _legend(ax))

        # Bottom: time on this machine.
        ax = axes[1][p]
        ax.set_label(f"time:{task}")
        by_time: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        for r in at_train:
            if r.get("steps_per_second"):
                key = (r["variant"], r["encoding"], r["train_len"])
                by_time[key].append((1000 / r["steps_per_second"], r["accuracy"]))
        means = {
            k: (statistics.fmean(x for x, _ in v), statistics.fmean(y for _, y in v))
            for k, v in by_time.items()
        }
        xs = [x for x, _ in means.values()]
        width = (max(xs) - min(xs)) if xs else 0.0

        def close(a: float, b: float, width: float = width) -> bool:
            return abs(a - b) <= 0.01 * width

        labels = {k: _label(*k, several) for k in means}
        notes = _cost_panel(ax, means, styles, labels, close, chance)
        ax.set(
            xlabel="\n".join(
                [
                    f"seconds per 1000 training steps, on {device}: depends on the machine's load",
                    *([_notes(notes)] if notes else []),
                ]
            ),
            ylabel="accuracy at the train length",
            title=f"{task}: accuracy against training time (this machine, its load)",
        )
        if means or chance is not None:
            columns = max(columns, _legend(ax))
    _fit_width(fig, len(tasks), columns, panel=7.7)
    _fit_height(fig, axes)
    return fig


def plot_accuracy_vs_cost(flat: list[dict[str, Any]], path: Path) -> Path:
    accuracy_vs_cost_figure(flat).savefig(path, dpi=100)
    return path


# --- generation -----------------------------------------------------------------------------

TEACHER_FORCED = "teacher-forced"
GREEDY = "greedy generation"


def generation_figure(flat: list[dict[str, Any]]):
    """Per task, grouped bars per variant, encoding, train length (and test length, where a task
    has several): teacher-forced accuracy (hatched) beside greedy generation accuracy (solid),
    averaged over seeds, each bar with its value; None where no row carries
    ``generation_accuracy``."""
    from matplotlib.patches import Patch

    rows = [
        r
        for r in flat
        if r["status"] == "ok"
        and r.get("generation_accuracy") is not None
        and r["accuracy"] is not None
    ]
    if not rows:
        return None
    tasks = sorted({r["task"] for r in rows})
    styles = _styles(flat)
    several = len({r["train_len"] for r in flat}) > 1
    widest = max(len({(r["variant"], r["encoding"], r["train_len"], r["test_len"]) for r in rows
                      if r["task"] == t}) for t in tasks)  # fmt: skip
    fig, axes = new_figure(len(tasks), width=max(5.5, 0.7 * widest + 2.0))
    for ax, task in zip(axes, tasks, strict=True):
        groups: dict[tuple, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
        for r in rows:
            if r["task"] == task:
                key = (r["variant"], r["encoding"], r["train_len"], r["test_len"])
                groups[key][0].append(r["accuracy"])
                groups[key][1].append(r["generation_accuracy"])
        keys = sorted(groups)
        test_lens = len({k[3] for k in keys}) > 1
        xs = list(range(len(keys)))
        colours = [styles[k[:3]]["color"] for k in keys]
        forced = [statistics.fmean(groups[k][0]) for k in keys]
        greedy = [statistics.fmean(groups[k][1]) for k in keys]
        bars = ax.bar(
            [x - 0.2 for x in xs],
            forced,
            width=0.4,
            color="white",
            edgecolor=colours,
            hatch="//",
            label=TEACHER_FORCED,
        )
        ax.bar_label(bars, fmt="%.3f", fontsize=7, rotation=90, padding=2)
        bars = ax.bar(
            [x + 0.2 for x in xs],
            greedy,
            width=0.4,
            color=colours,
            edgecolor=colours,
            label=GREEDY,
        )
        ax.bar_label(bars, fmt="%.3f", fontsize=7, rotation=90, padding=2)
        chance = chance_of([r for r in flat if r["task"] == task])
        _draw_chance(ax, chance)
        ax.set_xticks(
            xs,
            labels=[
                _label(*k[:3], several) + (f"\ntest {k[3]}" if test_lens else "") for k in keys
            ],
            rotation=30,
            ha="right",
            fontsize="small",
        )
        ax.set(
            ylabel="accuracy",
            ylim=(0, 1.3),
            title=f"{task}: greedy generation and teacher-forced",
        )
        ax.grid(True, axis="y", alpha=0.3)
        handles = [
            Patch(facecolor="white", edgecolor="0.3", hatch="//", label=TEACHER_FORCED),
            Patch(facecolor="0.3", label=GREEDY),
        ]
        handles += [
            h for h, name in zip(*ax.get_legend_handles_labels(), strict=True) if name == "chance"
        ]
        ax.legend(handles=handles, fontsize="small", loc="upper right", ncols=len(handles))
    return fig


def plot_generation(flat: list[dict[str, Any]], path: Path) -> Path | None:
    """Write the generation figure to ``path``; None (and no file) where no row carries
    ``generation_accuracy``."""
    fig = generation_figure(flat)
    if fig is None:
        return None
    fig.savefig(path, dpi=100)
    return path


# --- training checks ------------------------------------------------------------------------


def checks_figure(records: list[dict[str, Any]]):
    """Per record with checks (``train.check_every``, ``train.until: learned``), one panel: the
    training loss against steps (left axis, the marginal loss dotted) and the accuracy of each
    value of the task's verdict slice (right axis), so that a plateau and the transition out of
    it show where they came; the last check's verdict in the title. None without checks."""
    from .needs import VERDICT_SLICE

    cells = [r for r in records if r.get("status") == "ok" and r.get("checks")]
    if not cells:
        return None
    columns = min(3, len(cells))
    rows = -(-len(cells) // columns)
    fig, axes = new_figure(columns, width=5.5, rows=rows, height=3.8)
    grid = [ax for row in (axes if rows > 1 else [axes]) for ax in row]
    for ax in grid[len(cells) :]:
        ax.set_visible(False)
    for ax, record in zip(grid, cells, strict=False):
        cell, checks = record["cell"], record["checks"]
        steps = [c["step"] for c in checks]
        ax.plot(steps, [c["loss"] for c in checks], color="black", label="training loss")
        ax.axhline(checks[-1]["marginal_loss"], color="0.4", linestyle=":", label="marginal")
        ax.set(xlabel="step", ylabel="training loss (nats)")
        name = VERDICT_SLICE.get(cell["task"])
        right = ax.twinx()
        values = sorted({v for c in checks for v in c["slices"].get(name, {})}, key=float)
        reach = (record.get("slice_reach") or {}).get(str(cell["train_len"])) or {}
        counts = (reach.get("slices") or {}).get(name, {})
        for value in values:
            inside, count = counts.get(value, [None, None])
            out = inside == 0 and bool(count)
            right.plot(
                steps,
                [c["slices"].get(name, {}).get(value) for c in checks],
                marker=".",
                linewidth=1,
                linestyle="--" if out else "-",
                label=f"{name} {value}" + (" (out of reach)" if out else ""),
            )
        right.set(ylabel="accuracy", ylim=(-0.02, 1.02))
        right.legend(fontsize="x-small", loc="center right")
        ax.legend(fontsize="x-small", loc="upper right")
        lr = cell.get("train", {}).get("lr")
        ax.set_title(
            f"{cell['task']} L={cell['train_len']} {cell['variant']}+{cell['encoding']} "
            f"lr {lr:g}: {checks[-1]['verdict']} at {steps[-1]}",
            fontsize="small",
        )
        ax.grid(True, alpha=0.3)
    return fig


def plot_checks(records: list[dict[str, Any]], path: Path) -> Path | None:
    fig = checks_figure(records)
    if fig is None:
        return None
    fig.savefig(path, dpi=100)
    return path
