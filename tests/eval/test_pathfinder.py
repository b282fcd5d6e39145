"""Pathfinder (eval/tasks/pathfinder.py): labels against the independent checker, balance,
purity, the image's layout, and the grid the harness hands to 2-D variants."""

from __future__ import annotations

import re

import pytest
import torch

from eval.harness.run import ConfigError, ModelConfig, RunConfig, cells, check_cells
from eval.harness.train import build_model, variant_params
from eval.tasks import get_task
from eval.tasks.pathfinder import BACKGROUND, MARKER, PATH, solve

SMALL = dict(seq_len=256, contour_length=5, distractor_length=2, num_distractors=4)


@pytest.mark.parametrize(
    "params",
    [SMALL, dict(seq_len=1024), dict(seq_len=1024, contour_length=8, gap=2, marker_radius=2)],
    ids=["16x16", "32x32", "32x32-gap2"],
)
def test_labels_match_the_flood_fill_checker(params: dict) -> None:
    task = get_task("pathfinder", **params)
    for seed in range(6):  # many seeds, few images each
        batch = task.sample(16, seed=seed)
        rows, labels = batch.inputs.tolist(), batch.targets.tolist()
        assert [solve(row, task.size, task.gap) for row in rows] == labels


def test_checker_sees_a_cut_path() -> None:
    """Erasing a positive image's path pixels (markers kept) must flip the checker to 0."""
    task = get_task("pathfinder", **SMALL)
    batch = task.sample(40, seed=5)
    positives = batch.inputs[batch.targets == 1]
    assert len(positives) > 0
    for row in positives:
        cut = torch.where(row == PATH, torch.tensor(BACKGROUND), row).tolist()
        assert solve(row.tolist(), task.size, task.gap) == 1
        assert solve(cut, task.size, task.gap) == 0


def test_balanced_seeded_and_pure() -> None:
    task = get_task("pathfinder", **SMALL)
    a, b = task.sample(41, seed=7), task.sample(41, seed=7)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, task.sample(41, seed=8).inputs)
    assert abs(int(a.targets.sum()) - 20.5) <= 0.5  # half of each class, one odd one out
    assert int(task.sample(100, seed=1).targets.sum()) == 50


def test_image_layout() -> None:
    task = get_task("pathfinder", seq_len=1024)
    assert task.grid == (32, 32) and task.vocab_size == 4 and task.num_classes == 2
    batch = task.sample(20, seed=2)
    assert batch.inputs.shape == (20, 1024) and batch.padding_mask is None
    assert set(batch.inputs.unique().tolist()) == {BACKGROUND, PATH, MARKER}
    # two circles of radius 1 (3 x 3 blocks): 18 marker pixels per image
    assert (batch.inputs == MARKER).sum(1).tolist() == [18] * 20
    assert (batch.slices["distance"] >= task.min_marker_distance).all()
    assert task.dash == 2 and get_task("pathfinder", seq_len=4096).dash == 4


@pytest.mark.parametrize(
    "params, words",
    [
        (dict(seq_len=1000), ["seq_len=1000", "square"]),
        (dict(seq_len=256, contour_length=40), ["contour_length=40", "too long"]),
        (dict(seq_len=256, min_marker_distance=2), ["min_marker_distance=2"]),
        (dict(seq_len=256, gap=-1), ["gap", "-1"]),
    ],
)
def test_bad_parameters(params: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        get_task("pathfinder", **params)
    assert all(w in str(error.value) for w in words), str(error.value)


@pytest.mark.parametrize("seq_len, words", [(64, "8 x 8"), (256, "seldom fit a 16 x 16")])
def test_an_image_too_small_for_the_defaults_names_the_smallest_that_fits(seq_len, words):
    """At 8 x 8 the derived min_marker_distance lets the circles touch; at 16 x 16 two snakes of
    14 paddles never fit, which sampling found only after the config checks, in every cell."""
    with pytest.raises(ValueError) as error:
        get_task("pathfinder", seq_len=seq_len)
    message = str(error.value)
    assert words in message and "min_marker_distance" in message, message
    assert "(not set: derived as size // 4)" in message  # a parameter the user never set
    smallest = int(re.search(r"use seq_len >= (\d+)", message).group(1))
    assert smallest > seq_len
    batch = get_task("pathfinder", seq_len=smallest).sample(16, seed=3)
    assert batch.inputs.shape == (16, smallest)


def _cell(variant: str, **over) -> dict:
    config = RunConfig(
        tasks=["pathfinder"], task_params={"pathfinder": {k: v for k, v in SMALL.items()
                                                          if k != "seq_len"}},
        variants=[variant], train_lengths=[256], **over,
    )  # fmt: skip
    return cells(config)[0]


def test_harness_passes_the_grid_to_2d_variants() -> None:
    task = get_task("pathfinder", **SMALL)
    assert variant_params(_cell("neighborhood_2d"), task)["grid"] == (16, 16)
    assert "grid" not in variant_params(_cell("local"), task)
    chosen = _cell("axial_2d", variant_params={"axial_2d": {"grid": [8, 32]}})
    assert variant_params(chosen, task)["grid"] == [8, 32]  # the config's own grid wins
    model = build_model(_cell("neighborhood_2d", model=ModelConfig(dim=16, depth=1)), task)
    assert model.blocks[0].attention.params["grid"] == (16, 16)
    batch = task.sample(2, seed=0)
    assert model(batch.inputs).shape == (2, 2)


def test_a_2d_model_is_not_tested_on_another_grid() -> None:
    cell = _cell("neighborhood_2d", test_lengths=[256, 1024])
    with pytest.raises(ConfigError, match="test 2-D variants at their train length"):
        check_cells([cell], "config.yaml")
    check_cells([_cell("local", test_lengths=[256, 1024])], "config.yaml")  # 1-D: any length
