"""PNG pictures of patterns and attention maps: their size, their content and their errors."""

from __future__ import annotations

import matplotlib.image
import numpy as np
import pytest
import torch

import zoo
from zoo.views.graph_pictures import draw_graph
from zoo.views.pictures import (
    PIXELS,
    attention_map_of_random_model,
    draw_attention,
    draw_gallery,
    draw_pattern,
)

N = 64  # small, so the pictures are quick


def pixels(path) -> np.ndarray:
    return matplotlib.image.imread(path)


def assert_picture(path) -> np.ndarray:
    image = pixels(path)
    width, height = PIXELS
    assert image.shape[:2] == (height, width) == (600, 600)
    assert image[..., :3].std() > 0.05  # not a blank canvas
    return image


@pytest.mark.parametrize("name", zoo.list_variants())
def test_every_variant_draws_a_600_pixel_square(name, tmp_path):
    path = draw_pattern(name, N, tmp_path / f"{name}.png")
    assert path == tmp_path / f"{name}.png"
    assert_picture(path)


def test_a_variant_chosen_by_content_draws_the_blocks_one_input_chose(tmp_path):
    few = pixels(draw_pattern("moba", N, tmp_path / "a.png", block_size=8, top_k=2))
    every = pixels(draw_pattern("moba", N, tmp_path / "b.png", block_size=8, top_k=8))
    assert every[..., 0].mean() < few[..., 0].mean()  # more chosen blocks, more dark cells
    assert_picture(attention_map_of_random_model("moba", 32, tmp_path / "c.png", block_size=8))


def test_overrides_and_causal_change_the_picture(tmp_path):
    narrow = pixels(draw_pattern("local", N, tmp_path / "a.png", window_size=2))
    wide = pixels(draw_pattern("local", N, tmp_path / "b.png", window_size=20))
    causal = pixels(draw_pattern("local", N, tmp_path / "c.png", causal=True, window_size=20))
    # More allowed pairs draw more dark cells.
    assert wide[..., 0].mean() < causal[..., 0].mean() < narrow[..., 0].mean()


@pytest.mark.parametrize("name", ["local", "bigbird"])
def test_attention_map_of_a_random_model(name, tmp_path):
    before = torch.get_rng_state()
    first = assert_picture(attention_map_of_random_model(name, 32, tmp_path / "a.png"))
    again = pixels(attention_map_of_random_model(name, 32, tmp_path / "b.png"))
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random stream is untouched
    assert np.array_equal(first, again)  # the seed fixes the model and the input
    other = pixels(attention_map_of_random_model(name, 32, tmp_path / "c.png", seed=1))
    assert not np.array_equal(first, other)


def test_attention_map_passes_variant_parameters(tmp_path):
    path = attention_map_of_random_model("local", 32, tmp_path / "a.png", window_size=2, dim=32)
    assert_picture(path)


def test_draw_attention_from_module_weights(tmp_path):
    module = zoo.create_attention("local", dim=32, num_heads=2, window_size=3)
    _, weights = module(torch.randn(2, 20, 32), return_weights=True)
    assert_picture(draw_attention(weights, tmp_path / "w.png", batch=1, head=1, title="x"))


@pytest.mark.parametrize(("argument", "kwargs"), [("batch", {"batch": 2}), ("head", {"head": -1})])
def test_draw_attention_rejects_an_index_outside_the_tensor(argument, kwargs, tmp_path):
    weights = torch.rand(2, 4, 8, 8)
    with pytest.raises(ValueError, match=rf"{argument} must be an int in \[0, \d\]"):
        draw_attention(weights, tmp_path / "w.png", **kwargs)
    assert not (tmp_path / "w.png").exists()


def test_draw_attention_rejects_a_tensor_that_is_not_4d(tmp_path):
    with pytest.raises(ValueError, match="batch, heads, queries, keys"):
        draw_attention(torch.rand(8, 8), tmp_path / "w.png")


