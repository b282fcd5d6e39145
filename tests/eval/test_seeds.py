"""Which sequences a cell draws (eval/harness/seeds.py): torch's CPU generator reads only the low
32 bits of a seed, so every batch seed is laid out within them. Two cell seeds draw different
batches, the checks during training never score the evaluation's sequences, and a train batch
never meets an eval one."""

from __future__ import annotations

import itertools

import pytest
import torch

from eval.harness.seeds import BATCH_BITS, CHECK_OFFSET, SEED_BITS, draw_problem, sample_seed
from eval.harness.train import eval_batches
from eval.tasks import get_task


def test_the_generator_reads_32_bits_which_is_why_the_layout_exists():
    draw = lambda seed: torch.rand(4, generator=torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(draw(5), draw(5 + 2**32))


def test_every_batch_seed_is_distinct_and_within_32_bits():
    cell_seeds = (0, 1, 2, 2**SEED_BITS - 1)
    indices = (0, 1, 2, CHECK_OFFSET - 1, CHECK_OFFSET, 2**BATCH_BITS - 1)
    seeds = [
        sample_seed(c, stream, i)
        for c, stream, i in itertools.product(cell_seeds, ("train", "eval"), indices)
    ]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**32 for s in seeds)


def test_cell_seed_0_draws_as_before_the_layout():
    for stream, index in itertools.product(("train", "eval"), (0, 1, 7, 4000)):
        assert sample_seed(0, stream, index) == 2 * index + (stream == "eval")


def test_two_cell_seeds_draw_different_batches():
    task = get_task("mqar", seq_len=64, vocab_size=64, num_kv_pairs=4)
    for stream in ("train", "eval"):
        first, second = (task.sample(8, sample_seed(c, stream, 3)).inputs for c in (0, 1))
        assert not torch.equal(first, second), stream


def test_the_checks_score_sequences_of_their_own():
    cell = {"task": "mqar", "task_params": {"vocab_size": 64, "num_kv_pairs": 4}, "seed": 0,
            "train": {"eval_samples": 64, "eval_batch_size": 32}}  # fmt: skip
    evaluated = torch.cat([b.inputs for _, b in eval_batches(cell, 64)])
    checked = torch.cat([b.inputs for _, b in eval_batches(cell, 64, offset=CHECK_OFFSET)])
    rows = lambda x: {tuple(r) for r in x.tolist()}  # noqa: E731
    assert not rows(evaluated) & rows(checked)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((2**SEED_BITS, "train", 0), ["cell seed", str(2**SEED_BITS - 1), str(2**SEED_BITS)]),
        ((0, "train", 2**BATCH_BITS), ["train stream", f"2**{BATCH_BITS}", str(2**BATCH_BITS)]),
        ((-1, "eval", 0), ["cell seed", "-1"]),
        ((0, "evaluation", 0), ["stream", "'evaluation'", "'train', 'eval'"]),
    ],
)
def test_out_of_bounds_names_what_and_the_bound(args, words):
    with pytest.raises(ValueError) as error:
        sample_seed(*args)
    assert all(w in str(error.value) for w in words), error.value


TRAIN = {"steps": 100, "batch_size": 8, "eval_samples": 64, "eval_batch_size": 32}


