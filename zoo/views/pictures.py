"""Pictures of patterns and attention weights, as PNG files.

Every picture is a fixed 6 x 6 inch figure saved at 100 dpi without tight cropping, so the PNG is
always 600 x 600 pixels, whatever the length or the title. Drawing uses matplotlib's Agg canvas
directly (``Figure`` + ``FigureCanvasAgg``), never pyplot, so nothing touches global state and no
display is needed. Rows are queries and columns are keys, as in the mask ``zoo.dense_mask`` returns.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor

from ..core.arguments import check_png_path, check_seed
from ..functional import dense_mask, prepare_call
from ..modules.multi_head import create_attention
from ..patterns import reads_graph
from ..registry import get_spec, list_variants
from .graph_pictures import draw_graph
from .tables import format_params

FIGSIZE = (6.0, 6.0)  # inches
DPI = 100  # so a picture is 600 x 600 pixels
PIXELS = (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))  # (width, height)


# A picture is 600 pixels wide and draws an n x n dense mask (the graph picture an n x n
# adjacency): past this, each pixel covers several positions and the mask alone takes n^2 bytes
# (100000 positions: 10 GB before a pixel is drawn).
MAX_PICTURE_LEN = 4096


def _check_length(seq_len: object) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}; pass seq_len >= 1")
    if seq_len > MAX_PICTURE_LEN:
        raise ValueError(
            f"seq_len={seq_len} is too long to draw: a picture holds the dense {seq_len} x "
            f"{seq_len} mask on 600 x 600 pixels; pass seq_len <= {MAX_PICTURE_LEN}"
        )
    return seq_len


def _save(figure: Figure, path: Path) -> Path:
    # No bbox_inches="tight": it would crop and make the pixel size depend on the content.
    FigureCanvasAgg(figure)
    figure.savefig(path, dpi=DPI, format="png")
    return path


def _title(lines: list[str]) -> str:
    """Wrap long lines (a composition's parameters) so the title stays inside the figure."""
    return "\n".join(textwrap.fill(line, width=64) for line in lines if line)


def draw_pattern(
    name: str, seq_len: int, path: str | os.PathLike, *, causal: bool = False, **params: object
) -> Path:
    """Draw a variant's allowed pairs at length ``seq_len`` as a heatmap, saved as a PNG.

    Rows are queries, columns are keys, dark cells are allowed pairs. A variant chosen by content
    (``moba``) has no fixed picture: it draws the pairs chosen for one random input, and says so.
    The title names the variant, its parameters (registry defaults merged with ``params``) and its
    density (allowed pairs / n^2). The PNG is 600 x 600 pixels. Returns the path written.
    """
    spec = get_spec(name)  # an unknown name fails here, with close names suggested
    _check_length(seq_len)
    path = check_png_path(path)
    if reads_graph(spec.build(**{k: v for k, v in params.items() if k != "edge_index"})):
        # A graph: its adjacency before and after reordering (zoo.views.graph_pictures).
        figure = draw_graph(seq_len, FIGSIZE, causal=causal, **{**spec.parameters(), **params})
        return _save(figure, path)
    figure = Figure(figsize=FIGSIZE)
    _draw_variant(figure.add_subplot(), name, seq_len, causal, params)
    figure.tight_layout()  # lays out within the fixed canvas; the pixel size does not change
    return _save(figure, path)


def _draw_variant(
    axes, name: str, seq_len: int, causal: bool, params: dict[str, object], every_param: bool = True
) -> None:
    """One variant's allowed pairs on ``axes``, titled with its density and its parameters (all of
    them, or only those in ``params``)."""
    spec = get_spec(name)
    routed = spec.build(**params).routed
    if routed:
        mask = chosen_mask(name, seq_len, causal, params)
    else:
        mask = dense_mask(name, seq_len, causal=causal, **params)
    density = mask.sum().item() / mask.numel()

    grid = _grid_of(spec.build(**params), seq_len)
    if grid is None:
        axes.imshow(mask.numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        axes.set_xlabel("key position j")
        axes.set_ylabel("query position i")
    else:
        _draw_on_grid(axes, mask, grid)
    shape = f"n={seq_len}" + (", causal" if causal else "")
    title = [
        f"{name} ({shape}): density {density:.1%}",
        "chosen by content: the pairs one random input chose (seed 0)" if routed else "",
        format_params({**spec.parameters(), **params} if every_param else params),
    ]
    axes.set_title(_title(title), fontsize=10)


# Parameters that make each pattern's shape visible at the gallery's 256 tokens (the registry's
# defaults are sized for thousands of tokens: a window of 128 would fill the picture).
GALLERY_PARAMS: dict[str, dict[str, object]] = {
    "bigbird": {"block_size": 16, "random_blocks": 2},
    "block_local": {"block_size": 32},
    "dilated": {"window_size": 8, "dilation": 3},
    "local": {"window_size": 16},
    "longformer": {"window_size": 16, "global_tokens": 8},
    "moba": {"block_size": 32, "top_k": 3},
    "random": {"block_size": 16, "num_blocks": 2},
    "sliding_window": {"window_size": 32},
    "strided": {"stride": 32, "window_size": 8},
    "global": {"global_tokens": 8},
    "neighborhood_2d": {"kernel_size": 5},
    "block_local_2d": {"window_size": 4},
}


def draw_gallery(path: str | os.PathLike, seq_len: int = 256, columns: int = 4) -> Path:
    """Every registry variant's allowed pairs in one PNG, each at ``GALLERY_PARAMS`` (its title
    says them; the rest are the registry's defaults), at length ``seq_len``. ``graph`` is left
    out: its pairs come with each call's edges (``zoo show graph`` draws an example graph)."""
    _check_length(seq_len)
    path = check_png_path(path)
    names = [name for name in list_variants() if name != "graph"]
    rows = -(-len(names) // columns)
    figure = Figure(figsize=(3.2 * columns, 3.4 * rows))
    for i, name in enumerate(names):
        axes = figure.add_subplot(rows, columns, i + 1)
        try:
            _draw_variant(axes, name, seq_len, False, GALLERY_PARAMS.get(name, {}),
                          every_param=False)  # fmt: skip
        except ValueError as error:  # a 2-D variant at a length with no grid, say
            raise ValueError(
                f"the gallery cannot draw {name!r} at seq_len={seq_len}: {error}; choose another "
                f"seq_len (the default, 256, draws every variant)"
            ) from error
        axes.title.set_fontsize(8)
        axes.tick_params(labelsize=6)
        axes.xaxis.label.set_fontsize(7)
        axes.yaxis.label.set_fontsize(7)
    figure.tight_layout()
    return _save(figure, path)


def _grid_of(pattern, seq_len: int) -> tuple[int, int] | None:
    """The (H, W) of a 2-D pattern at this length, or None for a sequence pattern."""
    from ..patterns.grid import GridPattern

    if not isinstance(pattern, GridPattern):
        return None
    return pattern.specialize(seq_len, seq_len).grid


def _draw_on_grid(axes, mask: Tensor, grid: tuple[int, int]) -> None:
    """The keys of two queries drawn on the image, not the n x n matrix: the centre token (grey)
    and the top-left corner (black; a window there shifts inward), each query marked by a dot."""
    h, w = grid
    centre, corner = (h // 2) * w + w // 2, 0
    image = mask[centre].float().view(h, w) + 2 * mask[corner].float().view(h, w)
    axes.imshow(image.clamp(max=2).numpy(), cmap="Greys", vmin=0, vmax=2, interpolation="nearest")
    for query, colour in ((centre, "tab:red"), (corner, "tab:blue")):
        axes.plot(query % w, query // w, "o", color=colour, markersize=4)
    axes.set_xlabel(f"column (grid {h} x {w}; keys of the red and the blue query)")
    axes.set_ylabel("row")


def chosen_mask(name: str, seq_len: int, causal: bool, params: dict[str, object]) -> Tensor:
    """[seq_len, seq_len]: the pairs a variant chosen by content picks for one random input
    (q = k, head 0, drawn from seed 0; the caller's random stream is untouched)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, seq_len, 16, generator=generator)
    call = prepare_call(x, x, x, variant=name, causal=causal, **params)
    return call.pattern.dense(seq_len, seq_len)[0, 0]


def draw_attention(
    weights: Tensor, path: str | os.PathLike, *, batch: int = 0, head: int = 0, title: str = ""
) -> Path:
    """Draw one head's attention weights from a (B, H, Lq, Lk) tensor as a heatmap with a colorbar.

    Rows are queries, columns are keys, as in lecture notes. ``batch`` and ``head`` pick the map;
    an index outside the tensor is a ValueError naming the valid range. Returns the path written.
    """
    if not isinstance(weights, Tensor) or weights.dim() != 4:
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(
            f"weights must be a (batch, heads, queries, keys) tensor, got {shape}; "
            "pass the weights from module(x, return_weights=True)"
        )
    for label, index, size in (
        ("batch", batch, weights.shape[0]),
        ("head", head, weights.shape[1]),
    ):
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
            raise ValueError(f"{label} must be an int in [0, {size - 1}], got {index!r}")
    path = check_png_path(path)
    grid = weights[batch, head].detach().to("cpu", torch.float32).numpy()

    figure = Figure(figsize=FIGSIZE)
    axes = figure.add_subplot()
    image = axes.imshow(grid, cmap="Reds", interpolation="nearest", aspect="auto")
    figure.colorbar(image, ax=axes, shrink=0.8)
    axes.set_xlabel("Keys")
    axes.set_ylabel("Queries")
    axes.set_title(_title([title or f"attention weights, batch {batch}, head {head}"]), fontsize=10)
    figure.tight_layout()
    return _save(figure, path)


def attention_map_of_random_model(
    name: str,
    seq_len: int,
    path: str | os.PathLike,
    *,
    dim: int = 64,
    num_heads: int = 4,
    seed: int = 0,
    **params: object,
) -> Path:
    """Draw head 0 of an untrained ``zoo.create_attention(name, ...)`` on random input.

    The module's weights and the input come from ``seed``, so the picture is reproducible; the
    global random state is left as it was. ``params`` go to ``create_attention`` (variant
    parameters such as ``window_size``, or module options such as ``causal``). Returns the path.
    """
    get_spec(name)
    _check_length(seq_len)
    seed = check_seed("seed", seed)
    path = check_png_path(path)
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's random stream
        torch.manual_seed(seed)
        module = create_attention(name, dim=dim, num_heads=num_heads, **params).eval()
        x = torch.randn(1, seq_len, dim)
        with torch.no_grad():
            _, weights = module(x, return_weights=True)
    title = f"{name}: untrained model, head 0 of {num_heads} (n={seq_len}, seed={seed})"
    return draw_attention(weights, path, batch=0, head=0, title=title)
