"""2-D patterns on a grid: NATTEN's neighborhood at the borders, with dilation and causal axes;
every CPU backend against the reference; the tiled token order; errors."""

from __future__ import annotations

import pytest
import torch
from helpers import check_against_reference

import zoo
from zoo.backends import BlockedBackend, FlexBackend
from zoo.layout.block_layout import build_layout, specialized
from zoo.layout.frames import build_frame
from zoo.patterns import Global, Tiles, axial_2d, block_local_2d, neighborhood_2d

CPU = torch.device("cpu")


def natten_keys(i: int, size: int, k: int, d: int, causal: bool) -> set[int]:
    """NATTEN's definition (Hassani et al., 2023: a window of k neighbours shifted inward at the
    borders, within the query's residue class under dilation), one query on one axis, by
    enumeration."""
    members = [j for j in range(size) if j % d == i % d]  # i's residue class
    x, n = members.index(i), len(members)
    if causal:
        return {members[y] for y in range(n) if y <= x and x - y < k}
    left, right = k // 2, k // 2 + k % 2 - 1
    centre = min(max(x, left), n - 1 - right)
    return {members[y] for y in range(centre - left, centre + right + 1)}


NEIGHBORHOODS = [
    dict(kernel_size=3, grid=(6, 7)),
    dict(kernel_size=(4, 3), grid=(7, 6)),  # an even kernel: left 2, right 1
    dict(kernel_size=(3, 2), dilation=(2, 3), grid=(9, 8)),
    dict(kernel_size=3, causal_axes=(True, False), grid=(6, 6)),
    dict(kernel_size=(2, 3), dilation=2, causal_axes=(False, True), grid=(7, 9)),
]


