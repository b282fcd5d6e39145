"""BigBird's structure (Zaheer et al. 2020, ITC): random blocks drawn outside the window and the
global blocks, global blocks first and last, and the older forms still reachable as options
(zoo.patterns.random_blocks, zoo.patterns.global_blocks)."""

import pytest
import torch

import zoo
from zoo.functional import resolve_pattern
from zoo.layout.block_layout import specialized
from zoo.patterns import BlockLocal, Global, Random, RandomBlocks
from zoo.patterns.global_blocks import GlobalBlocks, global_block_indices
from zoo.patterns.random_blocks import draw_outside

CPU = torch.device("cpu")


def members(n, causal=False, **params):
    pattern = specialized(resolve_pattern("bigbird", causal, params), n, n, CPU)
    union = pattern.children[0] if causal else pattern
    table = next(c for c in union.children if isinstance(c, RandomBlocks)).table
    globals_ = next(c for c in union.children if isinstance(c, Global)).global_tokens
    return table, set(globals_)


def block_view(mask, block):
    """[q blocks, k blocks]: whether any pair of the two blocks is allowed."""
    n = mask.shape[0]
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, blocks * block, dtype=torch.bool)
    padded[:n, :n] = mask
    return padded.view(blocks, block, blocks, block).any(3).any(1)


@pytest.mark.parametrize("position", ["first_last", "first"])
@pytest.mark.parametrize(
    ("n", "block", "r", "w", "seed"),
    [(160, 16, 3, 1, 0), (208, 16, 3, 1, 7), (1024, 64, 3, 1, 0), (8192, 64, 3, 1, 1),
     (300, 8, 4, 2, 3), (95, 8, 2, 1, 2)],
)  # fmt: skip
def test_every_middle_row_has_exactly_random_blocks_outside_window_and_globals(
    n, block, r, w, seed, position
):
    params = dict(block_size=block, random_blocks=r, window_neighbors=w, seed=seed)
    table, globals_ = members(n, global_position=position, **params)
    blocks = -(-n // block)
    for i, row in enumerate(table.tolist()):
        if i in globals_:
            continue  # a global row reads every key
        assert len(set(row)) == r and min(row) >= 0, (i, row)
        assert all(abs(j - i) > w and j not in globals_ and j < blocks for j in row), (i, row)
    if n <= 1024:  # the same seen from the mask: exactly r blocks beyond window and globals
        mask = block_view(zoo.dense_mask("bigbird", n, global_position=position, **params), block)
        rows = torch.arange(blocks)
        extra = mask & ((rows[:, None] - rows[None, :]).abs() > w)
        extra[:, list(globals_)] = False
        middle = [i for i in range(blocks) if i not in globals_]
        assert extra[middle].sum(1).eq(r).all()


def test_causal_rows_draw_outside_their_window_and_the_first_globals():
    n, block, r = 400, 8, 3
    table, globals_ = members(n, causal=True, block_size=block, random_blocks=r, seed=4)
    assert globals_ == {0}, "first_last made causal keeps the first block only"
    for i, row in enumerate(table.tolist()):
        drawn = [j for j in row if j >= 0]
        candidates = [j for j in range(i + 1) if j < i - 1 and j != 0]
        assert len(set(drawn)) == len(drawn) == min(r, len(candidates)), (i, row)
        assert set(drawn) <= set(candidates), (i, row)
    # A prefix sees the blocks it saw alone (decoding with a cache).
    long = zoo.dense_mask("bigbird", 400, causal=True, block_size=block, seed=4)
    assert torch.equal(zoo.dense_mask("bigbird", 150, causal=True, block_size=block, seed=4),
                       long[:150, :150])  # fmt: skip
    assert torch.equal(draw_outside(50, 3, 4, 1, (0,), True)[:20],
                       draw_outside(20, 3, 4, 1, (0,), True))  # fmt: skip


def test_global_blocks_are_the_first_and_the_last_by_default():
    assert zoo.get_spec("bigbird").parameters()["global_position"] == "first_last"
    mask = zoo.dense_mask("bigbird", 200, block_size=16)  # 13 blocks, the last of 8 tokens
    for rows in (slice(0, 16), slice(192, 200)):
        assert mask[rows].all() and mask[:, rows].all()
    assert not mask[16:32].all() and not mask[:, 16:32].all(), "block 1 is not global"
    first = zoo.dense_mask("bigbird", 200, block_size=16, global_position="first")
    assert first[:32].all() and first[:, :32].all() and not first[192:].all()
    assert global_block_indices(2, "first_last", 7) == (0, 6)
    assert global_block_indices(3, "first_last", 7) == (0, 1, 6)
    assert global_block_indices(2, "first", 7) == (0, 1)
    assert global_block_indices(2, "first_last", 1) == (0,)


def test_first_last_made_causal_keeps_no_moving_global_block():
    """The last block would make every new token global while decoding: the causal form drops it,
    so the last block's queries read their window, block 0 and their random blocks only."""
    assert GlobalBlocks(2, 16).causal_form() == GlobalBlocks(1, 16, "first")
    causal = zoo.dense_mask("bigbird", 160, causal=True, block_size=16, random_blocks=1)
    assert causal[144:, :16].all() and not causal[150, 16:128].all()


def test_short_sequences_are_global_throughout():
    for n in (1, 16, 20, 32):
        assert zoo.dense_mask("bigbird", n, block_size=16).all(), n


def test_the_old_draw_is_reachable_and_unchanged():
    """``random_among="all"`` with ``global_position="first"`` is the union BigBird was before:
    random blocks among all key blocks, blocks 0 .. g - 1 global."""
    block, n = 16, 256
    old = BlockLocal(block, 1) | Global(2, block) | Random(block, 3, 5)
    for causal in (False, True):
        want = zoo.dense_mask(old, n, causal=causal)
        got = zoo.dense_mask(
            "bigbird", n, causal=causal, block_size=block, seed=5, random_among="all",
            global_position="first",
        )  # fmt: skip
        assert torch.equal(got, want), causal


def test_random_checks_its_new_parameters():
    with pytest.raises(ValueError, match="among must be one of 'all', 'outside', got 'inside'"):
        Random(among="inside")
    with pytest.raises(ValueError, match="global_position must be one of"):
        Random(global_position="last")
    with pytest.raises(ValueError, match="position must be one of"):
        zoo.dense_mask("bigbird", 64, block_size=8, global_position="middle")


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"random_per_head": "yes"}, ["random_per_head", "True or False", "'yes'"]),
        ({"global_blocks": 0}, ["global_blocks", "positive", "0"]),
        ({"global_position": "end"}, ["global_position", "'first_last'", "'end'"]),
        ({"window_neighbors": -1}, ["window_neighbors", "at least 0", "-1"]),
    ],
)
def test_a_bad_parameter_is_named_as_the_variant_takes_it(given, words):
    """bigbird passes its parameters to families that know them by other names (random_per_head
    is random's per_head): the error names the one the caller gave."""
    q = torch.randn(1, 2, 64, 8)
    with pytest.raises((TypeError, ValueError)) as error:
        zoo.attention(q, q, q, variant="bigbird", **given)
    assert str(error.value).startswith(words[0]), error.value
    assert all(w in str(error.value) for w in words), error.value
