"""The three views of every pattern agree, and each family has its defining property."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import FIXED_VARIANTS, small_params

import zoo
from zoo.functional import resolve_pattern
from zoo.layout.block_layout import allowed_pairs_bounds, build_layout, specialized
from zoo.layout.frames import build_frame
from zoo.patterns import (
    EMPTY,
    FULL,
    PARTIAL,
    BlockLocal,
    Causal,
    Global,
    Local,
    Random,
    dilated,
    graph,
    query_positions,
    strided,
)

CPU = torch.device("cpu")
SHAPES = [(37, 37), (100, 100), (70, 100), (100, 70), (1, 33)]
# 2-D patterns need a grid of the length, and a prime length has only 1 x 37: 36 instead.
GRID_SHAPES = [(36, 36), *SHAPES[1:]]
BLOCKS = [(16, 16), (8, 32), (32, 8), (64, 64)]


def exact_state(pattern, frame, q_len, kv_len):
    """The true block states of a frame, from the dense mask: the test's independent answer."""
    dense = pattern.dense(q_len, kv_len)
    valid = frame.q.valid[:, None] & frame.k.valid[None, :]
    mask = dense[frame.q.index][:, frame.k.index] & valid
    shape = (frame.q.num_blocks, frame.q.block, frame.k.num_blocks, frame.k.block)
    some = mask.view(shape).any(3).any(1)
    every = mask.view(shape).all(3).all(1)
    return torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("variant", FIXED_VARIANTS)
def test_three_views_agree(variant, causal):
    """dense, mask_mod and allowed agree; parts() are disjoint and cover the pattern; block_state
    never says EMPTY for a block with pairs nor FULL for one without them all, for the whole pattern
    and for each part in the natural order, its own and stride 3 (``zoo.check_pattern``, tested in
    test_check_pattern.py, is the check users run)."""
    pattern = resolve_pattern(variant, causal, small_params(variant))
    shapes = GRID_SHAPES if "grid" in zoo.get_spec(variant).parameters() else SHAPES
    assert zoo.check_pattern(pattern, lengths=shapes, block_sizes=BLOCKS) == len(shapes)


FAMILIES = [
    Local(3),
    Local((2, 0)),
    BlockLocal(8),
    BlockLocal(8, neighbors=1),
    strided(stride=5),
    dilated(window_size=2, dilation=3),
    Global(2),
    Global((1, 4), block_size=3),
    Random(block_size=8, num_blocks=2, seed=3),
    Causal(),
]


@pytest.mark.parametrize("family", FAMILIES, ids=repr)
def test_single_family_layout_is_exact(family):
    """A family alone, in its own token order, computes exactly the blocks that hold pairs."""
    for (q_len, kv_len), (bq, bk) in itertools.product(SHAPES[:4], BLOCKS):
        p = specialized(family, q_len, kv_len, CPU)
        frame = build_frame(p.stride, q_len, kv_len, bq, bk, CPU)
        assert torch.equal(build_layout(p, frame).state, exact_state(p, frame, q_len, kv_len))


def test_strided_regrouping_makes_blocks_dense():
    """In its own order the residue pattern fills whole blocks; in the natural order it does not."""
    p = specialized(strided(stride=8), 512, 512, CPU)
    natural = build_layout(p, build_frame(1, 512, 512, 32, 32, CPU))
    grouped = build_layout(p, build_frame(8, 512, 512, 32, 32, CPU))
    assert natural.density() == 1.0  # every block holds some pair 8 apart
    assert grouped.density() == pytest.approx(1 / 8)  # one residue group in eight
    assert bool((grouped.state[grouped.state != EMPTY] == FULL).all())


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_a_difference_keeps_the_full_blocks_that_its_exclude_leaves_whole(causal):
    """strided with its band runs its keys by residue less the band (a ``Difference``) in the
    stride's order, where every block off the band is whole: FULL exactly where the dense mask's
    blocks are (a PARTIAL block has flex evaluate its mask per element)."""
    n = 1024
    pattern = resolve_pattern("strided", causal, {"stride": 8, "window_size": 7})
    part = specialized(pattern, n, n, CPU).parts()[-1]
    frame = build_frame(part.stride, n, n, 16, 16, CPU)
    state, exact = build_layout(part, frame).state, exact_state(part, frame, n, n)
    assert int((exact == FULL).sum()) >= 100
    assert torch.equal(state == FULL, exact == FULL)


