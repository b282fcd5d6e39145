"""Log-log plots of time and peak memory against n: one panel per variant, the zoo's backends
and the peers in each, the dense peer (sdpa_dense) drawn in every panel as the n^2 baseline.

Figures are drawn on a matplotlib Agg canvas of their own (no pyplot, no global state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from .report import Cell, backend_label, series

DENSE = "sdpa_dense"


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
    chosen = [c for c in cells if c["pass"] == pass_ and c["causal"] == causal]
    lines = {
        key: [c for c in members if c["status"] == "ok" and c[field] is not None]
        for key, members in series(chosen).items()
    }
    lines = {k: v for k, v in lines.items() if v}
    dense = [v for k, v in lines.items() if k[1] == DENSE]
    variants = sorted({k[0] for k in lines if k[1] != DENSE}) or sorted({k[0] for k in lines})
    if not variants:
        return False
    fig, axes = _figure(len(variants))
    for ax, variant in zip(axes, variants, strict=False):
        drawn = [v for k, v in lines.items() if k[0] == variant and k[1] != DENSE]
        for points in drawn:
            ax.plot([c["n"] for c in points], [c[field] for c in points], marker="o",
                    label=backend_label(points))  # fmt: skip
        for points in dense:
            ax.plot([c["n"] for c in points], [c[field] for c in points], color="black",
                    linestyle="--", label=f"{DENSE} (dense)")  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="n (tokens)", ylabel=ylabel, title=variant)
        ax.set_xscale("log", base=2)
        ax.legend(fontsize="x-small")
    fig.suptitle(f"{ylabel} against n: {pass_}, {'causal' if causal else 'non-causal'}")
    fig.savefig(path, dpi=90)
    return True


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
