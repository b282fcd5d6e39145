"""The seed notes' comparison of layer types, computed for every registered variant.

The seed table (Vaswani et al. 2017, Table 1) compares self-attention with its restricted form,
attention within a neighbourhood of size r (n: sequence length, d: width)::

    layer type                   complexity per layer   sequential operations   max path length
    self-attention               O(n^2·d)               O(1)                    O(1)
    restricted self-attention    O(r·n·d)               O(1)                    O(n/r)

Here every column comes from the registry and the pattern's mask at a concrete length, not from
a hand-typed table: ``full`` shows a path length of 1 (the O(1)) and ``local`` with window w shows
ceil((n - 1) / w) (the O(n/r), with r = w). Sequential operations are O(1) for every variant:
one attention layer is one parallel step over all positions, whatever its pattern.
"""

from __future__ import annotations

from ..functional import dense_mask
from ..layout.block_layout import allowed_pairs
from ..patterns import reads_graph
from ..registry import get_spec, list_variants
from .paths import max_path_length, min_receptive_fraction
from .tables import markdown_table

HEADERS = [
    "variant",
    "allowed pairs (density)",
    "complexity per layer",
    "sequential operations",
    "max path length",
    "receptive field after {layers} layers (min over queries)",
]


def _check_positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}; pass {name} >= 1")
    return value


def comparison_row(name: str, seq_len: int, layers: int) -> list[str]:
    """One variant's row, with its registry defaults (see ``comparison_rows`` for the columns)."""
    spec = get_spec(name)  # an unknown name fails here, with close names suggested
    n = seq_len
    pattern = spec.build()
    if pattern.routed:  # no fixed mask: its pairs come with each call
        # a graph's pairs are its edges, given with the call (edge_index), not chosen from q, k
        by, pairs = ("by the graph", "given by the graph")
        if not reads_graph(pattern):
            by, pairs = ("by content", "chosen by content")
        return [f"`{name}`", pairs, spec.complexity or "-", "O(1)", by, pairs]
    try:
        pairs = allowed_pairs(pattern, n, n)
        mask = dense_mask(name, n)
    except ValueError as error:  # e.g. global blocks that do not fit in n positions
        raise ValueError(
            f"variant {name!r} does not fit seq_len={n}: {error}; pass a longer seq_len"
        ) from error
    path = max_path_length(mask)
    field = min_receptive_fraction(mask, layers)
    return [
        f"`{name}`",
        f"{pairs} ({100 * pairs / n**2:.3g}%)",
        spec.complexity or "-",
        "O(1)",
        "never" if path is None else str(path),
        f"{100 * field:.3g}%",
    ]


def comparison_rows(
    seq_len: int, layers: int, variants: list[str] | None = None
) -> list[list[str]]:
    """The comparison at length ``seq_len``, one row of strings per variant (all by default).

    Columns: the variant; its exact allowed pairs at n with the density pairs / n^2 in percent; its
    complexity per layer from the registry; sequential operations, "O(1)" for every variant (one
    layer is one parallel step); the maximum path length in layers (``zoo.views.paths``; "never"
    where some required pair is never connected); and the receptive field after ``layers`` layers:
    the smallest share, over queries, of the keys it must reach (all, or j <= i when causal) that it
    has heard from. A variant whose pairs are chosen by content (``moba``) or given by a graph
    with each call (``graph``) says so in the columns that a fixed mask would fill.
    """
    _check_positive("seq_len", seq_len)
    _check_positive("layers", layers)
    names = list_variants() if variants is None else list(variants)
    return [comparison_row(name, seq_len, layers) for name in names]


def comparison_table(seq_len: int, layers: int, variants: list[str] | None = None) -> str:
    """``comparison_rows`` as an aligned markdown table (``zoo.views.tables.markdown_table``)."""
    rows = comparison_rows(seq_len, layers, variants)
    headers = [h.format(layers=layers) for h in HEADERS]
    return markdown_table(headers, rows)