@pytest.mark.parametrize("variant", ["axial_2d", "bigbird"])
def test_a_compositions_layout_asks_its_partial_blocks_again_on_squares(variant):
    """A composition's ``block_state`` is not exact: under causal rules an axial pattern's
    blocks in its tiles that each member cuts may together allow nothing, and BigBird's members
    may only together fill a block. The layout asks the blocks it calls PARTIAL again on their
    squares: EMPTY and FULL where the dense mask's blocks are."""
    n = 4096  # the axial grid 64 x 64 in tiles of 8 x 16: a run of 16 slots is 16 columns of a row
    part = specialized(resolve_pattern(variant, True, {}), n, n, CPU).parts()[0]
    frame = build_frame(part.stride, n, n, 128, 128, CPU)
    asked = part.block_state(frame.q.spans().column(), frame.k.spans().row())
    state, exact = build_layout(part, frame).state, exact_state(part, frame, n, n)
    assert not torch.equal(asked, exact)  # the composition alone: some blocks not settled
    assert torch.equal(state, exact)


@pytest.mark.parametrize("stride", [1, 3, 8])
@pytest.mark.parametrize("q_len,kv_len", [(64, 64), (50, 50), (20, 50), (21, 50)])
def test_frame_gather_places_each_token_in_its_slot(stride, q_len, kv_len):
    """gather (a transposing copy where the frame allows one) puts token index[s] in slot s and
    scatter brings every token back, for aligned and unaligned queries, padded or not."""
    frame = build_frame(stride, q_len, kv_len, 4, 4, CPU)
    for axis in (frame.q, frame.k):
        x = torch.randn(2, axis.length, 3)
        slots = axis.gather(x, dim=1)
        assert slots.shape == (2, axis.slots, 3)
        assert torch.equal(slots[:, axis.valid], x[:, axis.index[axis.valid]])
        assert torch.equal(axis.scatter(slots, dim=1), x)
    if stride == 8 and q_len == kv_len:
        assert frame.q.aligned  # the fast path is the one tested here


def test_a_frames_spans_of_runs_within_its_blocks():
    """``spans(size)``: the runs of ``size`` slots in each block, in one group of a stride's
    order; a size that does not divide the block is refused (its runs would cross groups)."""
    frame = build_frame(3, 40, 40, 8, 8, CPU)  # groups of 14, 13 and 13, each padded to 16
    runs = frame.k.spans(4)
    assert runs.lo[:4].tolist() == [0, 12, 24, 36] and runs.step == 3
    assert runs.hi[:4].tolist() == [9, 21, 33, 39] and runs.complete[:4].tolist() == [1, 1, 1, 0]
    with pytest.raises(ValueError, match="size must divide the frame's block of 8, got 5"):
        frame.q.spans(5)


def positions(q_len, kv_len):
    return query_positions(q_len, kv_len)[:, None], torch.arange(kv_len)[None, :]


@pytest.mark.parametrize("q_len,kv_len", [(50, 50), (20, 50), (50, 20)])
def test_local_window_width(q_len, kv_len):
    i, j = positions(q_len, kv_len)
    assert torch.equal(Local(4).dense(q_len, kv_len), (i - j).abs() <= 4)
    assert torch.equal(Local((3, 1)).dense(q_len, kv_len), (j >= i - 3) & (j <= i + 1))
    rows = Local(4).dense(60, 60).sum(1)
    assert rows[4:-4].eq(9).all() and rows[0] == 5  # 2w + 1 keys away from the edges