@pytest.mark.parametrize("params", NEIGHBORHOODS, ids=str)
def test_neighborhood_is_nattens_definition(params):
    p = neighborhood_2d(**params)
    (h, w), (kh, kw), (dh, dw) = p.grid, p.kernel_size, p.dilation
    ch, cw = p.causal_axes
    n = h * w
    expected = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        rows = natten_keys(q // w, h, kh, dh, ch)
        cols = natten_keys(q % w, w, kw, dw, cw)
        for r in rows:
            for c in cols:
                expected[q, r * w + c] = True
    assert torch.equal(zoo.dense_mask(p, n), expected)
    if not (ch or cw):  # the window shifts inward: every query, border or not, sees kh * kw keys
        assert (expected.sum(1) == kh * kw).all()
    assert zoo.check_pattern(p, lengths=[n, (n // 2, n), (n + 3, n)], block_sizes=[4, 16, (8, 32)])


def test_registry_call_of_the_issue():
    q = torch.randn(1, 1, 64 * 64, 8)
    mask = zoo.dense_mask("neighborhood_2d", 4096, 4096, grid=(64, 64), kernel_size=7)
    assert (mask.sum(1) == 49).all()
    out = zoo.attention(q, q, q, variant="neighborhood_2d", grid=(64, 64), kernel_size=7)
    assert out.shape == q.shape


VARIANTS = [
    neighborhood_2d(kernel_size=(3, 5), dilation=(2, 1), grid=(8, 10)),
    neighborhood_2d(kernel_size=3, causal_axes=(True, True), grid=(8, 10)),
    axial_2d(grid=(8, 10)),
    block_local_2d(window_size=(3, 4), grid=(8, 10)),
    neighborhood_2d(kernel_size=3, grid=(8, 10)) | Global(1),  # a class token, two orders
]
BACKENDS = {
    "blocked": BlockedBackend(block_size=16),
    "sdpa": "sdpa",
    "flex-eager": FlexBackend(block_size=16, compile=False),
}


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("pattern", VARIANTS, ids=lambda p: repr(p)[:40])
def test_backends_match_the_reference(pattern, backend, causal):
    """Forward and backward (flex: forward; it declares no backward on CPU), with key padding."""
    check_against_reference(
        pattern, BACKENDS[backend], q_len=80, kv_len=80, causal=causal, padded=True, params={},
        grads=not backend.startswith("flex"),
    )  # fmt: skip


@pytest.mark.parametrize("pattern", VARIANTS[:2], ids=lambda p: repr(p)[:40])
def test_compiled_flex_forward(pattern):
    check_against_reference(
        pattern, FlexBackend(block_size=16), q_len=50, kv_len=80, padded=True, params={},
        grads=False,
    )  # fmt: skip


def test_tiled_order_round_trips_and_is_what_blocked_runs():
    p = specialized(neighborhood_2d(kernel_size=3, dilation=(2, 1), grid=(10, 12)), 100, 120, CPU)
    assert p.stride == Tiles((10, 12), (2, 1))
    frame = build_frame(p.stride, 100, 120, 16, 16, CPU)
    x = torch.randn(2, 120, 3)
    assert torch.equal(frame.k.scatter(frame.k.gather(x, dim=1), dim=1), x)
    y = torch.randn(2, 100, 3)
    assert torch.equal(frame.q.scatter(frame.q.gather(y, dim=1), dim=1), y)
    # Each block is one 4 x 4 tile of one residue class: rows 2 apart.
    block = frame.k.position.view(-1, 16)[0]
    assert block.tolist() == [r * 12 + c for r in (0, 2, 4, 6) for c in range(4)]


def test_tiles_make_a_large_neighborhood_sparser():
    """13 x 13 on 64 x 64 at the blocked kernel's block of 64: the committed density table."""
    p = specialized(neighborhood_2d(kernel_size=13, grid=(64, 64)), 4096, 4096, CPU)
    row_major = build_layout(p, build_frame(1, 4096, 4096, 64, 64, CPU)).density()
    tiled = build_layout(p, build_frame(p.stride, 4096, 4096, 64, 64, CPU)).density()
    assert tiled < 0.6 * row_major


def test_aligned_windows_need_no_mask():
    p = specialized(block_local_2d(window_size=8, grid=(32, 32)), 1024, 1024, CPU)
    state = build_layout(p, build_frame(p.stride, 1024, 1024, 64, 64, CPU)).state
    assert set(state.unique().tolist()) == {0, 2}  # EMPTY or FULL: every tile is a window


def test_errors_name_the_argument():
    q = torch.randn(1, 1, 90, 8)
    with pytest.raises(ValueError, match=r"grid=\(8, 10\) has 80 cells but the sequence has 90"):
        zoo.attention(q, q, q, variant="neighborhood_2d", grid=(8, 10), kernel_size=3)
    with pytest.raises(ValueError, match=r"kernel_size \* dilation <= 9 rows of grid=\(9, 10\)"):
        zoo.attention(q, q, q, variant="neighborhood_2d", grid=(9, 10), kernel_size=5, dilation=2)
    with pytest.raises(ValueError, match=r"window_size=.* is larger than grid"):
        zoo.dense_mask("block_local_2d", 90, grid=(9, 10), window_size=10)
    with pytest.raises(ValueError, match="causal_axes must be a"):
        neighborhood_2d(causal_axes=True)
    with pytest.raises(ValueError, match="grid must be an"):
        axial_2d(grid=64)
    with pytest.raises(ValueError, match=r"kernel_size\[1\] must be"):
        neighborhood_2d(kernel_size=(3, 0))


@pytest.mark.parametrize("grid, most", [((1, 512), 1.1), ((2, 256), 1.1), ((16, 32), 0.55)])
def test_tiles_of_a_grid_of_few_rows_are_not_mostly_padding(grid, most):
    """axial_2d on a grid of one or two rows is full attention: in 8 x 8 tiles whatever the grid,
    blocked computed 15.5x (1 x 512) and 4x (2 x 256) the Lq x Lk scores; now tiles as wide
    as the grid needs (1 x 64, 2 x 32)."""
    from zoo.layout.tiles import tile_shape

    q = torch.randn(1, 1, 512, 8)
    text = zoo.explain(q, q, q, variant="axial_2d", grid=grid, backend="blocked")
    share = float(text.split(" of Lq x Lk")[0].rsplit(" ", 1)[-1])
    assert share <= most, text
    assert tile_shape(64, 1, 512) == (1, 64) and tile_shape(64, 2, 256) == (2, 32)
    assert tile_shape(64, 30, 16) == (8, 8) and tile_shape(64) == (8, 8)  # square where it fits
    assert tile_shape(16, 30, 16) == (4, 4)  # 512 padded cells against 2 x 8's 480: within 1.25x