@pytest.mark.parametrize("draw", [draw_pattern, attention_map_of_random_model])
def test_unknown_variant_suggests_close_names(draw, tmp_path):
    with pytest.raises(ValueError, match="did you mean 'bigbird'"):
        draw("bigbrid", N, tmp_path / "x.png")


@pytest.mark.parametrize("draw", [draw_pattern, attention_map_of_random_model])
@pytest.mark.parametrize("seq_len", [0, -3])
def test_non_positive_length_names_seq_len(draw, seq_len, tmp_path):
    with pytest.raises(ValueError, match=f"seq_len must be a positive int, got {seq_len}"):
        draw("local", seq_len, tmp_path / "x.png")


@pytest.mark.parametrize("draw", [draw_pattern, attention_map_of_random_model, draw_gallery])
def test_a_length_too_long_to_draw_is_refused_before_any_mask(draw, tmp_path, monkeypatch):
    """A picture holds the dense n x n mask: 100000 positions took 10 GB before a pixel was
    drawn. Refused by name, before any mask is made."""
    import zoo.views.pictures as pictures

    monkeypatch.setattr(pictures, "dense_mask", lambda *a, **k: pytest.fail("a mask was made"))
    args = (
        (tmp_path / "x.png", 100_000)
        if draw is draw_gallery
        else ("local", 100_000, tmp_path / "x.png")
    )
    with pytest.raises(ValueError, match=r"seq_len=100000 is too long to draw.*seq_len <= 4096"):
        draw(*args)


def test_unknown_parameter_is_zoos_error(tmp_path):
    with pytest.raises(TypeError, match="window_size"):
        draw_pattern("local", N, tmp_path / "x.png", widow_size=3)


def test_unwritable_paths_fail_before_drawing(tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "x.png"
    with pytest.raises(ValueError, match="does not exist"):
        draw_pattern("local", N, missing)
    blocker = tmp_path / "file.txt"
    blocker.write_text("a file, not a directory")
    with pytest.raises(ValueError, match=r"file\.txt.*is a file"):
        draw_pattern("local", N, blocker / "x.png")
    with pytest.raises(ValueError, match="is a directory"):
        attention_map_of_random_model("local", N, tmp_path)
    weights = torch.rand(1, 1, 4, 4)
    with pytest.raises(ValueError, match="does not exist"):
        draw_attention(weights, missing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_the_gallery_draws_every_variant_but_the_graph(tmp_path):
    """``zoo gallery``: one picture, a panel per variant (graph has no pairs without edges), each
    titled with its name."""
    import unittest.mock

    from matplotlib.figure import Figure

    from zoo.views import pictures

    titles = []
    original = Figure.add_subplot

    def recording(self, *args, **kwargs):
        axes = original(self, *args, **kwargs)
        titles.append(axes)
        return axes

    with unittest.mock.patch.object(Figure, "add_subplot", recording):
        path = pictures.draw_gallery(tmp_path / "variants.png", seq_len=64)
    rows = -(-len(titles) // 4)
    expected = (round(3.4 * rows * pictures.DPI), round(3.2 * 4 * pictures.DPI))
    assert matplotlib.image.imread(path).shape[:2] == expected
    drawn = [axes.get_title().split(" (")[0] for axes in titles]
    assert drawn == [name for name in zoo.list_variants() if name != "graph"]
    with pytest.raises(ValueError, match="seq_len"):
        pictures.draw_gallery(tmp_path / "bad.png", seq_len=0)


@pytest.mark.parametrize("reorder", [True, False])
def test_the_graph_picture_says_which_order_the_call_runs_in(reorder):
    """``zoo show graph reorder=false`` titled its right panel "RCM order", the order the module
    docstring says the call runs in, though with reorder=False the call runs in the caller's."""
    figure = draw_graph(64, (6.0, 6.0), reorder=reorder)
    title = figure.axes[1].get_title()
    assert title.startswith("RCM order") and ("not run: reorder=False" in title) is not reorder
