"""Which sequences a cell draws (eval/harness/seeds.py): torch's CPU generator reads only the low
32 bits of a seed, so every batch seed is laid out within them. Two cell seeds draw different
batches, the checks during training never score the evaluation's sequences, and a train batch
never meets an eval one."""

from __future__ import annotations

import itertools

import pytest
import torch

from eval.harness.seeds import BATCH_BITS, SEED_BITS, sample_seed
from eval.harness.train import CHECK_OFFSET, eval_batches
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
    ],
)
def test_out_of_bounds_names_what_and_the_bound(args, words):
    with pytest.raises(ValueError) as error:
        sample_seed(*args)
    assert all(w in str(error.value) for w in words), error.value


def test_too_many_evaluation_batches_would_meet_the_checks():
    cell = {"task": "mqar", "task_params": {}, "seed": 0,
            "train": {"eval_samples": CHECK_OFFSET + 1, "eval_batch_size": 1}}  # fmt: skip
    with pytest.raises(ValueError, match="eval_samples"):
        next(eval_batches(cell, 64))