@pytest.mark.parametrize("q_len,kv_len", [(50, 50), (20, 50), (50, 20)])
def test_causal_is_bottom_right_aligned(q_len, kv_len):
    mask = zoo.dense_mask("causal", q_len, kv_len)
    i, j = positions(q_len, kv_len)
    assert torch.equal(mask, j <= i)
    assert mask[-1].all()  # the last query sees every key
    sliding = zoo.dense_mask("sliding_window", q_len, kv_len, window_size=3)
    assert torch.equal(sliding, (j <= i) & (j >= i - 3))


def test_block_local_chunks_with_a_short_last_chunk():
    mask = BlockLocal(8).dense(30, 30)
    chunk = torch.arange(30) // 8
    assert torch.equal(mask, chunk[:, None] == chunk[None, :])
    assert mask[29].sum() == 6  # the last chunk holds positions 24..29
    neighbours = BlockLocal(8, neighbors=1).dense(30, 30)
    assert torch.equal(neighbours, (chunk[:, None] - chunk[None, :]).abs() <= 1)


def test_strided_and_dilated_offsets():
    i, j = positions(60, 60)
    assert torch.equal(
        zoo.dense_mask("strided", 60, stride=7, window_size=2),
        ((i - j) % 7 == 0) | ((i - j).abs() <= 2),
    )
    assert torch.equal(zoo.dense_mask("strided", 60, stride=7, window_size=0), (i - j) % 7 == 0)
    d = zoo.dense_mask("dilated", 60, window_size=2, dilation=3)
    assert torch.equal(d, ((i - j) % 3 == 0) & ((i - j).abs() <= 6))
    assert d[30].sum() == 5  # 2 keys on each side, 3 apart, and the query itself


def test_global_rows_and_columns():
    mask = zoo.dense_mask("global", 40, global_tokens=[0, 7])
    assert mask[[0, 7]].all() and mask[:, [0, 7]].all()
    others = torch.ones(40, dtype=torch.bool)
    others[[0, 7]] = False
    assert not mask[others][:, others].any()
    blocks = Global(2, block_size=5).dense(40, 40)
    assert blocks[:10].all() and blocks[:, :10].all() and not blocks[10:, 10:].any()


def test_random_blocks_reproducible_by_seed():
    def draw(seed, kv_len=256):
        return specialized(
            Random(block_size=16, num_blocks=3, seed=seed), kv_len, kv_len, CPU
        ).dense(kv_len, kv_len)

    assert torch.equal(draw(5), draw(5))
    assert not torch.equal(draw(5), draw(6))
    per_block = draw(5).view(16, 16, 16, 16).any(3).any(1).sum(1)
    assert per_block.eq(3).all(), "each query block attends exactly num_blocks key blocks"
    # Fewer queries than keys (decoding): the last queries see the blocks of the square case.
    decode = specialized(Random(16, 3, 5), 40, 256, CPU).dense(40, 256)
    assert torch.equal(decode, draw(5)[-40:])


def test_random_blocks_do_not_depend_on_the_module_mode():
    attn = zoo.create_attention("random", dim=32, num_heads=2, block_size=8, backend="reference")
    x = torch.randn(1, 64, 32)
    attn.train()
    _, w_train = attn(x, return_weights=True)
    attn.eval()
    _, w_eval = attn(x, return_weights=True)
    assert torch.equal(w_train > 0, w_eval > 0)


def test_bigbird_is_window_plus_global_plus_random():
    params = dict(block_size=8, window_neighbors=1, global_blocks=1, random_blocks=2, seed=1)
    mask = zoo.dense_mask("bigbird", 128, **params)
    window = BlockLocal(8, neighbors=1).dense(128, 128)
    assert mask[window].all()
    assert mask[:8].all() and mask[:, :8].all()
    extra = (mask & ~window).view(16, 8, 16, 8).any(3).any(1)
    extra[0] = False
    extra[:, 0] = False
    assert extra.sum(1)[1:].ge(1).all()  # random blocks beyond the window and global ones