@pytest.mark.parametrize(
    ("settings", "ranks", "words"),
    [
        ({"steps": 2**BATCH_BITS + 1}, 1, ["train.steps=1048577", "2**20"]),
        ({"steps": 2**BATCH_BITS // 2 + 1}, 2, ["on 2 data-parallel", "1048578"]),
        ({"until": "learned", "max_steps": 2**BATCH_BITS + 1}, 1, ["train.max_steps"]),
        ({"steps": 2**18, "batch_size": 64, "pool": 16}, 1, ["train.pool=16", "1048576 epochs"]),
        ({"eval_samples": CHECK_OFFSET + 1, "eval_batch_size": 1}, 1, ["train.eval_samples"]),
    ],
)
def test_settings_that_would_draw_past_a_cell_seed_are_refused_before_training(
    settings, ranks, words
):
    problem = draw_problem({**TRAIN, **settings}, ranks)
    assert problem is not None and all(w in problem for w in words), problem


@pytest.mark.parametrize(
    ("settings", "ranks"),
    [
        ({"steps": 2**BATCH_BITS}, 1),  # the last batch index is 2**20 - 1
        ({"steps": 2**BATCH_BITS // 2}, 2),
        ({"steps": 2**BATCH_BITS - 1, "pool": 1, "batch_size": 1}, 1),  # orders at 1 .. 2**20 - 1
        ({"steps": 2**BATCH_BITS // 2 - 1, "pool": 1, "batch_size": 2}, 2),  # ranks share epochs
        ({"eval_samples": CHECK_OFFSET, "eval_batch_size": 1}, 1),
    ],
)
def test_settings_at_the_bounds_draw(settings, ranks):
    assert draw_problem({**TRAIN, **settings}, ranks) is None


def test_the_bound_for_a_pool_is_its_epochs_not_its_steps():
    train = {**TRAIN, "steps": 2**BATCH_BITS, "pool": 1, "batch_size": 1}
    assert "2**20 - 1" in draw_problem(train)  # epoch 2**20 - 1 would draw its order at 2**20
    assert draw_problem({**train, "pool": 2}) is None  # 2**19 epochs


def test_the_drawn_indices_stay_within_what_draw_problem_allows(monkeypatch):
    """The largest batch index that training draws, a pool read by two data-parallel ranks and
    fresh batches, is the one draw_problem bounds."""
    from eval.harness import train
    from eval.harness.distributed import Context

    drawn = []
    real = train.sample_seed

    def recorded(seed: int, stream: str, index: int) -> int:
        drawn.append((stream, index))
        return real(seed, stream, index)

    monkeypatch.setattr(train, "sample_seed", recorded)
    task = get_task("mqar", seq_len=32, vocab_size=16, num_kv_pairs=2)
    for pool, steps in ((6, 10), (0, 10)):
        drawn.clear()
        for rank in (0, 1):
            draw = train.batches(task, 0, pool, 2, Context(rank, 2, torch.device("cpu")))
            for step in range(steps):
                draw(step)
        largest = max(i for stream, i in drawn if stream == "train")
        # 10 steps of a batch of 4 over 2 ranks: fresh, indices 0 .. 19; a pool of 6, the orders
        # of epochs 0 .. 6 at 1 .. 7, the bound's (steps x batch - 1) // pool + 1
        assert largest == (19 if not pool else (steps * 4 - 1) // pool + 1), (pool, largest)


def test_context_parallel_draws_once_per_step_whatever_its_processes():
    train = {**TRAIN, "steps": 2**BATCH_BITS // 2 + 1, "context_parallel": 2}
    assert draw_problem(train, 1) is None  # run.py passes 1 for sharded cells


OVERRIDES = [
    "tasks=[mqar]", "variants=[full]", "train_lengths=[32]", "test_lengths=[32]",
    f"train.steps={2**BATCH_BITS // 2 + 1}", "train.batch_size=8",
]  # fmt: skip


def test_the_data_parallel_bound_is_checked_with_the_run_s_processes():
    from eval.harness.config import ConfigError, load_config
    from eval.harness.run import RunConfig, cells, check_cells

    config = load_config(RunConfig, None, OVERRIDES)
    check_cells(cells(config), "test", world=1)
    with pytest.raises(ConfigError, match="on 2 data-parallel processes"):
        check_cells(cells(config), "test", world=2)
    # the same steps with the sequence sharded over the 2 processes: one batch a step
    sharded = load_config(RunConfig, None, [*OVERRIDES, "train.context_parallel=2"])
    check_cells(cells(sharded), "test", world=2)
