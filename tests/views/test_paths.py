"""Path lengths and receptive fields over stacked layers, and the comparison table built on them."""

from __future__ import annotations

import math
from collections import deque

import pytest
import torch
from helpers import FIXED_VARIANTS, GRAPH_VARIANTS

import zoo
from zoo.views.comparison import comparison_rows, comparison_table
from zoo.views.paths import max_path_length, min_receptive_fraction, receptive_field

LENGTHS = [16, 33, 64]
WINDOWS = [1, 3, 5]
PATH_COLUMN = 4  # the columns of comparison_rows
FIELD_COLUMN = 5


def brute_force_path_length(mask: torch.Tensor) -> int | None:
    """Breadth-first search from every query over the mask's edges: the oracle, O(n^3)."""
    n = mask.shape[0]
    causal = not mask.triu(1).any()
    neighbours = [torch.nonzero(mask[i]).flatten().tolist() for i in range(n)]
    worst = 0
    for start in range(n):
        dist = {start: 0}
        queue = deque([start])
        while queue:
            node = queue.popleft()
            for nxt in neighbours[node]:
                if nxt not in dist:
                    dist[nxt] = dist[node] + 1
                    queue.append(nxt)
        for j in range(start + 1 if causal else n):
            if j not in dist:
                return None
            worst = max(worst, dist[j])
    return worst


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("w", WINDOWS)
@pytest.mark.parametrize("variant", ["local", "sliding_window"])
def test_window_path_length_is_ceil_n_minus_one_over_w(variant, n, w):
    mask = zoo.dense_mask(variant, n, window_size=w)
    assert max_path_length(mask) == math.ceil((n - 1) / w)


@pytest.mark.parametrize("n", [2, *LENGTHS])
@pytest.mark.parametrize("variant", ["full", "causal"])
def test_full_and_causal_connect_in_one_layer(variant, n):
    assert max_path_length(zoo.dense_mask(variant, n)) == 1


def test_one_token_needs_no_layer():
    assert max_path_length(zoo.dense_mask("full", 1)) == 0


@pytest.mark.parametrize("n", LENGTHS)
def test_global_connects_through_the_global_token_in_two_layers(n):
    assert max_path_length(zoo.dense_mask("global", n)) == 2


def test_patterns_without_a_path_give_none():
    assert max_path_length(zoo.dense_mask("block_local", 64, block_size=16, neighbors=0)) is None
    # Dilation 4 only ever links positions with the same residue mod 4.
    assert max_path_length(zoo.dense_mask("dilated", 64, window_size=4, dilation=4)) is None
    # A causal global pattern: key 3 never reaches query 5 (only token 0 is shared).
    assert max_path_length(zoo.dense_mask("global", 16, causal=True)) is None
    # One block holds every position: everything is connected in one layer.
    assert max_path_length(zoo.dense_mask("block_local", 16, block_size=16)) == 1


def test_strided_and_bigbird_are_short_and_finite():
    # Band of 7 then jumps of 8: any key is one band step and one stride step away.
    assert max_path_length(zoo.dense_mask("strided", 64, stride=8, window_size=7)) == 2
    # Through a global block: query -> global block -> key.
    path = max_path_length(zoo.dense_mask("bigbird", 256, block_size=16))
    assert path is not None and 1 <= path <= 2


