"""The blocked backend's plan reads every allowed pair exactly once, and its key sources merge by
log-sum-exp to the attention over their concatenation, forward and backward."""

from __future__ import annotations

import pytest
import torch
from helpers import FIXED_VARIANTS, check_against_reference, small_params

import zoo
from zoo.backends import lse_merge
from zoo.backends.blocked import BlockedBackend
from zoo.backends.blocked.block_plan import part_block, plan
from zoo.backends.blocked.key_windows import KeyWindows
from zoo.backends.blocked.row_grid import RowGrid, row_grid
from zoo.backends.lse_merge import Piece, merged_attention
from zoo.functional import prepare_call
from zoo.layout.block_layout import head_layout
from zoo.layout.frames import build_frame


def read_pairs(variant, causal, q_len, kv_len, block, params, split=False, heads=1, head=0):
    """(Lq, Lk) how many times the plan's groups leave each (query, key) pair unmasked (with
    ``split``, global queries split from their blocks, as the CPU path plans). A layout drawn
    per head (bigbird's random blocks) is planned per head, as blocked runs it: head 0's here,
    whose pairs are ``dense_mask``'s (or head ``head`` of ``heads``)."""
    q = torch.zeros(1, heads, q_len, 8)
    k = torch.zeros(1, 1, kv_len, 8)
    call = prepare_call(q, k, k, variant=variant, causal=causal, **params)
    count = torch.zeros(q_len, kv_len, dtype=torch.int64)
    for part in head_layout(call.pattern, head).parts():
        frame = build_frame(part.stride, q_len, kv_len, block, block, torch.device("cpu"))
        for group in plan(part, frame, 0.25, split):
            q_slot = group.query_slots(block)
            per_row = q_slot.shape[1]
            q_ok = frame.q.valid[q_slot.flatten()]
            q_tok = frame.q.index[q_slot.flatten()]
            read = ~group.masked.flatten(0, 1)  # (R * bq, columns)
            k_slot = group.k_slot.repeat_interleave(per_row, 0)
            read &= q_ok[:, None] & frame.k.valid[k_slot]
            rows, cols = torch.nonzero(read, as_tuple=True)
            k_tok = frame.k.index[k_slot[rows, cols]]
            count.index_put_((q_tok[rows], k_tok), torch.ones_like(rows), accumulate=True)
    return count


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(
    "variant,params",
    [
        ("local", {"window_size": 40}),
        ("longformer", {"window_size": 24, "global_tokens": [0, 5, 170]}),
        ("bigbird", {"block_size": 16, "random_blocks": 2, "window_blocks": 3}),
        ("strided", {"stride": 7}),
        ("dilated", {"window_size": 6, "dilation": 3}),
        ("block_local", {"block_size": 16}),
    ],
)
@pytest.mark.parametrize("q_len,kv_len", [(200, 200), (150, 200)])
@pytest.mark.parametrize("split", [False, True], ids=["blocks", "split"])
def test_every_allowed_pair_is_read_once(variant, params, causal, q_len, kv_len, split):
    params = {k: v for k, v in params.items() if k in zoo.get_spec(variant).parameters()}
    count = read_pairs(variant, causal, q_len, kv_len, 16, params, split)
    allowed = zoo.dense_mask(variant, q_len, kv_len, causal=causal, **params)
    assert torch.equal(count, allowed.to(torch.int64))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_each_head_of_bigbird_drawn_per_head_is_read_once(causal):
    """blocked runs a layout drawn per head head by head, each on its own plan: every head's
    pairs are read exactly once, and the heads' pairs differ."""
    heads, n, params = 3, 200, {"block_size": 8, "random_blocks": 2}
    q = torch.zeros(1, heads, n, 8)
    dense = prepare_call(q, q, q, variant="bigbird", causal=causal, **params).pattern.dense(n, n)
    assert not torch.equal(dense[0, 0], dense[0, 1])
    for h in range(heads):
        for split in (False, True):
            count = read_pairs("bigbird", causal, n, n, 16, params, split, heads, h)
            assert torch.equal(count, dense[0, h].to(torch.int64)), (h, split)


