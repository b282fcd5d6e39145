"""Random blocks drawn per query head (``random`` with ``per_head``, ``bigbird``'s default
``random_per_head``): a fixed pattern with a head axis (zoo.patterns.random_blocks,
``Pattern.per_head``, ``Pattern.for_heads``). Each head's table holds exactly r distinct blocks
outside the window and the globals, heads differ, the same seed gives the same tables, and every
backend that takes it computes the reference's output and gradients (float64 where the backend
takes it), causal or not, padded or not, with grouped heads, at lengths off the block."""

import dataclasses

import pytest
import torch
from helpers import padding_mask, random_qkv

import zoo
from zoo.backends import BlockedBackend, FlexBackend
from zoo.core.prepare import prepare_call
from zoo.core.resolve import call_pattern
from zoo.functional import resolve_pattern
from zoo.layout.block_layout import specialized, with_heads
from zoo.patterns import FULL, Global, Random, RandomBlocks, made_causal
from zoo.testing.pattern_views import check_pattern

CPU = torch.device("cpu")
SMALL = dict(block_size=8, random_blocks=2)


def bigbird(n, heads=None, causal=False, **params):
    """(the random member's table, the global blocks) of ``bigbird`` at length n: [blocks, r]
    before ``for_heads``, [heads, blocks, r] after."""
    pattern = specialized(resolve_pattern("bigbird", causal, params), n, n, CPU)
    if heads is not None:
        pattern = with_heads(pattern, heads)
    union = pattern.children[0] if causal else pattern  # causal: Intersection(Union, Causal)
    table = next(c for c in union.children if isinstance(c, RandomBlocks)).table
    globals_ = next(c for c in union.children if isinstance(c, Global)).global_tokens
    return table, set(globals_)


