"""Log-log plots of time and peak memory against n: one panel per variant, the zoo's backends
and the peers in each, the dense peer (sdpa_dense) drawn in every panel as the n^2 baseline.

Figures are drawn on a matplotlib Agg canvas of their own (no pyplot, no global state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from .report import Cell, SeriesKey, backend_label, series

DENSE = "sdpa_dense"
Lines = dict[SeriesKey, list[Cell]]  # each series' drawable cells, sorted by n


def _figure(panels: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(panels, 4)
    rows = math.ceil(panels / cols)
    fig = Figure(figsize=(4.4 * cols, 3.6 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, axes


def _slug(pass_: str, causal: bool) -> str:
    return f"{pass_.replace('+', '_')}-{'causal' if causal else 'noncausal'}"


def plot_metric(
    cells: Sequence[Cell], pass_: str, causal: bool, field: str, ylabel: str, path: Path
) -> bool:
    """One figure of ``field`` against n for one pass and causal; False if nothing to draw."""
    lines = _measured_lines(cells, pass_, causal, field)
    variants = _panel_variants(lines)
    if not variants:
        return False
    fig, axes = _figure(len(variants))
    for ax, variant in zip(axes, variants, strict=False):
        _draw_panel(ax, variant, lines, field, ylabel)
    fig.suptitle(f"{ylabel} against n: {pass_}, {'causal' if causal else 'non-causal'}")
    fig.savefig(path, dpi=90)
    return True


def _measured_lines(cells: Sequence[Cell], pass_: str, causal: bool, field: str) -> Lines:
    """The series of this pass and causal, each cut to its successful cells with a ``field``
    value (failed or unmeasured lengths would break a log axis); series left empty are dropped."""
    chosen = [c for c in cells if c["pass"] == pass_ and c["causal"] == causal]
    lines = {
        key: [c for c in members if c["status"] == "ok" and c[field] is not None]
        for key, members in series(chosen).items()
    }
    return {k: v for k, v in lines.items() if v}


def _panel_variants(lines: Lines) -> list[str]:
    """The variants that get a panel, sorted: those with a line other than the dense peer's, or,
    where the dense peer is all there is, its own, so its line is still drawn."""
    return sorted({k[0] for k in lines if k[1] != DENSE}) or sorted({k[0] for k in lines})


def _draw_panel(ax, variant: str, lines: Lines, field: str, ylabel: str) -> None:
    """One variant's panel: a line per backend or peer of that variant, then every dense-peer line
    as the black dashed n^2 baseline, on log-log axes (n in powers of two)."""
    drawn = [v for k, v in lines.items() if k[0] == variant and k[1] != DENSE]
    for points in drawn:
        _plot_line(ax, points, field, marker="o", label=backend_label(points))
    for points in (v for k, v in lines.items() if k[1] == DENSE):
        _plot_line(ax, points, field, color="black", linestyle="--", label=f"{DENSE} (dense)")
    ax.set(xscale="log", yscale="log", xlabel="n (tokens)", ylabel=ylabel, title=variant)
    ax.set_xscale("log", base=2)
    ax.legend(fontsize="x-small")


def _plot_line(ax, points: Sequence[Cell], field: str, **style) -> None:
    """``field`` against n for one series' cells, drawn with matplotlib's ``style`` keywords."""
    ax.plot([c["n"] for c in points], [c[field] for c in points], **style)


def plot_all(cells: Sequence[Cell], out: Path) -> list[str]:
    """time-*.png and memory-*.png for every pass and causal with data; their file names."""
    written = []
    for pass_, causal in sorted({(c["pass"], c["causal"]) for c in cells}):
        for field, name, ylabel in (
            ("time_ms", "time", "time (ms)"),
            ("peak_memory_mb", "memory", "peak memory (MiB)"),
        ):
            path = out / f"{name}-{_slug(pass_, causal)}.png"
            if plot_metric(cells, pass_, causal, field, ylabel, path):
                written.append(path.name)
    return written