def test_longformer_dilation_is_optional():
    plain = zoo.dense_mask("longformer", 64, window_size=3)
    dilated_ = zoo.dense_mask("longformer", 64, window_size=3, dilation=2)
    assert plain[20].sum() == 7 + 1 and dilated_[20].sum() == 7 + 1  # 2w + 1 keys plus token 0
    assert dilated_[20, 14] and not plain[20, 14]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_allowed_pairs_counts_exactly(causal):
    """Counting blocks of 32 and of 128, whose partial blocks split into parts of 16 before their
    pairs are evaluated, and of 8, which do not split."""
    for variant in FIXED_VARIANTS:
        params = small_params(variant)
        pattern = resolve_pattern(variant, causal, params)
        for q_len, kv_len in [(100, 100), (70, 100), (300, 300)]:
            truth = int(zoo.dense_mask(pattern, q_len, kv_len).sum())
            for block in (8, 32, 128):
                counted = zoo.allowed_pairs(pattern, q_len, kv_len, block=block)
                assert counted == truth, (variant, q_len, kv_len, block)


def test_the_bounds_from_block_states_hold_the_exact_count():
    """``allowed_pairs_bounds`` brackets the count for every variant, and is the count where a
    pattern's blocks align with the counting blocks (no partial block)."""
    for variant in FIXED_VARIANTS:
        params = small_params(variant)
        for q_len, kv_len in [(100, 100), (70, 100), (100, 70), (300, 300)]:
            pattern = resolve_pattern(variant, False, params)
            low, high = allowed_pairs_bounds(pattern, q_len, kv_len, block=32)
            assert low <= zoo.allowed_pairs(pattern, q_len, kv_len, block=32) <= high, variant
    aligned = BlockLocal(block_size=32)  # each query block its own key block
    assert allowed_pairs_bounds(aligned, 256, 256, 32) == (256 * 32, 256 * 32)
    assert allowed_pairs_bounds(aligned, 256, 256, 64) == (0, 4 * 64 * 64)  # all partial


@pytest.mark.parametrize(
    "variant, causal, params, n",
    [
        ("local", False, dict(window_size=200), 150),  # wider than the sequence: full
        ("local", True, dict(window_size=200), 150),  # causal
        ("local", True, dict(window_size=100), 150),  # neither
        ("longformer", False, dict(window_size=2), 300),
        ("bigbird", False, dict(block_size=16), 40),  # every block reached at 40 tokens: full
        ("bigbird", True, dict(block_size=16), 40),  # causal, drawn per head
        ("bigbird", False, dict(block_size=16), 400),
        ("full", True, {}, 77),
    ],
)
def test_explain_says_dense_exactly_where_the_mask_is_full_or_causal(variant, causal, params, n):
    """``explain``'s note that a sparse pattern allows every pair (or every causal pair) at this
    length, against the dense masks of every head: the block states' bounds never decide it
    wrongly."""
    from zoo.functional import dense_at_length
    from zoo.layout.block_layout import head_layout, with_heads

    pattern, heads = resolve_pattern(variant, causal, params), 3
    drawn = specialized(pattern, n, n, CPU)
    if pattern.per_head:
        drawn = with_heads(drawn, heads)
        masks = [head_layout(drawn, h).dense(n, n) for h in range(heads)]
    else:
        masks = [drawn.dense(n, n)]
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    full = all(m.all() for m in masks)
    want = "full" if full else "causal" if all((m == tril).all() for m in masks) else None
    if pattern.kind != "sparse":
        want = None  # full and causal themselves are not sparse patterns
    assert dense_at_length(pattern, n, n, heads) == want


def _allowed_said(text: str) -> tuple[int, int]:
    """The allowed pairs ``explain`` states: (fewest, most) over heads or sequences."""
    said = text.split("the pattern allows ")[1].split(" pairs")[0]
    low, _, high = said.partition(" to ")
    return int(low), int(high or low)