@pytest.mark.parametrize(
    ("variant", "params"),
    [
        ("random", {"block_size": 4, "num_blocks": 2, "seed": 0}),  # 4 bidirectional
        ("random", {"block_size": 2, "num_blocks": 2, "seed": 1}),  # 6 bidirectional
        ("random", {"block_size": 4, "num_blocks": 1, "seed": 3}),  # never
        ("strided", {"stride": 5, "window_size": 1}),
        ("dilated", {"window_size": 2, "dilation": 2}),
        ("longformer", {"window_size": 2, "global_tokens": 1}),
        ("bigbird", {"block_size": 4, "global_blocks": 1, "random_blocks": 1}),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_breadth_first_search(variant, params, causal):
    mask = zoo.dense_mask(variant, 24, causal=causal, **params)
    assert max_path_length(mask) == brute_force_path_length(mask)


def test_rejects_a_non_square_mask():
    with pytest.raises(ValueError, match="square"):
        max_path_length(zoo.dense_mask("full", 4, 6))


def test_receptive_field_of_full_is_everything_after_one_layer():
    mask = zoo.dense_mask("full", 33)
    assert receptive_field(mask, 0).tolist() == [1] * 33
    assert receptive_field(mask, 1).tolist() == [33] * 33
    assert min_receptive_fraction(mask, 1) == 1.0


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("w", WINDOWS)
def test_receptive_field_of_local_grows_by_2w_per_layer(n, w):
    mask = zoo.dense_mask("local", n, window_size=w)
    middle = n // 2
    previous = receptive_field(mask, 0)
    for layers in range(1, 6):
        field = receptive_field(mask, layers)
        assert (field >= previous).all()
        # w * layers keys on each side, clipped at the ends of the sequence.
        expected = min(middle, w * layers) + min(n - 1 - middle, w * layers) + 1
        assert int(field[middle]) == expected
        if w * layers < n - 1 - middle:  # not clipped yet: the 2wL + 1 of the notes
            assert expected == 2 * w * layers + 1
        previous = field
    assert receptive_field(mask, 100).tolist() == [n] * n


def test_receptive_field_rejects_negative_layers():
    with pytest.raises(ValueError, match="layers"):
        receptive_field(zoo.dense_mask("full", 4), -1)


@pytest.fixture(scope="module")
def rows_at_256() -> list[list[str]]:
    return comparison_rows(256, 2)


def test_every_variant_has_a_row(rows_at_256):
    assert [row[0] for row in rows_at_256] == [f"`{name}`" for name in zoo.list_variants()]
    for name, row in zip(zoo.list_variants(), rows_at_256, strict=True):
        if name in FIXED_VARIANTS:
            pairs = zoo.allowed_pairs(zoo.get_spec(name).build(), 256, 256)
            assert row[1].startswith(f"{pairs} (")
        elif name in GRAPH_VARIANTS:  # its edges come with each call: nothing to count
            assert row[1] == row[FIELD_COLUMN] == "given by the graph"
            assert row[PATH_COLUMN] == "by the graph"
        else:  # no fixed mask to count
            assert row[1] == row[FIELD_COLUMN] == "chosen by content"
            assert row[PATH_COLUMN] == "by content"
        assert row[2] == zoo.get_spec(name).complexity
        assert row[3] == "O(1)"
    by_name = {row[0]: row for row in rows_at_256}
    assert by_name["`full`"][1] == "65536 (100%)"
    assert by_name["`block_local`"][PATH_COLUMN] == "never"


@pytest.mark.parametrize("n", [256, 512])
def test_table_reproduces_the_seed_rows(n):
    rows = {row[0]: row for row in comparison_rows(n, 1, ["full", "local"])}
    w = zoo.get_spec("local").params["window_size"]
    assert rows["`full`"][PATH_COLUMN] == "1"  # self-attention: O(1)
    assert rows["`local`"][PATH_COLUMN] == str(math.ceil((n - 1) / w))  # restricted: O(n/r)
    assert rows["`full`"][FIELD_COLUMN] == "100%"
    # After one layer the first query has heard itself and w keys: (w + 1) / n of all keys.
    assert rows["`local`"][FIELD_COLUMN] == f"{100 * (w + 1) / n:.3g}%"


def test_rows_agree_with_the_dense_masks():
    # 64 = 8 x 8: the 2-D variants' default 7 x 7 kernel fits its grid.
    for name, row in zip(FIXED_VARIANTS, comparison_rows(64, 2, FIXED_VARIANTS), strict=True):
        mask = zoo.dense_mask(name, 64)
        assert row[1].startswith(f"{int(mask.sum())} (")
        path = max_path_length(mask)
        assert row[PATH_COLUMN] == ("never" if path is None else str(path))


def test_table_is_markdown_with_the_layers_in_its_header():
    table = comparison_table(64, 3, ["full", "causal"])
    lines = table.splitlines()
    assert len(lines) == 4 and "after 3 layers" in lines[0] and lines[1].startswith("|--")
    # Causal queries must hear only the keys up to themselves: all of those after one layer.
    assert "`causal`" in lines[3] and "100%" in lines[3]


@pytest.mark.parametrize(("argument", "args"), [("seq_len", (0, 2)), ("layers", (16, -1))])
def test_table_rejects_non_positive_arguments(argument, args):
    with pytest.raises(ValueError, match=rf"{argument} must be a positive int, got -?\d"):
        comparison_rows(*args)


def test_table_lets_an_unknown_variant_name_fail_with_suggestions():
    with pytest.raises(ValueError, match="did you mean 'local'"):
        comparison_rows(16, 1, ["locla"])