def test_registry_variants_are_read_once():
    for variant in FIXED_VARIANTS:
        params = small_params(variant)
        count = read_pairs(variant, False, 100, 100, 16, params)
        allowed = zoo.dense_mask(variant, 100, 100, **params)
        assert torch.equal(count, allowed.to(torch.int64)), variant


def test_longformer_and_bigbird_read_their_band_as_a_view():
    """The band groups that make Longformer and BigBird fast: a band, the global columns as
    shared blocks and (BigBird) the random blocks as extra ones."""
    n = 1024
    for variant, params, sources in [
        ("longformer", {"window_size": 128}, (5 * 64, 1, 0)),  # one global key, not its block
        ("bigbird", {"block_size": 64, "random_blocks": 3}, (3 * 64, 2 * 64, 3 * 64)),
    ]:
        q = torch.zeros(1, 1, n, 8)
        (part,) = head_layout(prepare_call(q, q, q, variant=variant, **params).pattern, 0).parts()
        frame = build_frame(part.stride, n, n, 64, 64, torch.device("cpu"))
        groups = plan(part, frame, 0.25)
        banded = [g for g in groups if g.window is not None]
        assert len(banded) == 1 and banded[0].widths == sources, variant
        assert banded[0].rows.numel() >= n // 64 - 4


def test_merged_pieces_equal_one_softmax_forward_and_backward():
    """Three sources of keys for the same queries, and a fourth piece holding half the rows in
    another order (as a second part in its own token order would): merged, they equal one
    softmax over all keys, forward and backward, with rows that have no key in some pieces or in
    all of them."""
    torch.manual_seed(0)
    q = torch.randn(3, 2, 16, 8, dtype=torch.float64, requires_grad=True)
    widths = [24, 8, 16, 5]
    keys = [torch.randn(3, 2, w, 8, dtype=torch.float64, requires_grad=True) for w in widths]
    values = [torch.randn(3, 2, w, 8, dtype=torch.float64, requires_grad=True) for w in widths]
    allowed = torch.rand(3, 1, 16, sum(widths)) < 0.4
    allowed[0, 0, 3] = False  # a query with no key anywhere
    allowed[1, 0, 5, :24] = False  # a query with no key in the first source
    allowed[1, 0, 6, 24:] = False  # nor in the others
    order = torch.randperm(16)[:8]  # the last piece holds these rows only
    allowed[:, :, :, 48:] &= torch.isin(torch.arange(16), order)[None, None, :, None]
    mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    rows = torch.arange(3)[:, None] * 16 + torch.arange(16)
    pieces = []
    for i, m in enumerate(mask.split(widths, dim=-1)):
        if i < 3:
            none = torch.isneginf(m).all(-1)  # the first three hold every row: written, not merged
            pieces.append(Piece(q, keys[i], values[i], m, none, rows, fresh=True))
        else:
            m = m[:, :, order]
            none = torch.isneginf(m).all(-1)
            pieces.append(Piece(q[:, :, order], keys[i], values[i], m, none, rows[:, order]))
    out = merged_attention(pieces, 48, 0.3).unflatten(0, (3, 16)).transpose(1, 2)

    k, v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    expected = weights @ v
    assert torch.allclose(out, expected, atol=1e-12)
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    grad = torch.randn_like(out)
    inputs = [q, *keys, *values]
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(expected, inputs, grad)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_residue_groups_of_a_few_blocks_run_as_one_block_each(causal):
    """A residue frame whose groups hold a few blocks' worth of keys takes one block per group
    (stride 4 over 100 tokens: groups of 25 keys, blocks of 25, not 8): the plan is one block
    per group, and the output and gradients match the reference, with padding, as a union with
    a band in another order."""
    backend = BlockedBackend(block_size=8)
    q = torch.zeros(1, 1, 100, 8)
    call = prepare_call(q, q, q, variant="strided", stride=4, window_size=3, causal=causal)
    residue = [p for p in call.pattern.parts() if p.stride == 4]
    assert len(residue) == 1
    frame = backend._frame(call, residue[0])
    assert frame.k.block == 25
    assert all(g.width == 1 for g in plan(residue[0], frame, backend.waste))
    check_against_reference(
        "strided", backend, q_len=100, kv_len=100, causal=causal, padded=True,
        params={"stride": 4, "window_size": 3}, v_dim=16,
    )  # fmt: skip


