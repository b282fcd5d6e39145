"""The benchmark's own bookkeeping never builds an n x n tensor for a sparse variant: the
pairs of a choice by content (``eval.bench.routed.chosen_pairs``) are counted from the choice,
exactly as its dense view sums, and a point's pair counts at 131072 tokens stay far below n^2."""

from __future__ import annotations

import pytest
import torch
from helpers import GRAPH_VARIANTS, LargestTensor

import zoo
from eval.bench import routed
from eval.bench.impls import Point
from eval.bench.routed import chosen_pairs, count_bound_pairs, is_routed
from eval.bench.sweep import Runner, chosen_pairs_for
from zoo.functional import resolve_pattern
from zoo.patterns import RouteInputs


def inputs(n: int, kv_len: int | None = None, batch: int = 2, heads: int = 3, kv_heads: int = 3):
    generator = torch.Generator().manual_seed(n)
    q = torch.randn(batch, heads, n, 8, generator=generator)
    k = torch.randn(batch, kv_heads, kv_len or n, 8, generator=generator)
    return q, k


def dense_count(pattern, causal: bool, q, k) -> int:
    """The count the benchmark used to make: the bound pattern's dense view, summed."""
    bound = pattern.bind(RouteInputs(q, k, None, causal))
    dense = bound.dense(q.shape[2], k.shape[2])
    return int(dense.expand(q.shape[0], q.shape[1], -1, -1).sum())


MOBA = [
    # (queries, keys, block_size, top_k): lengths not multiples of the block, a short last block,
    # fewer blocks than top_k, more keys than queries (a bottom-right aligned diagonal)
    (100, 100, 16, 3),
    (203, 203, 24, 2),
    (300, 300, 7, 4),
    (130, 130, 64, 3),
    (37, 37, 64, 3),
    (90, 250, 16, 3),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "kv_len", "block_size", "top_k"), MOBA)
def test_chosen_pairs_equal_the_dense_count(n, kv_len, block_size, top_k, causal):
    params = {"block_size": block_size, "top_k": top_k}
    q, k = inputs(n, kv_len, kv_heads=1)  # grouped: one key head serves the three query heads
    pattern = resolve_pattern("moba", causal, dict(params))
    expected = dense_count(pattern, causal, q, k)
    assert chosen_pairs("moba", params, causal, q, k) == round(expected / (2 * 3))
    # The general path (allowed_at on chunks of rows) gives the same total.
    bound = pattern.bind(RouteInputs(q, k, None, causal))
    device = q.device
    assert routed._count_by_rows(bound, 2, 3, n, kv_len, device) == expected
    assert count_bound_pairs(bound, 2, 3, n, kv_len, device) == expected


def test_every_routed_variant_that_binds_counts_as_its_dense_view():
    """Each routed registry variant with its default parameters (those that bind to q and k
    alone: a graph needs its edges), at lengths that are not multiples of its blocks."""
    counted = []
    for variant in zoo.list_variants():
        if not is_routed(variant, {}):
            continue
        for n, causal in [(150, False), (270, True)]:
            q, k = inputs(n)
            pattern = resolve_pattern(variant, causal, {})
            try:
                expected = dense_count(pattern, causal, q, k)
            except ValueError:
                break
            assert chosen_pairs(variant, {}, causal, q, k) == round(expected / 6), variant
            counted.append(variant)
    assert "moba" in counted


def test_a_composition_with_a_choice_counts_through_the_general_path():
    """A routed layout other than a choice met with causal (here moba or a window) is counted by
    rows, equal to its dense view."""
    moba = resolve_pattern("moba", False, {"block_size": 16, "top_k": 2})
    pattern = moba | resolve_pattern("sliding_window", False, {"window_size": 9})
    q, k = inputs(123)
    bound = pattern.bind(RouteInputs(q, k))
    assert routed._chosen_blocks(bound) is None
    expected = int(bound.dense(123, 123).expand(2, 3, -1, -1).sum())
    assert count_bound_pairs(bound, 2, 3, 123, 123, q.device) == expected


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [8192, 131072])
def test_counting_a_choice_builds_no_n_by_n_tensor(n, causal):
    """At 131072 tokens the dense count needed 16 GiB per sequence and head (512 GiB on the GPU
    sweep's 16 heads); the count now holds nothing larger than the choice itself, (B, H, n,
    blocks), or one counting chunk."""
    params = {"block_size": 4096, "top_k": 3}
    q, k = inputs(n, batch=1, heads=2, kv_heads=2)
    blocks = -(-n // 4096)
    with LargestTensor() as mode:
        pairs = chosen_pairs("moba", params, causal, q, k)
    assert mode.largest <= max(2 * n * blocks, routed.CHUNK_ELEMENTS)
    assert mode.largest < n * n // 16
    budget = 3 * 4096 * n  # at most top_k whole blocks per query
    assert 0 < pairs <= budget


def test_a_points_pair_counts_at_131072_tokens_stay_far_below_n_squared():
    """The sweep's bookkeeping for a point (``Runner.count``): the routed count from the point's
    inputs and a fixed pattern's exact count, without an n x n mask."""
    n = 131072
    q, k = inputs(n, batch=1, heads=1, kv_heads=1)
    point = Point(n, True, False, q, k, k, q, False)
    moba = type("Impl", (), {"variant": "moba", "params": {"block_size": 8192, "top_k": 2}})
    local = type("Impl", (), {"variant": "sliding_window", "params": {"window_size": 256}})
    with LargestTensor() as mode:
        routed_pairs = Runner.count(moba, point)
        window_pairs = Runner.count(local, point)
    assert mode.largest < n * n // 64
    assert 0 < routed_pairs <= 2 * 8192 * n
    assert window_pairs == sum(min(i + 1, 257) for i in range(n))  # itself and 256 before


def test_a_choice_that_cannot_be_made_gives_no_count():
    """A graph needs its edges: no count (its cells record why), the sweep goes on."""
    q, k = inputs(64)
    assert chosen_pairs_for("graph", {}, False, q, k) is None


@pytest.mark.parametrize("variant", zoo.list_variants())
def test_every_variants_pair_count_at_131072_tokens_builds_nothing_near_n_squared(variant):
    """The sweep's count of a point's allowed pairs (``Runner.count``) for every registry variant
    with the GPU benchmark's parameters (eval/configs/bench.yaml) at 131072 tokens, causal: no
    tensor over n^2 / 64 elements (the inputs are n x 8); a graph has no count without edges."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    params = yaml.safe_load((root / "eval" / "configs" / "bench.yaml").read_text())["params"]
    n = 131072
    q, k = inputs(n, batch=1, heads=1, kv_heads=1)
    point = Point(n, True, False, q, k, k, q, False)
    impl = type("Impl", (), {"variant": variant, "params": dict(params.get(variant, {}))})
    with LargestTensor() as mode:
        pairs = Runner.count(impl, point)
    assert mode.largest < n * n // 64, f"{mode.largest / n**2:.3g} of n^2"
    if variant in GRAPH_VARIANTS:
        assert pairs is None
        return
    assert pairs is not None and 0 < pairs <= n * (n + 1) // 2
