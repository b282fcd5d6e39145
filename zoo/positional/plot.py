"""Pictures of absolute encodings, as in the lecture notes: the table P and a few of its columns."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..core.arguments import check_int, check_png_path
from .base import PositionalEncoding


def draw_encoding(
    enc: PositionalEncoding,
    length: int,
    path: str | Path,
    columns: Sequence[int] | None = None,
) -> Path:
    """Save a PNG of the table P of an absolute encoding (kind 'embed') and return its path.

    Left panel: the heatmap of P for positions 0 .. length - 1 (rows: positions, columns:
    encoding dimensions). Right panel: the chosen columns of P against position (by default
    columns 6 to 9, as in the lecture notes, or the first four when dim is below 10).

    Only absolute encodings have a table P: for any other kind (rope rotates q and k, alibi and t5
    bias the scores, none adds nothing) this raises ValueError rather than drawing a stand-in.
    Uses matplotlib's Agg canvas directly, so the caller's pyplot backend is left alone.
    """
    if enc.kind != "embed":
        raise ValueError(
            f"draw_encoding draws the table P of an absolute encoding (kind 'embed'), but the "
            f"{enc.name!r} encoding is of kind {enc.kind!r} and has no table P; pass a "
            f"'sinusoidal' or 'learned' encoding"
        )
    check_int("length", length)
    path = check_png_path(path)  # a missing folder, or a name not ending in .png, fails here
    if columns is None:
        columns = range(6, 10) if enc.dim >= 10 else range(min(4, enc.dim))
    columns = list(columns)
    bad = [
        c for c in columns if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < enc.dim
    ]
    if bad or not columns:
        raise ValueError(
            f"columns must be a non-empty list of column indices in [0, {enc.dim}) for dim="
            f"{enc.dim}, got {columns!r}"
        )
    with torch.no_grad():
        table = enc.table(length).detach().float().cpu().numpy()

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    heat, lines = fig.subplots(1, 2, width_ratios=(1, 1.3))
    scale = max(float(abs(table).max()), 1e-12)
    image = heat.imshow(table, aspect="auto", cmap="RdBu_r", vmin=-scale, vmax=scale)
    heat.set(xlabel="Column (encoding dimension)", ylabel="Row (position)", title="P")
    fig.colorbar(image, ax=heat)
    for c in columns:
        lines.plot(range(length), table[:, c], label=f"Col {c}")
    lines.set(xlabel="Row (position)", title=f"columns of P ({enc.name}, dim={enc.dim})")
    lines.legend(loc="upper right", fontsize="small")
    fig.savefig(path, dpi=100, format="png")
    return path