@pytest.mark.parametrize("variant, causal, params, n", [
    ("longformer", True, dict(window_size=5), 101),
    ("strided", False, dict(stride=8, window_size=3), 130),
    ("neighborhood_2d", False, dict(grid=(10, 13), kernel_size=(3, 5)), 130),
    ("bigbird", False, dict(block_size=8, random_among="all"), 130),  # heads differ
    ("bigbird", True, dict(block_size=8), 99),
])  # fmt: skip
def test_explain_states_the_pairs_the_pattern_allows_per_head(variant, causal, params, n):
    """Beside the scores a backend computes, ``explain`` says the pairs the pattern allows:
    the dense masks' counts, the fewest and most over the heads of a pattern drawn per head.
    ``allowed_pairs`` itself counts one layout and names what to count for heads drawn."""
    from zoo.layout.block_layout import head_layout, with_heads

    heads = 3
    q = torch.randn(1, heads, n, 4)
    text = zoo.explain(q, q, q, variant=variant, causal=causal, **params)
    pattern = specialized(resolve_pattern(variant, causal, params), n, n, CPU)
    drawn = with_heads(pattern, heads) if pattern.per_head else pattern
    counts = [int(head_layout(drawn, h).dense(n, n).sum()) for h in range(heads)]
    assert _allowed_said(text) == (min(counts), max(counts)), text
    padding = torch.zeros(1, n, dtype=torch.bool).index_fill_(1, torch.tensor([n - 1]), True)
    padded = zoo.explain(q, q, q, variant=variant, causal=causal, key_padding_mask=padding,
                         **params)  # fmt: skip
    assert "(padding aside)" in padded, padded
    if variant == "bigbird" and not causal:
        assert len(set(counts)) > 1, counts  # the range is exercised
        with pytest.raises(ValueError, match=r"one per head .*count pattern.head\(h\)"):
            zoo.allowed_pairs(drawn, n, n)
        with pytest.raises(ValueError, match=r"one per head"):
            allowed_pairs_bounds(drawn, n, n)


def test_explain_states_a_graphs_pairs_per_sequence_and_a_choice_by_content():
    """A graph's pairs are its edges, per sequence (a graph each here: a range); MoBA's are
    chosen at each call, which ``explain`` says rather than counting one call's choice."""
    n, graphs = 40, [torch.randint(0, 40, (2, m), generator=torch.Generator().manual_seed(m))
                     for m in (30, 90)]  # fmt: skip
    q = torch.randn(2, 2, n, 4)
    for causal in (False, True):
        text = zoo.explain(q, q, q, variant="graph", edge_index=graphs, causal=causal)
        counts = [int(zoo.dense_mask("graph", n, edge_index=g, causal=causal).sum())
                  for g in graphs]  # fmt: skip
        assert counts[0] != counts[1] and _allowed_said(text) == (min(counts), max(counts)), text
    composed = zoo.explain(q, q, q, variant=graph() | Local(2), edge_index=graphs)
    assert "the pattern's pairs follow the call's graph (not counted here)" in composed, composed
    moba = zoo.explain(q, q, q, variant="moba", block_size=8, top_k=2)
    assert "the pattern chooses its pairs by content" in moba, moba


def test_explain_tells_a_long_sparse_pattern_from_dense_without_counting_its_pairs(monkeypatch):
    """At 64K tokens a window of 4 is told apart from full and causal attention by its block
    states alone: no pair of its partial blocks is evaluated (that took minutes for BigBird at
    128K tokens, per head)."""
    from zoo.functional import dense_at_length
    from zoo.layout import block_layout

    counted = []
    exact = block_layout._allowed_pairs
    monkeypatch.setattr(
        block_layout, "_allowed_pairs", lambda p, *a: counted.append(p) or exact(p, *a)
    )
    for causal in (False, True):
        pattern = resolve_pattern("local", causal, dict(window_size=4))
        assert dense_at_length(pattern, 65536, 65536) is None
    assert all(isinstance(p, Causal) for p in counted), counted  # the causal count alone