@pytest.mark.parametrize("position", ["first_last", "first"])
@pytest.mark.parametrize(
    ("n", "block", "r", "w", "seed"),
    [(160, 16, 3, 1, 0), (1024, 64, 3, 1, 0), (300, 8, 4, 2, 3), (95, 8, 2, 1, 2)],
)
def test_each_head_draws_exactly_r_blocks_outside_window_and_globals(
    n, block, r, w, seed, position
):
    heads = 4
    params = dict(block_size=block, random_blocks=r, window_neighbors=w, seed=seed,
                  global_position=position)  # fmt: skip
    tables, globals_ = bigbird(n, heads, **params)
    blocks = -(-n // block)
    assert tables.shape == (heads, blocks, r)
    for h, table in enumerate(tables):
        for i, row in enumerate(table.tolist()):
            if i in globals_:
                continue  # a global row reads every key
            assert len(set(row)) == r and min(row) >= 0, (h, i, row)
            assert all(abs(j - i) > w and j not in globals_ and j < blocks for j in row), (h, i)
    distinct = {tuple(t.flatten().tolist()) for t in tables}
    assert len(distinct) == heads, "every head draws its own table"


def test_causal_heads_draw_among_earlier_blocks_outside_window_and_first_global():
    n, block, r, heads = 400, 8, 3, 3
    tables, globals_ = bigbird(n, heads, causal=True, block_size=block, random_blocks=r, seed=4)
    assert globals_ == {0}
    for h, table in enumerate(tables):
        for i, row in enumerate(table.tolist()):
            drawn = [j for j in row if j >= 0]
            candidates = [j for j in range(i + 1) if j < i - 1 and j != 0]
            assert len(set(drawn)) == len(drawn) == min(r, len(candidates)), (h, i, row)
            assert set(drawn) <= set(candidates), (h, i, row)
    assert not torch.equal(tables[0], tables[1])
    # A prefix sees, per head, the blocks it saw alone (decoding with a cache).
    short, _ = bigbird(150, heads, causal=True, block_size=block, random_blocks=r, seed=4)
    assert torch.equal(tables[:, : short.shape[1]], short)


def test_the_same_seed_gives_the_same_tables_on_every_call():
    n, heads = 300, 5
    first, _ = bigbird(n, heads, **SMALL, seed=7)
    blocks = -(-n // SMALL["block_size"])
    again = Random(SMALL["block_size"], 2, 7, "outside", 1, 2, per_head=True)
    assert torch.equal(first, again.head_tables(blocks, heads))
    assert torch.equal(bigbird(n, heads, **SMALL, seed=7)[0], first)
    # Head h is the shared table drawn with seed + h; head 0 is the shared table itself.
    for h in range(heads):
        shared, _ = bigbird(n, **SMALL, seed=7 + h, random_per_head=False)
        assert torch.equal(first[h], shared), h
    # A head's table does not depend on the number of heads; another seed, other tables.
    assert torch.equal(bigbird(n, 2, **SMALL, seed=7)[0], first[:2])
    assert not torch.equal(bigbird(n, heads, **SMALL, seed=8)[0], first)
    # Through zoo.attention: the call's pattern is drawn once per shape and number of heads.
    a = call_pattern("bigbird", False, dict(SMALL), n, n, CPU, heads=heads)
    assert a is call_pattern("bigbird", False, dict(SMALL), n, n, CPU, heads=heads)
    assert a is not call_pattern("bigbird", False, dict(SMALL), n, n, CPU, heads=3)


def test_a_per_head_pattern_is_fixed_with_a_head_axis_not_routed():
    n, heads = 100, 3
    head0 = specialized(resolve_pattern("bigbird", False, dict(SMALL)), n, n, CPU)
    drawn = with_heads(head0, heads)
    assert head0.per_head and drawn.per_head and not drawn.routed
    assert not zoo.get_spec("bigbird").build(random_per_head=False).per_head
    assert not zoo.get_spec("random").build().per_head, "random's default stays shared"
    dense = drawn.dense(n, n)
    assert dense.shape == (1, heads, n, n)
    assert torch.equal(dense[0, 0], head0.dense(n, n)), "head 0's views are the one-layout views"
    assert not torch.equal(dense[0, 1], dense[0, 0])
    member = next(c for c in drawn.children if isinstance(c, RandomBlocks))
    with pytest.raises(TypeError, match="use allowed_at"):
        member.allowed(torch.arange(n)[:, None], torch.arange(n)[None, :])
    with pytest.raises(ValueError, match="drawn for 3 query heads, the call has 4"):
        drawn.for_heads(4)
    q_pos, k_pos = torch.arange(n)[:, None], torch.arange(n)[None, :]
    h = torch.arange(heads)[:, None, None]
    assert torch.equal(drawn.allowed_at(torch.tensor(0), h, q_pos, k_pos), dense[0])


@pytest.mark.parametrize("causal", [False, True])
def test_the_three_views_of_every_head_agree(causal):
    for pattern in (
        zoo.get_spec("bigbird").build(**SMALL),
        Random(block_size=16, num_blocks=2, per_head=True),
    ):
        pattern = made_causal(pattern) if causal else pattern
        assert check_pattern(pattern, lengths=(37, 100)) > 0


# Backends against the reference: float64 where the backend takes it (flex: float32).
SHAPES = [(100, 100), (70, 100), (100, 70), (96, 96)]
BACKENDS = {
    "sdpa": "sdpa",
    "blocked-16": BlockedBackend(block_size=16),
    "blocked-64": BlockedBackend(),
}


def outputs_and_grads(backend, q, k, v, grad, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = zoo.attention(q, k, v, variant="bigbird", backend=backend, **kw)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]


@pytest.mark.parametrize("q_len,kv_len", SHAPES)
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backends_equal_the_reference_forward_and_backward(
    backend, causal, padded, kv_heads, q_len, kv_len
):
    q, k, v = random_qkv(3, 4, q_len, kv_len, head_dim=8, dtype=torch.float64, kv_heads=kv_heads)
    grad = torch.randn(3, 4, q_len, 8, generator=torch.Generator().manual_seed(1)).double()
    kw = dict(causal=causal, key_padding_mask=padding_mask(3, kv_len) if padded else None, **SMALL)
    want = outputs_and_grads("reference", q, k, v, grad, **kw)
    got = outputs_and_grads(BACKENDS[backend], q, k, v, grad, **kw)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want, strict=True):
        assert (g - w).abs().max().item() <= 1e-10, name
    # The heads differ from the shared table's, so the comparison above can fail.
    shared = outputs_and_grads("reference", q, k, v, grad, **kw, random_per_head=False)[0]
    assert torch.equal(shared[:, 0], want[0][:, 0]), "head 0 draws the shared table"
    assert (shared[:, 1:] - want[0][:, 1:]).abs().max().item() > 1e-3


@pytest.mark.parametrize("q_len,kv_len", [(100, 100), (70, 100)])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_flex_forward_equals_the_reference(causal, padded, q_len, kv_len):
    """Flex's eager path (CPU; its compiled backward runs on CUDA only): float32 against the
    float64 reference, grouped heads; per-head block masks, with and without padding."""
    q, k, v = random_qkv(3, 4, q_len, kv_len, head_dim=8, dtype=torch.float64, kv_heads=2)
    kw = dict(variant="bigbird", causal=causal, **SMALL)
    kw["key_padding_mask"] = padding_mask(3, kv_len) if padded else None
    want = zoo.attention(q, k, v, backend="reference", **kw)
    with torch.no_grad():
        got = zoo.attention(q.float(), k.float(), v.float(), backend=FlexBackend(16, False), **kw)
    assert (got.double() - want).abs().max().item() <= 1e-5


def test_compiled_flex_forward_equals_the_reference():
    """Compiled flex on CPU (forward only there): one block mask per head, built once per shape
    and number of heads, its mask_mod reading each head's table."""
    q, k, v = random_qkv(2, 4, 100, 100, head_dim=8, dtype=torch.float64, kv_heads=2)
    for padded in (False, True):
        kw = dict(variant="bigbird", **SMALL)
        kw["key_padding_mask"] = padding_mask(2, 100) if padded else None
        want = zoo.attention(q, k, v, backend="reference", **kw)
        with torch.no_grad():
            got = zoo.attention(q.float(), k.float(), v.float(), backend=FlexBackend(16), **kw)
        assert (got.double() - want).abs().max().item() <= 1e-5, padded


def test_xformers_declines_a_per_head_pattern_and_auto_runs_it():
    q, k, v = random_qkv(1, 2, 64, 64)
    on_cpu = dataclasses.replace(
        zoo.get_backend("xformers").capabilities, devices=("cpu",), backward=("cpu",)
    )
    call = prepare_call(q, k, v, variant="bigbird", block_size=16)
    assert (
        on_cpu.reason_against(call)
        == "it runs one layout for every head, not one per head ('bigbird')"
    )
    shared = prepare_call(q, k, v, variant="bigbird", block_size=16, random_per_head=False)
    assert on_cpu.reason_against(shared) is None, "the shared table goes on to xformers' planner"
    out = zoo.attention(q, k, v, variant="bigbird", block_size=16)  # auto
    want = zoo.attention(q, k, v, variant="bigbird", block_size=16, backend="reference")
    assert (out - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("heads", [None, 3], ids=["one_table", "per_head"])
@pytest.mark.parametrize("q_len,kv_len", [(100, 100), (100, 260), (260, 100)])  # offsets of 160
def test_spans_of_a_few_blocks_read_the_drawn_blocks_as_the_rectangles_count(heads, q_len, kv_len):
    """Where the host knows how many pattern blocks a span touches (aligned frames: a lookup
    table's squares of the block size or a divisor, a natural order's kernel blocks of a multiple
    or of neither), the random blocks' state is read from the drawn blocks one by one; the same
    as the prefix sums' rectangles give (the path for any span, forced by forgetting that the
    spans align)."""
    from zoo.layout.frames import build_frame
    from zoo.patterns.random_blocks import _reach

    random = Random(block_size=8, num_blocks=3, seed=5, per_head=heads is not None)
    pattern = specialized(random, q_len, kv_len, CPU)
    if heads is not None:
        pattern = with_heads(pattern, heads)
        assert pattern.table.shape[0] == heads
    for size in (1, 4, 8, 16, 20, 32):
        frame = build_frame(1, q_len, kv_len, size, size, CPU)
        q, k = frame.q.spans().column(), frame.k.spans().row()
        reach = {1: 1, 4: 1, 8: 1, 16: 2, 20: 4, 32: 4}[size]  # the read path, both sides
        assert _reach(q, 8) == _reach(k, 8) == reach
        read = pattern.block_state(q, k)
        counted = pattern.block_state(*(dataclasses.replace(s, aligned=None) for s in (q, k)))
        assert torch.equal(read, counted), size
        assert size > 8 or int((read == FULL).sum()) > 0


@pytest.mark.parametrize("causal", [False, True])
def test_dense_mask_with_heads_gives_the_masks_attention_runs(causal):
    """``zoo.dense_mask("bigbird", L)`` gave head 0's mask with no way to ask for another head's:
    a user masking scores by it got heads 1.. wrong. ``heads=H`` gives each head's mask, and
    softmax over scores masked by it equals ``zoo.attention`` head by head."""
    q, k, v = (t.detach() for t in random_qkv(1, 3, 200, 200, head_dim=8, seed=3))
    params = dict(block_size=16, random_blocks=2, causal=causal)
    masks = zoo.dense_mask("bigbird", 200, heads=3, **params)
    assert masks.shape == (3, 200, 200)
    assert torch.equal(masks[0], zoo.dense_mask("bigbird", 200, **params))
    assert not torch.equal(masks[1], masks[0])
    scores = (q @ k.transpose(-1, -2)) * 8**-0.5
    expected = torch.softmax(scores.masked_fill(~masks, float("-inf")), -1) @ v
    out = zoo.attention(q, k, v, variant="bigbird", backend="reference", **params)
    torch.testing.assert_close(out, expected)
    assert zoo.dense_mask("local", 20, heads=2).shape == (2, 20, 20)
    with pytest.raises(ValueError, match="heads must be a positive int or None, got 0"):
        zoo.dense_mask("local", 20, heads=0)