@pytest.mark.parametrize("v_dim", [16, 8], ids=["merged", "fused"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_narrow_band_runs_at_half_the_block(causal, v_dim):
    """A band narrow against the block (8 keys each side, 3 apart: 17 in a residue frame of
    stride 3) runs at half the backend's block, where the plan computes half the pairs; output
    and gradients match the reference on both CPU paths, with padding."""
    params = {"window_size": 8, "dilation": 3}
    q = torch.zeros(1, 1, 1000, 8)
    (part,) = prepare_call(q, q, q, variant="dilated", causal=causal, **params).pattern.parts()
    assert part_block(part, 1000, 1000, 64, 0.25, torch.device("cpu")) == 32
    check_against_reference(
        "dilated", BlockedBackend(), q_len=1000, kv_len=1000, causal=causal, padded=True,
        params=params, v_dim=v_dim,
    )  # fmt: skip


@pytest.mark.parametrize("chunk_blocks", [1, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_band_backward_in_chunks_of_query_blocks(causal, chunk_blocks, monkeypatch):
    """The CPU path runs a band's backward a few query blocks at a time and adds each chunk's
    window gradient into the keys' (``lse_merge.CHUNK_BYTES``): with chunks of 1 and of 3 blocks
    (the last one short), grouped-query heads and padding, output and gradients match the
    reference, and the band's backward did run in that many chunks."""
    width = (3 if causal else 5) * 16  # the band: blocks r - 2 .. r (+ 2) of 16 keys
    monkeypatch.setattr(lse_merge, "CHUNK_BYTES", chunk_blocks * 2 * width * 16 * 4)
    chunks = []
    add_grad = KeyWindows.add_grad

    def counted(self, grad_x, grad, first=0):
        chunks.append(grad.shape[0])
        return add_grad(self, grad_x, grad, first)

    monkeypatch.setattr(KeyWindows, "add_grad", counted)
    check_against_reference(
        "longformer", BlockedBackend(block_size=16), q_len=320, kv_len=320, causal=causal,
        padded=True, params={"window_size": 24, "global_tokens": [0]}, v_dim=16, heads=4,
        kv_heads=2,
    )  # fmt: skip
    assert chunks and max(chunks) == chunk_blocks


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_global_queries_leave_their_blocks(causal):
    """Global tokens inside blocks of ordinary queries (3 and 150 in blocks of 16) run as a query
    group of their own on the CPU path, the rest of their blocks as ordinary rows: the group holds
    exactly the global queries, and output and gradients match the reference, with padding."""
    params = {"window_size": 8, "global_tokens": [3, 150]}
    q = torch.zeros(1, 1, 320, 8)
    (part,) = prepare_call(q, q, q, variant="longformer", **params).pattern.parts()
    frame = build_frame(part.stride, 320, 320, 16, 16, torch.device("cpu"))
    groups = plan(part, frame, 0.25, True)  # split_queries
    assert groups[-1].q_slot.tolist() == [[3, 150]]
    assert all(g.q_slot is None for g in groups[:-1])
    check_against_reference(
        "longformer", BlockedBackend(block_size=16), q_len=320, kv_len=320, causal=causal,
        padded=True, params=params, v_dim=16,
    )  # fmt: skip


def test_rows_on_a_grid_merge_in_place_as_gathered_rows_do():
    """``row_grid`` finds the grid of a band's rows and of a residue order's (token r + 64 t at
    (r, t)), and none for rows off a grid, decreasing or with a dropped row; pieces that carry
    their grid (written and merged through views of the output) give the same output and
    gradients as the same pieces gathered by index."""
    band = torch.arange(2, 10)[:, None] * 4 + torch.arange(4)  # blocks 2..9 of 4 queries
    residues = torch.arange(64)[:, None] + torch.arange(128) * 64
    assert row_grid(band, 64) == RowGrid(8, 4, 1)
    assert row_grid(residues, 8192) == RowGrid(0, 1, 64)
    assert row_grid(band.flip(1), 64) is None  # decreasing rows: no view of them
    assert row_grid(band[:1], 64) == RowGrid(8, 4, 1)
    assert row_grid(residues[:, :1], 8192) == RowGrid(0, 1, 64)
    assert row_grid(band[:, :1], 64) == RowGrid(8, 4, 32)
    assert row_grid(band[:, ::2], 64) == RowGrid(8, 4, 2)
    spaced = torch.arange(4)[:, None] * 5 + torch.arange(2) * 2  # rows 0 2, 5 7, 10 12, ...
    assert row_grid(spaced, 64) is None  # a grid, but in neither order that a view reads
    off = band.clone()
    off[3, 2] = 0
    assert row_grid(off, 64) is None
    assert row_grid(band, 39) is None  # rows 39 and up are dropped rows

    torch.manual_seed(0)
    q = torch.randn(4, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(4, 2, w, 8, dtype=torch.float64, requires_grad=True) for w in (5, 7)]
    values = [torch.randn(4, 2, w, 8, dtype=torch.float64, requires_grad=True) for w in (5, 7)]
    masks = [torch.zeros(4, 1, 6, w, dtype=torch.float64) for w in (5, 7)]
    for m in masks:
        m.masked_fill_(torch.rand(m.shape) < 0.5, float("-inf"))
    rows = [torch.arange(24).view(4, 6), torch.arange(4)[:, None] + torch.arange(6) * 4]

    grad = torch.randn(24, 2, 8, dtype=torch.float64)

    def merged(grids: bool):
        pieces = [
            Piece(q, k, v, m, torch.isneginf(m).all(-1), r, fresh=i == 0,
                  grid=row_grid(r, 24) if grids else None)
            for i, (k, v, m, r) in enumerate(zip(keys, values, masks, rows, strict=True))
        ]  # fmt: skip
        out = merged_attention(pieces, 24, 0.3)
        return out, torch.autograd.grad(out, [q, *keys, *values], grad)

    (out, grads), (want, want_grads) = merged(True), merged(False)
    assert torch.allclose(out, want, atol=1e-12)
    for a, b in zip(grads, want_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_band_and_residue_groups_merge_on_a_grid(causal):
    """Strided at 2048 tokens, as the blocked backend plans it on a CPU: the band's group of
    consecutive query blocks and the residue order's group (one block per residue, stride 64)
    find their rows' grids, so their merge reads and writes views, not gathers."""
    from zoo.backends.blocked.merged import _rows

    q = torch.zeros(1, 1, 2048, 8)
    call = prepare_call(q, q, q, variant="strided", causal=causal)
    backend = BlockedBackend()
    for part in call.pattern.parts():
        frame, groups = backend._plan(call, part, split_queries=True)
        banded = [g for g in groups if g.window is not None]
        assert banded, part
        for group in banded:
            rows, grids, _ = _rows(frame, group, 1, 2048)
            assert grids[0] is not None, (part, group.rows)
            n, m = rows[0].shape
            got = grids[0].view(torch.arange(2049), n, m)
            assert torch.equal(got, rows[0])
